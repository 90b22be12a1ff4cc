"""The Python API as a newcomer meets it (issue 21, item 9): `dir(pipecc)` lists the public
names, and a plan or a pipelined module prints as a short summary, not a dataclass dump or
nn.Module's tree of every adopted submodule; `pm.plan.summary()` returns the stage table."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import pipecc
from pipecc.ir.plan import Plan, devices_text


@pytest.fixture(scope="module")
def pm() -> pipecc.PipelinedModule:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    return pipecc.compile(model, (torch.randn(8, 16),), ["cpu", "cpu"], microbatches=2, schedule="1f1b")


def test_dir_lists_the_public_names_and_each_resolves() -> None:
    assert dir(pipecc) == sorted([*pipecc.__all__, "__version__"])
    assert {"compile", "load", "PipelinedModule", "Plan"} <= set(pipecc.__all__)
    assert "Any" not in dir(pipecc) and "_Any" not in pipecc.__all__
    for name in pipecc.__all__:
        assert getattr(pipecc, name) is not None
    namespace: dict = {}
    exec("from pipecc import *", namespace)
    assert set(pipecc.__all__) <= set(namespace)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        pipecc.nope  # noqa: B018


def test_plan_repr_is_one_short_line(pm: pipecc.PipelinedModule) -> None:
    plan = pm.plan
    assert isinstance(plan, pipecc.Plan)
    text = repr(plan)
    assert "\n" not in text and len(text) < 200, text
    assert text.startswith("Plan(Sequential: 2 stages on 2x cpu, batch 8 in 2 micro-batches, schedule 1f1b, ")
    assert text.endswith(" per iteration predicted)")
    # the dataclass's own repr would list every field, stage and node
    assert "StagePlan" not in text and "decisions" not in text


def test_one_stage_one_micro_batch_is_singular(pm: pipecc.PipelinedModule) -> None:
    stage = dataclasses.replace(pm.plan.stages[0], nodes=[n for s in pm.plan.stages for n in s.nodes])
    one = dataclasses.replace(pm.plan, stages=[stage], microbatches=1, devices=pm.plan.devices[:1])
    text = repr(one)
    assert "1 stage on cpu, batch 8 in 1 micro-batch," in text, text
    assert "1 stages" not in one.summary_text() and "1 micro-batches" not in one.summary_text()
    replicated = dataclasses.replace(one, replicas=2, devices=pm.plan.devices)
    assert "1 stage x 2 replicas on 2x cpu" in repr(replicated)


def test_summary_returns_the_stage_table(pm: pipecc.PipelinedModule, capsys) -> None:
    """`print(pm.plan.summary())` prints the table (issue 30: it returned None, printing "None");
    the call itself prints nothing, and writes the table to `file` when given one."""
    import io
    plan = pm.plan
    out = plan.summary()
    assert capsys.readouterr().out == ""
    assert out == plan.summary_text() == str(plan)
    stream = io.StringIO()
    assert plan.summary(file=stream) == out and stream.getvalue() == out + "\n"
    lines = out.splitlines()
    assert " ".join(line.strip() for line in lines[:lines.index("")]) == repr(plan)  # wrapped at 100
    assert all(len(line) <= 100 for line in lines)
    assert any(line.startswith("times predicted from the roofline") for line in lines)
    header = next(i for i, line in enumerate(lines) if line.startswith("stage "))
    assert lines[header].split() == ["stage", "device", "first", "node", "last", "node", "nodes", "fwd", "bwd",
                                     "comm", "peak", "mem"]
    rows = lines[header + 2: header + 2 + len(plan.stages)]
    for row, stage in zip(rows, plan.stages):
        cells = row.replace(" *", "").split()
        assert cells[:5] == [str(stage.index), "cpu", stage.nodes[0], stage.nodes[-1], str(len(stage.nodes))]
    assert sum("*" in row for row in rows) == 1  # the bottleneck stage
    assert any(line.startswith("bottleneck ") and "per micro-batch" in line for line in lines)


def test_pipelined_module_repr_is_one_line(pm: pipecc.PipelinedModule) -> None:
    text = repr(pm)
    assert text == "PipelinedModule(Sequential: stages=2, microbatches=2, devices=[cpu, cpu], schedule 1f1b)"
    # nn.Module's repr would print the adopted Linear/ReLU tree
    assert "Linear" not in text


def test_devices_text_counts_runs() -> None:
    assert devices_text(["a100", "a100", "v100", "a100"]) == "2x a100, v100, a100"
    assert devices_text(["cpu"]) == "cpu" and devices_text([]) == "no devices"


def test_plan_round_trips_with_the_new_methods(pm: pipecc.PipelinedModule) -> None:
    again = Plan.from_json(pm.plan.to_json())
    assert again == pm.plan and repr(again) == repr(pm.plan)
