"""Bi-Partition in the planner: the plan's FP/BP ranges and their pieces, the exact
search against brute force (spec §3.2 example), the lower bound, and the CLI."""
from __future__ import annotations

import pytest

from pipecc.errors import PipeccError
from pipecc.ir.plan import Plan, StagePlan


def _plan(fwd: list[list[str]], bwd: list[list[str]]) -> Plan:
    stages = [StagePlan(index=j, device=j, nodes=f, backward_nodes=b)
              for j, (f, b) in enumerate(zip(fwd, bwd))]
    return Plan(model="m", batch_size=4, microbatches=2, schedule="1f1b",
                devices=[{"name": "cpu", "kind": "cpu"}] * len(fwd), stages=stages,
                split_layers=[], bottleneck_s=1.0, lower_bound_s=1.0,
                predicted_iteration_s=1.0, bubble_fraction=0.0)


def test_pieces_without_bipartition_are_the_stages():
    plan = _plan([["a", "b"], ["c"]], [[], []])
    assert not plan.is_bipartition()
    assert plan.bipartition_pieces() == [("core", 0, 0, ["a", "b"]), ("core", 1, 1, ["c"])]


def test_pieces_name_segments_in_both_directions():
    # a = (0, 3, 5, 7), c = (0, 2, 6, 7) over nodes n0..n6
    n = [f"n{i}" for i in range(7)]
    plan = _plan([n[0:3], n[3:5], n[5:7]], [n[0:2], n[2:6], n[6:7]])
    assert plan.is_bipartition()
    assert plan.bipartition_pieces() == [
        ("core", 0, 0, ["n0", "n1"]), ("segment", 0, 1, ["n2"]), ("core", 1, 1, ["n3", "n4"]),
        ("segment", 2, 1, ["n5"]), ("core", 2, 2, ["n6"])]
    again = Plan.from_json(plan.to_json())
    assert again.bipartition_pieces() == plan.bipartition_pieces()


def test_old_plans_load_with_defaults():
    data = _plan([["a"], ["b"]], [[], []]).to_json()
    for s in data["stages"]:
        del s["backward_nodes"], s["extra_send_bytes"]
    del data["bipartition_mode"], data["weight_sync_bytes"]
    plan = Plan.from_json(data)
    assert plan.bipartition_mode == "" and plan.stages[0].backward_nodes == []


@pytest.mark.parametrize("fwd, bwd, what", [
    ([["a", "b"], ["c"]], [["a"], ["b", "c", "x"]], "no stage's forward range"),
    ([["a", "b"], ["c"]], [["a", "b"], ["b", "c"]], "backward ranges of stages 0 and 1"),
    ([["a", "b"], ["c"]], [["a"], ["b"]], "in no stage's backward range"),
    ([["a", "b"], ["c"]], [["b", "c"], ["a"]], "not in stage order"),
    ([["a"], ["b"], ["c", "d"]], [["a", "b"], ["c"], ["d"]], "stage 1 has no node"),
])
def test_bad_ranges_are_refused_in_one_line(fwd, bwd, what):
    with pytest.raises(PipeccError, match=what):
        _plan(fwd, bwd).bipartition_pieces()
