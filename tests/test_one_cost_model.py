"""One cost model (issue #20 items 1-2): every consumer costs a plan the same way.

A plan costed through the planner's candidate (plan.json's predicted_iteration_s), the
evaluator's simulator, UMPIPE's chunk curves at equal sizes, BPipe's estimator with no moves,
Bi-Partition's single cut, the report's timeline (rebuilt from plan.json alone) and
`run --json`'s predicted figures gives one iteration time; and the fixed costs
(`pipecc.targets.fixed_costs`) are in it.
"""

from __future__ import annotations

import dataclasses

import pytest

from pipecc import driver
from pipecc.ir.schedule.registry import schedule_for
from pipecc.techniques.replicas import search as rep
from pipecc.techniques.umpipe import search as umpipe
from pipecc.techniques.bipartition.search import evaluate_bi
from pipecc.techniques.bipartition.plan import stage_costs as bi_stage_costs
from pipecc.passes.partition import PartitionProblem, evaluate, partition
from pipecc.passes.plan_options import PlanOptions
from pipecc.passes.plan_search import Planner
from pipecc.passes.simulate import simulate
from pipecc.techniques.umpipe.plan import curves_for_plan
from pipecc.report.artifacts import timeline_for
from pipecc.runtime.timing import run_document
from pipecc.targets import fixed_costs
from pipecc.targets.devices import parse_devices

REL = 1e-9
MLP = dict(in_features=64, hidden=128, depth=4, num_classes=10)
GPT = dict(n_layer=2, n_head=2, n_embd=64, vocab_size=256, block_size=32)


@pytest.fixture(scope="module")
def mlp():
    return driver.analyze("models/mlp.py", model_args=MLP, batch_size=8)


@pytest.fixture(scope="module")
def gpt():
    return driver.analyze("models/gpt.py", model_args=GPT, batch_size=16)


def _costed(analysis, devices: str, **fields):
    """(plan, evaluator on its graph, candidate partition and problem, allreduce)."""
    cluster = parse_devices(devices)
    plan, graph = driver.plan(analysis, cluster, split_layers=False, **fields)
    opts = PlanOptions(batch_size=plan.batch_size, schedule=plan.schedule,
                       coarse=plan.options["coarse"])
    ev = Planner(graph, cluster, opts).evaluator
    d, m, v = plan.replicas, plan.microbatches, plan.virtual_stages
    mb = rep.slice_size(plan.batch_size // m, d)
    units = ev.builder.at(mb)
    order = tuple(int(x["given_index"]) for x in plan.devices) if d == 1 else tuple(range(ev.p))
    recompute = [s.recompute for s in plan.stages] if any(s.recompute for s in plan.stages) else None
    prob = ev.problem(units, mb, plan.schedule, m, order, v, recompute, d)
    part = evaluate(prob, units.stage_bounds(plan.stages))
    allreduce = rep.stage_allreduce_s(ev.tables, units, part.bounds, order, d) if d > 1 else None
    return plan, ev, part, prob, order, allreduce


def _run_json(plan) -> dict:
    """`pipecc run --json`'s document for the plan, with made-up measurements."""
    summaries = [{"rank": k, "replica": 0, "stages": [k], "forward": [[1.0]], "backward": [[1.0]],
                  "step_s": [1.0], "recv_wait_s": [0.0], "evicted": [[]], "warmup": 1}
                 for k in range(len(plan.stages))]
    return run_document(summaries, plan.to_json(), plan.schedule, plan.microbatches, plan.batch_size)


CASES = [
    ("mlp", "2xcpu", dict(schedule="1f1b", microbatches=4, replicas=1)),
    ("mlp", "2xcpu", dict(schedule="gpipe", microbatches=4, replicas=1)),
    ("mlp", "2xcpu", dict(schedule="zb-h1", microbatches=4, replicas=1)),
    ("mlp", "4xcpu", dict(schedule="1f1b", microbatches=2, replicas=2)),
    ("gpt", "2xa100,2xv100", dict(schedule="1f1b", microbatches=4, replicas=1)),
    ("gpt", "2xa100,2xv100", dict(schedule="gpipe", microbatches=4, replicas=1)),
    ("gpt", "2xa100,2xv100", dict(schedule="1f1b", microbatches=2, replicas=2)),
]


@pytest.mark.parametrize("model,devices,fields", CASES,
                         ids=[f"{m}-{d}-{f['schedule']}-r{f['replicas']}" for m, d, f in CASES])
def test_every_consumer_gives_the_same_iteration_time(model, devices, fields, request):
    plan, ev, part, prob, order, allreduce = _costed(request.getfixturevalue(model), devices, **fields)
    m, v, p = plan.microbatches, plan.virtual_stages, len(plan.stages)
    want = plan.predicted_iteration_s  # the planner's candidate
    assert want > 0
    # the simulator over the evaluator's problem
    got = ev.simulate(part, prob, plan.schedule, m, v, order=order, allreduce=allreduce)
    assert got.iteration_s == pytest.approx(want, rel=REL)
    # the report's timeline, from plan.json alone
    assert timeline_for(plan).iteration_s == pytest.approx(want, rel=REL)
    # run --json's predictions: the plan's figures
    doc = _run_json(plan)
    assert doc["predicted_step_s"] == pytest.approx(want, rel=REL)
    for row, stage in zip(doc["stages"], plan.stages):
        assert row["predicted_forward_s"] == pytest.approx(stage.forward_s, rel=REL)
    # the stage figures hold their fixed parts
    for k, stage in enumerate(plan.stages):
        assert 0 < stage.fixed_forward_s <= stage.forward_s
        assert 0 < stage.fixed_backward_s <= stage.backward_s
        assert stage.step_s == ev.tables.step_s(order[stage.device])
    if plan.replicas != 1 or v != 1:
        return
    if plan.schedule in ("gpipe", "1f1b"):  # UMPIPE's curves at equal sizes
        curves = curves_for_plan(ev, plan)
        sizes = [[plan.batch_size // m] * m] * p
        sched = schedule_for(plan.schedule, p, m, microbatch_sizes=sizes)
        assert simulate(sched, umpipe.stage_costs(sizes, curves)).iteration_s == pytest.approx(want, rel=REL)
        if plan.schedule == "gpipe":  # and its recurrence
            assert umpipe.population_times([sizes], curves)[0] == pytest.approx(want, rel=REL)
            assert umpipe.end_times(sizes, curves).T == pytest.approx(want, rel=REL)
        # Bi-Partition's single cut
        bounds = part.bounds
        bi = evaluate_bi(_bi_problem(prob), bounds, bounds)
        steps = [ev.tables.step_s(order[s.device]) for s in plan.stages]
        tl = simulate(schedule_for(plan.schedule, p, m), bi_stage_costs(bi, prob, m, steps))
        assert tl.iteration_s == pytest.approx(want, rel=REL)
    if plan.schedule == "1f1b":  # BPipe's estimator with no moves
        tl = ev.simulate(part, prob, "1f1b", m, 1, order=order, bpipe=[None] * p, bpipe_policy="jit")
        assert tl.iteration_s == pytest.approx(want, rel=REL)


def _bi_problem(prob: PartitionProblem) -> PartitionProblem:
    import numpy as np
    act = np.asarray(prob.act_mem, dtype=float)
    return dataclasses.replace(prob, stash_bytes=act.max(axis=0) if act.ndim > 1 else act)


def test_the_partitioner_and_the_simulator_agree_on_a_stage():
    """The partitioner's stage time T_k holds the stage's fixed costs as the simulator's F + B
    does (one stage: no transfers, so bottleneck = T_0 = F + B)."""
    import numpy as np
    prob = PartitionProblem(fwd=[[1.0, 2.0]], bwd=[[2.0, 4.0]], out_bytes=[1.0, 1.0],
                            last_use=[1, 2], static_mem=[0.0, 0.0], act_mem=[0.0, 0.0],
                            mem_cap=[np.inf], inflight=[1], link_time=lambda k, x: 0.0,
                            fixed_fwd=[0.5], fixed_bwd=[0.25])
    assert partition(prob).bottleneck == pytest.approx(1 + 2 + 2 + 4 + 0.75)


def _no_fixed(monkeypatch):
    zero = {k: fixed_costs.FixedCosts(source="test: none") for k in fixed_costs.DEFAULTS}
    monkeypatch.setattr(fixed_costs, "DEFAULTS", zero)
    monkeypatch.setattr(fixed_costs, "HALF_RATE_WORK", {})


def test_fixed_costs_are_in_the_mlp_prediction(monkeypatch):
    """mlp -b 8 on 2xcpu (the issue's example): with the fixed costs the step is in the
    milliseconds, longer than the linear model's by at least m micro-batches of stage 0's fixed
    costs plus its optimizer step (rank 0 runs its m forwards and backwards one after another,
    each at least that much longer; the makespan only grows with every action's time)."""
    analysis = driver.analyze("models/mlp.py", batch_size=8)
    fields = dict(schedule="1f1b", microbatches=4, replicas=1, split_layers=False)
    with_fixed, _ = driver.plan(analysis, "2xcpu", **fields)
    with monkeypatch.context() as mp:
        _no_fixed(mp)
        linear, _ = driver.plan(analysis, "2xcpu", **fields)
    assert all(s.fixed_forward_s == 0 and s.fixed_backward_s == 0 for s in linear.stages)
    m = with_fixed.microbatches
    s0 = with_fixed.stages[0]
    added = m * (s0.fixed_forward_s + s0.fixed_backward_s) + s0.step_s
    assert added > 0
    assert with_fixed.predicted_iteration_s >= linear.predicted_iteration_s + added * (1 - 1e-9)
    busy0 = timeline_for(with_fixed).busy_s[0]
    assert busy0 == pytest.approx(m * (s0.forward_s + s0.backward_s))
    assert with_fixed.predicted_iteration_s > 1e-3  # the milliseconds the issue measured


def test_fixed_costs_sources_and_profile_override():
    """Every default names its source; a profile's measured section replaces them (and is not
    scaled for shared cores: it was measured with the plan's ranks running)."""
    for kind, fc in fixed_costs.DEFAULTS.items():
        assert fc.source and fc.source != "none yet", kind
    from pipecc.passes.plan_costs import fixed_for
    from pipecc.targets.profiled import Profile
    cluster = parse_devices("2xcpu")
    prof = Profile({"fixed_costs": {"cpu": {"op_forward_s": 1e-6, "microbatch_s": 2e-5,
                                            "source": "measured here"}}}, "p.json")
    got = fixed_for(cluster, PlanOptions(batch_size=8, profile=prof))
    assert got[0].op_forward_s == 1e-6 and got[0].microbatch_s == 2e-5 and got[0].source == "measured here"
    with pytest.raises(ValueError, match="op_backward_s"):
        fixed_costs.from_json({"op_backward_s": -1}, "x")


def test_ranks_sharing_cores_scale_the_host_costs():
    assert fixed_costs.host_share(2, cores=2) == 1.0
    assert fixed_costs.host_share(4, cores=2) == 2.0
    assert fixed_costs.host_share(1, cores=8) == 1.0
    from pipecc.passes.plan_costs import fixed_for
    many = parse_devices(",".join(["cpu"] * 64))
    share = fixed_costs.host_share(64)
    got = fixed_for(many, PlanOptions(batch_size=64))[0]
    assert got.message_s == pytest.approx(fixed_costs.DEFAULTS["cpu"].message_s * share)


def test_messages_pay_both_hosts():
    """A message's time is the link's plus message_s of the sender and of the receiver."""
    analysis = driver.analyze("models/mlp.py", model_args=MLP, batch_size=8)
    cluster = parse_devices("2xcpu")
    tables = Planner(analysis.graph, cluster, PlanOptions(batch_size=8)).tables
    link = cluster.link(0, 1)
    want = link.time(1000) + tables.fixed[0].message_s + tables.fixed[1].message_s
    assert tables.link_time(0, 1, 1000) == pytest.approx(want)
    assert tables.link_time(0, 1, 0) == 0.0 and tables.link_time(1, 1, 10) == 0.0
