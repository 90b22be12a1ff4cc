"""The schedule registry and `schedule_for`: every registered schedule round-trips through the
text form a compiled folder's schedule.txt uses, the CLI's choices come from the registry, and
`schedule_for` builds exactly what each of the seven places that used to rebuild a plan's
schedule built (their old expressions are spelled out here, against the generators)."""

from __future__ import annotations

import argparse

import pytest

from pipecc.cli.args import add_plan_args
from pipecc.errors import PipeccError, UsageError
from pipecc.ir.plan import Plan, StagePlan
from pipecc.techniques import schedule_of
from pipecc.ir.schedule.actions import ActionKind
from pipecc.ir.schedule.generators import gpipe, inference, interleaved_1f1b, one_f_one_b, zb_h1
from pipecc.ir.schedule.registry import REGISTRY, SCHEDULES, TRAINING_SCHEDULES, VIRTUAL, ZERO_BUBBLE, schedule_for
from pipecc.ir.schedule.text import format, parse
from pipecc.techniques.bpipe.schedule import bpipe
from pipecc.ir.schedule.validate import validate
from pipecc.runtime.engine import build_schedule
from pipecc.techniques.umpipe.schedule import gpipe_uneven

SIZES = [[1, 3, 4], [4, 4], [2, 2, 2, 2]]  # UMPIPE: three stages, batch 8
THRESHOLDS = [1, 2, None, None]            # BPipe over four stages


def _cases() -> list[tuple[str, int, int, int]]:
    """(name, ranks, micro-batches, stages per rank) for every registered schedule."""
    out = []
    for name, kind in REGISTRY.items():
        for p, m in ((1, 1), (2, 4), (3, 6), (4, 8)):
            out += [(name, p, m, v) for v in ((1, 2, 3) if kind.virtual_stages else (1,))]
    return out


@pytest.mark.parametrize("name,p,m,v", _cases())
def test_every_registered_schedule_round_trips_as_text(name: str, p: int, m: int, v: int) -> None:
    s = schedule_for(name, p * v, m, num_ranks=p)
    validate(s)
    assert parse(format(s)) == s
    assert format(parse(format(s))) == format(s)
    assert s.num_ranks == p and s.num_stages == p * v and s.num_microbatches == m
    assert s.is_training == REGISTRY[name].training
    assert any(a.kind is ActionKind.I for row in s.actions for a in row) == REGISTRY[name].split_backward


def test_uneven_and_bpipe_schedules_round_trip_as_text() -> None:
    for s in (schedule_for("gpipe", 3, 4, microbatch_sizes=SIZES),
              schedule_for("gpipe", 3, 4, num_ranks=1, microbatch_sizes=SIZES),
              schedule_for("1f1b", 4, 6, bpipe_thresholds=THRESHOLDS),
              schedule_for("1f1b", 4, 6, bpipe_thresholds=THRESHOLDS, bpipe_policy="eager")):
        assert parse(format(s)) == s


def test_the_names_everyone_lists_come_from_the_registry() -> None:
    assert SCHEDULES == tuple(REGISTRY) == ("gpipe", "1f1b", "interleaved", "inference", "zb-h1")
    assert TRAINING_SCHEDULES == ("gpipe", "1f1b", "interleaved", "zb-h1")
    assert ZERO_BUBBLE == ("zb-h1",) and VIRTUAL == ("interleaved",)
    parser = argparse.ArgumentParser()
    add_plan_args(parser)
    choices = next(a.choices for a in parser._actions if a.dest == "schedule")
    assert list(choices) == ["auto", *TRAINING_SCHEDULES]


def test_schedule_for_refuses_what_cannot_be_built() -> None:
    with pytest.raises(ValueError, match="unknown schedule 'zb-v'"):
        schedule_for("zb-v", 2, 2)
    with pytest.raises(ValueError, match="one stage on each rank"):
        schedule_for("1f1b", 4, 4, num_ranks=2)
    with pytest.raises(ValueError, match="do not divide"):
        schedule_for("interleaved", 5, 4, num_ranks=2)
    with pytest.raises(ValueError, match="gpipe or 1f1b schedule only"):
        schedule_for("zb-h1", 3, 4, microbatch_sizes=SIZES)
    with pytest.raises(ValueError, match="1f1b put one stage on each rank"):
        schedule_for("1f1b", 3, 4, num_ranks=1, microbatch_sizes=SIZES)
    with pytest.raises(ValueError, match="1f1b with one stage per rank"):
        schedule_for("gpipe", 4, 4, bpipe_thresholds=THRESHOLDS)
    with pytest.raises(ValueError, match="divisible"):
        schedule_for("interleaved", 4, 3, num_ranks=2)


# ----------------------------------------------------------------------------- the old ways
# What each call site built before `schedule_for`, written out against the generators.

def _old_by_name(name: str, ranks: int, m: int, v: int) -> object:
    if name == "interleaved":
        return interleaved_1f1b(ranks, m, v)
    return {"gpipe": gpipe, "1f1b": one_f_one_b, "inference": inference, "zb-h1": zb_h1}[name](ranks, m)


def _plan(schedule: str, n: int, m: int, v: int = 1, sizes: list[list[int]] | None = None,
          thresholds: list[int | None] | None = None, policy: str = "jit") -> Plan:
    pairs = [{"evictor": s, "acceptor": n - 1 - s, "threshold": k, "policy": policy}
             for s, k in enumerate(thresholds or []) if k is not None]
    return Plan(model="m", batch_size=8, microbatches=m, schedule=schedule, devices=[],
                stages=[StagePlan(i, i, []) for i in range(n)], split_layers=[], bottleneck_s=0.0,
                lower_bound_s=0.0, predicted_iteration_s=0.0, bubble_fraction=0.0, virtual_stages=v,
                microbatch_sizes=sizes, activation_balancing=pairs)


PLANS = [("gpipe", 2, 4, 1), ("1f1b", 3, 6, 1), ("interleaved", 4, 4, 2), ("zb-h1", 4, 8, 1),
         ("inference", 3, 3, 1), ("interleaved", 6, 6, 3), ("1f1b", 2, 2, 2)]


@pytest.mark.parametrize("name,n,m,v", PLANS)
def test_schedule_of_a_plan_is_what_the_report_built(name: str, n: int, m: int, v: int) -> None:
    # report/artifacts.timeline_for: v only for interleaved, by_name(plan.schedule, n // v, m, v)
    v_used = v if name == "interleaved" else 1
    assert schedule_of(_plan(name, n, m, v)) == _old_by_name(name, n // v_used, m, v_used)


def test_schedule_of_uneven_and_bpipe_plans_is_what_the_report_built() -> None:
    assert schedule_of(_plan("gpipe", 3, 3, sizes=SIZES)) == gpipe_uneven(SIZES)
    for policy in ("jit", "eager"):
        plan = _plan("1f1b", 4, 6, thresholds=THRESHOLDS, policy=policy)
        assert schedule_of(plan) == bpipe(one_f_one_b(4, 6), plan.bpipe_thresholds(), policy)


@pytest.mark.parametrize("name,n,m,v", [p for p in PLANS if p[0] != "inference" or p[3] == 1])
def test_schedule_for_is_what_the_planner_built(name: str, n: int, m: int, v: int) -> None:
    # passes/plan_evaluate.py Evaluator.simulate and plan_problem.inflight: by_name(schedule, stages // v, m, v)
    v_used = v if name == "interleaved" else 1
    assert schedule_for(name, n, m, num_ranks=n // v_used) == _old_by_name(name, n // v_used, m, v_used)
    # ... with BPipe: bpipe(by_name("1f1b", p, m, 1), thresholds, POLICY); all None: plain 1F1B
    assert schedule_for("1f1b", 4, m, bpipe_thresholds=THRESHOLDS) == bpipe(one_f_one_b(4, m), THRESHOLDS)
    assert schedule_for("1f1b", 4, m, bpipe_thresholds=[None] * 4) == one_f_one_b(4, m)


def test_schedule_for_is_what_the_technique_passes_built() -> None:
    # pipecc/techniques/bipartition/plan.py _simulate: by_name(plan.schedule, len(plan.stages), m, 1)
    for name in ("1f1b", "gpipe"):
        assert schedule_for(name, 3, 6) == _old_by_name(name, 3, 6, 1)
    # pipecc/techniques/umpipe/plan.py: gpipe_uneven(sizes)
    assert schedule_for("gpipe", 3, 3, microbatch_sizes=SIZES) == gpipe_uneven(SIZES)
    # pipecc/techniques/bpipe/search.py _fit and pipecc/techniques/bpipe/codegen.py:
    # bpipe(one_f_one_b(p, m), thresholds, policy)
    for ks, policy in ((THRESHOLDS, "jit"), ((2, None, None, None), "eager")):
        old = bpipe(one_f_one_b(4, 6), list(ks), policy)
        validate(old)
        assert schedule_for("1f1b", 4, 6, bpipe_thresholds=ks, bpipe_policy=policy) == old
        assert (schedule_for("1f1b", 4, 6, bpipe_thresholds=ks, bpipe_policy=policy).stash_profile()
                == old.stash_profile())


def test_the_runtime_builds_what_it_built_before() -> None:
    # runtime/engine.py build_schedule: by name, with unequal sizes, with BPipe pairs
    assert build_schedule("interleaved", 2, 4, 2) == interleaved_1f1b(2, 4, 2)
    assert build_schedule("zb-h1", 3, 5) == zb_h1(3, 5)
    assert build_schedule("gpipe", 1, 3, 3, sizes=SIZES) == gpipe_uneven(SIZES, 1)
    pairs = [{"evictor": 0, "acceptor": 3, "threshold": 1, "policy": "eager"}]
    assert build_schedule("1f1b", 4, 6, balancing=pairs) == bpipe(one_f_one_b(4, 6), [1, None, None, None], "eager")
    # a parsed schedule (a folder's schedule.txt) runs as it is, once it validates on this many ranks
    parsed = parse(format(zb_h1(2, 4)))
    assert build_schedule(parsed, 2, 4) is parsed
    with pytest.raises(PipeccError, match="schedule has 2 ranks, the run 3"):
        build_schedule(parsed, 3, 4)
    with pytest.raises(UsageError, match="unknown schedule"):
        build_schedule("zb-v", 2, 4)
    with pytest.raises(PipeccError, match="one stage on each rank.*--schedule interleaved"):
        build_schedule("1f1b", 2, 4, 2)
