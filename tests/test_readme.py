"""The README teaches in at most 150 lines (issue 21, item 1) and everything it moved lives in
docs/: its links resolve, its model file really pipelines, its command table is the CLI's."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from helpers import run_cli

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_readme_is_short() -> None:
    assert len(README.splitlines()) <= 150


def test_every_link_of_the_readme_and_docs_resolves() -> None:
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"


def test_the_readme_says_what_a_newcomer_needs() -> None:
    for needed in ("docs/report-vgg16.png", "source .venv/bin/activate", "make demo", "make test",
                   "--replicas 1", "pipecc profile", "import pipecc", "xdg-open",
                   "A compiled folder is code", "the modules\n`model.py` imports"):
        assert needed in README, needed
    assert (ROOT / "docs" / "report-vgg16.png").is_file()


def test_the_command_table_lists_every_subcommand() -> None:
    from pipecc.cli.app import build_parser
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    listed = set(re.findall(r"^\| `pipecc ([\w-]+)", README, re.MULTILINE))
    assert listed == set(sub.choices), listed ^ set(sub.choices)


def test_the_readme_model_file_pipelines_over_two_cpus(tmp_path: Path, capsys) -> None:
    """The 15-line model file, planned as the end-to-end example asks (`--replicas 1`)."""
    code = re.search(r"```python\n(.*?)```", README, re.S).group(1)
    assert len(code.strip().splitlines()) <= 17
    model = tmp_path / "mymodel.py"
    model.write_text(code)
    status, out, err = run_cli(["plan", str(model), "-b", "32", "--devices", "2xcpu", "--replicas", "1",
                                "--use-all-devices", "--json", "-q"], capsys)
    assert status == 0, err
    plan = json.loads(out)
    assert len(plan["stages"]) >= 2 and plan["replicas"] == 1 and plan["microbatches"] >= 2
