"""The layering, checked on the source (AST, nothing imported): no import cycles, `passes/`
never imports `backends/`, the runtime never imports the compiler, modules stay small
enough to read in one sitting (600 lines at most, the runtime's included; no comment excuses
a longer one), and each technique's scope rule lives in its own package (`pipecc/techniques/<name>/`).

Every import counts, also those inside functions: a lazy import that closes a cycle is still
a cycle a reader has to untangle (this is how `cli` <-> `run_cmd` and `inspect` <-> `report`
hid before the re-layering)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from helpers import ROOT

# installed name -> folder in the checkout (setup.cfg's package_dir)
PACKAGE_DIRS = {"pipecc": ROOT / "pipecc", "pipecc.passes": ROOT / "passes",
                "pipecc.backends": ROOT / "backends", "pipecc.models": ROOT / "models"}
MAX_LINES = 600
TECHNIQUES_DIR = ROOT / "pipecc" / "techniques"
# A technique package (`pipecc/techniques/<name>/`) holds parts of several layers; each part
# follows its layer's import rules, named by its module: `<name>.search`/`<name>.plan` (and
# `search_*`/`plan_*`) are planner passes, `<name>.runtime*` runtime, `<name>.codegen*` a backend's,
# `<name>.report*` the report's; the package's `__init__` (its rule) and every other module of it
# belong to the IR (pure functions over plans and schedules).
PART_LAYERS = {"search": "passes", "plan": "passes", "runtime": "runtime", "codegen": "backends", "report": "report"}
# names the admissibility check had before it became each technique's one `requires`
OLD_CHECK_NAMES = ("why_not", "scope", "refusal", "check_plan", "check_bipartition", "check_recompute",
                   "check_replicas", "check_microbatch_sizes")
# What pipecc/runtime (and a technique's runtime part) may import from pipecc besides the runtime
# and the IR (the schedule IR, the plan and the techniques' rules: pure data and functions, so the
# folder loader asks the same `requires` as compile): errors, the model-file loader (imports torch
# only) and, for an FPGA stage's rank, the FPGA backend's C-simulation module.
RUNTIME_MAY_IMPORT = ("pipecc.errors", "pipecc.frontend.modelfile", "pipecc.backends.fpga")
# What the IR may import: nothing of the compiler around it (report.formatting, how numbers and
# tables are written, imports only pipecc.errors: the plan's summary for people uses it).
IR_MAY_IMPORT = ("pipecc.errors", "pipecc.ir", "pipecc.report.formatting")


def layer_of(module: str) -> str | None:
    """The layer whose import rules `module` follows: "ir", "passes", "runtime", "backends",
    "report", or None (the driver, CLI, API and the rest, which may import any layer)."""
    parts = module.split(".")
    if parts[:2] == ["pipecc", "techniques"]:
        if len(parts) >= 4:
            for prefix, layer in PART_LAYERS.items():
                if parts[3] == prefix or parts[3].startswith(prefix + "_"):
                    return layer
        return "ir"
    top = parts[1] if len(parts) > 1 else ""
    return {"ir": "ir", "passes": "passes", "runtime": "runtime", "backends": "backends",
            "report": "report"}.get(top)


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module pipecc installs."""
    out: dict[str, Path] = {}
    for pkg, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            if "__pycache__" in path.parts or "templates" in path.parts:
                continue
            rel = path.relative_to(folder).with_suffix("").parts
            name = ".".join((pkg, *rel))
            out[name.removesuffix(".__init__")] = path
    return out


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The longest known module that `name` names (a.b.c -> a.b if c is an attribute)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The pipecc modules `module` imports (anywhere in the file)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module if is_pkg else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    parent = parent.rpartition(".")[0]
                base = f"{parent}.{base}" if base else parent
            targets = [f"{base}.{a.name}" for a in node.names]
        for t in targets:
            if t.split(".")[0] != "pipecc":
                continue
            hit = _resolve(t, known)
            if hit and hit != module:
                out.add(hit)
    return out


def import_graph() -> dict[str, set[str]]:
    known = modules()
    graph = {m: imports_of(m, p, known) for m, p in known.items()}
    # NOTE: the root package's __init__ only forwards attribute access lazily
    # (`pipecc.compile` -> pipecc.api); importing `pipecc.x` runs it but not those imports.
    graph["pipecc"] = set()
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (iterative DFS, three colours)."""
    state: dict[str, int] = {}
    for start in sorted(graph):
        if state.get(start):
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        state[start] = 1
        while stack:
            node, children = stack[-1]
            for child in children:
                if state.get(child) == 1:
                    return path[path.index(child):] + [child]
                if not state.get(child):
                    state[child] = 1
                    path.append(child)
                    stack.append((child, iter(sorted(graph.get(child, ())))))
                    break
            else:
                state[node] = 2
                path.pop()
                stack.pop()
    return None


def test_the_checker_finds_cycles_and_lazy_imports(tmp_path: Path) -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from pipecc.passes import balance\n    import pipecc.ir.plan\n")
    known = {"pipecc.passes.balance": f, "pipecc.ir.plan": f, "pipecc.x.m": f}
    assert imports_of("pipecc.x.m", f, known) == {"pipecc.passes.balance", "pipecc.ir.plan"}


def test_no_import_cycles() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def _bad_edges(layer: str, allowed: tuple[str, ...], also: tuple[str, ...] = ("ir",)) -> list[str]:
    """Imports by modules of `layer` of anything but `allowed` (prefixes) and the modules of
    the layers `also` (a technique package's parts included)."""
    return sorted(f"{m} imports {t}" for m, ts in import_graph().items() if layer_of(m) == layer
                  for t in ts if not any(t == a or t.startswith(a + ".") for a in allowed)
                  and layer_of(t) not in also)


def test_technique_parts_get_their_layer() -> None:
    assert layer_of("pipecc.techniques.bpipe") == "ir"
    assert layer_of("pipecc.techniques.capabilities") == "ir"
    assert layer_of("pipecc.techniques.bpipe.search") == "passes"
    assert layer_of("pipecc.techniques.umpipe.plan_costs") == "passes"
    assert layer_of("pipecc.techniques.bpipe.runtime") == "runtime"
    assert layer_of("pipecc.techniques.bipartition.codegen") == "backends"
    assert layer_of("pipecc.passes.partition") == "passes" and layer_of("pipecc.driver") is None


def test_passes_never_import_backends() -> None:
    bad = sorted(f"{m} imports {t}" for m, ts in import_graph().items()
                 if layer_of(m) == "passes" for t in ts if layer_of(t) == "backends")
    assert not bad, bad


def test_runtime_never_imports_the_compiler() -> None:
    bad = _bad_edges("runtime", RUNTIME_MAY_IMPORT, also=("ir", "runtime"))
    assert not bad, bad


def test_ir_imports_nothing_around_it() -> None:
    bad = _bad_edges("ir", IR_MAY_IMPORT)
    assert not bad, bad


# A technique package the backends and the compile checks may import by name: the replica groups
# are every plan's structure (a group of one without the technique; docs/techniques.md)
STRUCTURAL_TECHNIQUES = ("replicas",)


def test_backends_and_compile_checks_ask_techniques_through_the_protocol() -> None:
    """No module of `backends/` nor `pipecc/compile_checks.py` imports a technique package
    (`pipecc/techniques/<name>/`) or one of its parts by name: they iterate the protocol
    (`pipecc.techniques.parts`, a part's optional hooks). `pipecc.techniques` itself and its
    non-package modules (`capabilities`, ...) are no technique; the replicas are structural."""
    packages = {p.parent.name for p in TECHNIQUES_DIR.glob("*/__init__.py")} - set(STRUCTURAL_TECHNIQUES)
    assert {"bpipe", "bipartition", "recompute", "umpipe"} <= packages, packages
    known = modules()
    bad = sorted(f"{m} imports {t}" for m, path in known.items()
                 if m.startswith("pipecc.backends.") or m == "pipecc.compile_checks"
                 for t in imports_of(m, path, known)
                 if t.split(".")[:2] == ["pipecc", "techniques"] and len(t.split(".")) > 2
                 and t.split(".")[2] in packages)
    assert not bad, bad


@pytest.mark.parametrize("module", sorted(modules()))
def test_modules_stay_readable(module: str) -> None:
    path = modules()[module]
    lines = path.read_text().count("\n")
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines, over {MAX_LINES}: split it"


def technique_tags() -> dict[str, str]:
    """Technique module name -> its TAG (the words every reason of its `requires` starts with)."""
    out = {}
    for path in sorted(TECHNIQUES_DIR.glob("*/__init__.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "TAG" for t in node.targets):
                out[path.parent.name] = ast.literal_eval(node.value)
    return out


def _strings(tree: ast.AST) -> list[str]:
    """The string constants a module raises or returns (f-strings' literal parts included):
    where a refusal is written. Docstrings and comments may name a technique."""
    outs = [n for n in ast.walk(tree) if isinstance(n, (ast.Raise, ast.Return))]
    return [c.value for n in outs for c in ast.walk(n) if isinstance(c, ast.Constant) and isinstance(c.value, str)]


def test_each_technique_rule_lives_in_its_module() -> None:
    """A technique's scope rule is written once: in `pipecc/techniques/<t>.py`, whose reasons
    start with its TAG. No other module spells a TAG in a string (a second copy of a refusal),
    each technique module defines `requires` and `uses`, and none of the old names of the
    check survives as a function anywhere."""
    tags = technique_tags()
    assert set(tags) >= {"bpipe", "umpipe", "bipartition", "recompute", "replicas", "zero_bubble"}, tags
    bad = []
    for module, path in modules().items():
        tree = ast.parse(path.read_text())
        names = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        bad += [f"{module} defines {n}(): the check is its technique's `requires`" for n in names & set(OLD_CHECK_NAMES)]
        rel = path.relative_to(TECHNIQUES_DIR).parts if path.is_relative_to(TECHNIQUES_DIR) else ()
        owner = rel[0] if len(rel) > 1 else None
        if owner in tags and rel[1:] == ("__init__.py",):
            bad += [f"{module} lacks {n}()" for n in ("requires", "uses") if n not in names]
        for technique, tag in tags.items():
            if technique != owner and any(tag in t for t in _strings(tree)):
                bad.append(f"{module} spells {tag!r}: {technique}'s rule belongs in its package, pipecc/techniques/{technique}/")
    assert not bad, bad


def test_the_rule_checker_finds_a_copied_rule(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text('"""activation balancing (BPipe)"""\ndef check(p):\n'
                 '    raise ValueError(f"activation balancing (BPipe) runs {p} only")\n')
    assert [t for t in _strings(ast.parse(f.read_text())) if "activation balancing (BPipe)" in t] == [
        "activation balancing (BPipe) runs "]
    assert technique_tags()["bpipe"] == "activation balancing (BPipe)"


# What pipecc/runtime and pipecc/ir may import of a technique by name: the capabilities, and the
# replica groups (`techniques.replicas.runtime.Replicas` and its helpers), which are every rank's
# structure (a group of one without the technique). The protocol itself (`pipecc.techniques`:
# `parts`, `TECHNIQUES`) is not a technique; the rest of a technique they reach through
# `parts(layer)` and a hook's name (`getattr(part, "hook", None)`).
SHARED_MAY_NAME = ("capabilities", "replicas")


def _dynamic_imports(tree: ast.AST) -> set[str]:
    """The modules a file imports by a literal name through ``importlib.import_module`` or
    ``__import__`` (a name computed at run time, as `parts` builds its own, is not read)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            if (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")) in ("import_module",
                                                                                             "__import__"):
                out.add(node.args[0].value)
    return out


def technique_names(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The `pipecc/techniques/<name>` modules and packages `module` imports by name, anywhere in
    the file (function-level imports and literal importlib calls included)."""
    dynamic = {hit for name in _dynamic_imports(ast.parse(path.read_text())) if (hit := _resolve(name, known))}
    return {t.split(".")[2] for t in imports_of(module, path, known) | dynamic
            if t.startswith("pipecc.techniques.")}


def test_the_technique_name_checker_finds_lazy_and_dynamic_imports(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("import importlib\nfrom pipecc import techniques\n"
                 "def f():\n    from pipecc.techniques.bpipe.schedule import bpipe\n"
                 "    importlib.import_module('pipecc.techniques.umpipe.runtime')\n"
                 "    importlib.import_module('pipecc.techniques')\n")
    known = {"pipecc.techniques": f, "pipecc.techniques.bpipe.schedule": f, "pipecc.techniques.umpipe.runtime": f,
             "pipecc.ir.m": f}
    assert technique_names("pipecc.ir.m", f, known) == {"bpipe", "umpipe"}


def test_runtime_and_ir_name_no_technique() -> None:
    """pipecc/runtime and pipecc/ir (not the techniques' parts) import no technique by name but
    `SHARED_MAY_NAME`: the folder loader, the engine, the messages and the schedule registry call
    a technique's part through `parts(layer)` and an optional hook's name.

    The schedule registry keeps one lazy import, through importlib, of the protocol
    (`pipecc.ir.schedule.registry._technique_hook`: `importlib.import_module("pipecc.techniques")`,
    then `parts("schedule")`): the techniques' rules import the registry (`UNEVEN`, `schedule_for`),
    so a written import of `pipecc.techniques` there would be the cycle registry -> pipecc.techniques
    -> its rules -> registry that `test_no_import_cycles` refuses. It runs when a schedule is built,
    after every module involved has loaded (importing a technique's schedule module by name, as the
    registry did before, ran the same rules through the package's `__init__`)."""
    known = modules()
    bad = sorted(f"{m} imports pipecc.techniques.{name}" for m, path in known.items()
                 if m.startswith(("pipecc.runtime.", "pipecc.ir.")) or m in ("pipecc.runtime", "pipecc.ir")
                 for name in technique_names(m, path, known) if name not in SHARED_MAY_NAME)
    assert not bad, bad
    registry = known["pipecc.ir.schedule.registry"]
    assert _dynamic_imports(ast.parse(registry.read_text())) == {"pipecc.techniques"}


def technique_data_types() -> dict[str, list[str]]:
    """Technique module name -> the names of its plan data types (its rule's `DATA`)."""
    out = {}
    for path in sorted(TECHNIQUES_DIR.glob("*/__init__.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "DATA" for t in node.targets):
                elements = getattr(node.value, "elts", [])
                out[path.parent.name] = [e.id for e in elements if isinstance(e, ast.Name)]
    return out


def test_the_ir_names_no_technique_data_type() -> None:
    """A technique's side data in the plan is its package's type (`pipecc.ir.plan_data`): no
    module of pipecc/ir/ names one, so adding a technique's data never edits the IR."""
    types = technique_data_types()
    assert {"umpipe", "bipartition"} <= set(types) and all(types.values()), types
    names = [name for kinds in types.values() for name in kinds]
    bad = [f"{path.relative_to(ROOT)} names {name}"
           for path in sorted((ROOT / "pipecc" / "ir").rglob("*.py"))
           for name in names if re.search(rf"\b{name}\b", path.read_text())]
    assert not bad, bad
