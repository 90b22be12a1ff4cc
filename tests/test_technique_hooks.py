"""The planner's search and the driver reach the techniques through the protocol
(`pipecc.techniques`: `parts(layer)` and each part's optional hooks, in `TECHNIQUES` order),
never by a technique's name: checked on the source (AST, nothing of the checked modules run).
The replica groups (`techniques.replicas`, the planner's own dimension d) and `capabilities`
(data every layer asks) are the exceptions, as docs/techniques.md says."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from helpers import ROOT
from pipecc import techniques

NAMES = {t.__name__.rpartition(".")[2] for t in techniques.TECHNIQUES}
ALLOWED = {"replicas", "capabilities"}
SHARED = sorted((ROOT / "passes").rglob("*.py")) + [ROOT / "pipecc" / "driver.py"]

# hook -> the techniques whose part gives it (the protocol docstring of `pipecc.techniques`)
HOOKS = {("search", "before_search"): ["bpipe"], ("search", "candidate"): ["recompute"],
         ("search", "after_search"): ["bpipe"], ("search", "nothing_fits"): ["recompute"],
         ("search", "plan_fields"): ["bpipe"], ("plan", "base_options"): ["umpipe"],
         ("search", "schedules"): ["bpipe"], ("search", "decision_lines"): ["bpipe"],
         ("search", "all_devices"): ["umpipe", "bpipe"]}


def technique_names_used(source: str) -> list[tuple[int, str]]:
    """(line, technique) for every import of a technique package other than `ALLOWED`
    (`import pipecc.techniques.x`, `from pipecc.techniques.x import ...`, `from
    pipecc.techniques import x`) and every attribute `techniques.x` of the package."""
    out = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] if node.module != "pipecc.techniques" else \
                [f"pipecc.techniques.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "techniques":
            names = [f"pipecc.techniques.{node.attr}"]
        for name in names:
            parts = name.split(".")
            if parts[:2] == ["pipecc", "techniques"] and len(parts) > 2 and parts[2] in NAMES - ALLOWED:
                out.append((node.lineno, parts[2]))
    return out


def test_the_checker_finds_every_form() -> None:
    source = ("from pipecc.techniques.bpipe import search as b\nimport pipecc.techniques.umpipe.plan\n"
              "def f():\n    from pipecc.techniques import recompute, replicas\n"
              "    return techniques.zero_bubble.requires, techniques.requires, techniques.replicas\n"
              "from pipecc.techniques.replicas import search\nfrom pipecc.techniques import capabilities\n")
    assert sorted(technique_names_used(source)) == [(1, "bpipe"), (2, "umpipe"), (4, "recompute"), (5, "zero_bubble")]


@pytest.mark.parametrize("path", SHARED, ids=lambda p: str(p.relative_to(ROOT)))
def test_shared_planner_modules_name_no_technique(path: Path) -> None:
    """`passes/` and the driver iterate `techniques.parts(...)` and call hooks by role: adding a
    technique touches its package and one registration line, not them."""
    used = technique_names_used(path.read_text())
    assert not used, (f"{path.relative_to(ROOT)} names technique {used[0][1]} (line {used[0][0]}): "
                      "call its part through `pipecc.techniques.parts(layer)` and an optional hook")


@pytest.mark.parametrize("layer,hook", sorted(HOOKS))
def test_each_hook_is_given_by_the_techniques_the_protocol_names(layer: str, hook: str) -> None:
    """A part that gives a hook by accident (a helper of the same name) would be called by the
    search: each hook comes from exactly the parts the protocol docstring names."""
    givers = [p.__name__.split(".")[2] for p in techniques.parts(layer) if callable(getattr(p, hook, None))]
    assert givers == HOOKS[(layer, hook)]
    assert f"{layer}.{hook}(" in techniques.__doc__
