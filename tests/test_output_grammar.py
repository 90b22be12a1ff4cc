"""What people read says "1 stage" and "1 micro-batch" (issue 21, item 10: "1 micro-batches",
"1 stages"), and `cost --by-module` fills its `formula (fwd)` column (it was empty on every
row): each module's formula is the sum of its nodes' expressions."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import sympy

from helpers import MLP_TINY, model_args, run_cli, zoo_path
from pipecc import driver
from pipecc.report.compiled import load_compiled, summary_text
from pipecc.report.dot import dot_text
from pipecc.report.formatting import count
from pipecc.report.text import plan_table

MLP = str(zoo_path("mlp"))
TINY = [f"--model-arg={a}" for a in model_args(MLP_TINY)]


def test_count_says_one_in_the_singular() -> None:
    assert [count(n, "stage") for n in (0, 1, 2)] == ["0 stages", "1 stage", "2 stages"]
    assert [count(n, "micro-batch") for n in (1, 4)] == ["1 micro-batch", "4 micro-batches"]
    assert count(1, "op") == "1 op" and count(3, "op") == "3 ops"
    assert count(2, "index", "indices") == "2 indices"


@pytest.fixture(scope="module")
def one_stage(tmp_path_factory) -> Path:
    """A compiled folder with one stage and one micro-batch (one device, -m 1)."""
    return tmp_path_factory.mktemp("grammar") / "one"


def test_compile_and_plan_of_one_stage_one_micro_batch_are_singular(one_stage: Path, capsys) -> None:
    code, out, err = run_cli(["compile", MLP, *TINY, "--devices", "cpu", "-b", "4", "-m", "1",
                              "-o", str(one_stage)], capsys)
    assert code == 0, err
    wrote = next(line for line in out.splitlines() if line.startswith("wrote "))
    assert re.search(r": 1 stage, schedule \S+, 1 micro-batch; run it with", wrote), wrote
    plan = load_compiled(one_stage).plan
    table = plan_table(plan, verbose=True)
    assert "batch 4, 1 micro-batch, schedule" in table, table
    assert "1 micro-batches" not in table and " 1 stages" not in table
    inspected = summary_text(load_compiled(one_stage))
    assert ": mlp, 1 stage on 1 device" in inspected and "1 micro-batch of 4" in inspected, inspected
    assert "1 stages" not in dot_text(plan, None) and "1 stage," in dot_text(plan, None)


def test_plan_decisions_say_one_micro_batch(capsys) -> None:
    analysis = driver.analyze(MLP, model_args=MLP_TINY, batch_size=4)
    plan, _ = driver.plan(analysis, "cpu", microbatches=1, schedule="gpipe")
    assert any(d.startswith("schedule gpipe with 1 micro-batch of 4:") for d in plan.decisions), plan.decisions
    assert not any("1 micro-batches" in d or "1 stages" in d for d in plan.decisions), plan.decisions
    two = dataclasses.replace(plan, microbatches=2)
    assert "batch 4, 2 micro-batches, schedule" in plan_table(two)


def test_cost_by_module_fills_the_formula_column(capsys) -> None:
    code, out, err = run_cli(["cost", str(zoo_path("gpt")), "-b", "2", "--by-module", "2",
                              "--model-arg=n_layer=2", "--model-arg=n_head=2", "--model-arg=n_embd=32",
                              "--model-arg=vocab_size=101", "--model-arg=block_size=16",
                              "--model-arg=seq_len=8"], capsys)
    assert code == 0, err
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("module "))
    end = lines[header].index("formula (fwd)") + len("formula (fwd)")  # the column is right-aligned
    rows = lines[header + 2: lines.index("", header)]
    assert rows and all(row[end - 1] != " " for row in rows), rows  # no empty cell
    by_name = {row.split()[0]: row.split() for row in rows}
    # a block's formula is the sum of its nodes' (per-node table, same model)
    code, per_node, _ = run_cli(["cost", str(zoo_path("gpt")), "-b", "2", "--json",
                                 "--model-arg=n_layer=2", "--model-arg=n_head=2", "--model-arg=n_embd=32",
                                 "--model-arg=vocab_size=101", "--model-arg=block_size=16",
                                 "--model-arg=seq_len=8"], capsys)
    nodes = json.loads(per_node)["nodes"]
    block = [n for n in nodes if n["name"].startswith("blocks.0.")]
    want = sum((sympy.sympify(n["forward_flops_expr"]) for n in block), sympy.Integer(0))
    row = by_name["blocks.0"]
    assert row[1:3] == [str(len(block)), "ops"]
    assert sympy.simplify(sympy.sympify(row[4]) - want) == 0, (row, want)
    singles = [r for r in by_name.values() if r[1] == "1"]
    assert singles and all(r[2] == "op" for r in singles)  # "1 op", not "1 ops"
