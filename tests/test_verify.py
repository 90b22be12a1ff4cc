"""`pipecc.ir.verify.verify_plan`: a sound plan passes (with and without its cut stages), and
each broken one fails naming what broke: a node missing, a node twice, a backwards edge, an
empty stage, a stage on no device, ports that do not match."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

from helpers import ZOO
from pipecc import driver
from pipecc.backends.torch.stages import Port, cut_stages
from pipecc.ir.graph import META_NAME, AnnotatedGraph
from pipecc.ir.plan import Plan, StagePlan
from pipecc.ir.verify import IRError, verify, verify_plan
from test_torch_stages import analysed, one_thread, random_stage_of, stage_of_at  # noqa: F401


class Skip(nn.Module):
    """h = relu(a(x)) skips b: cut after a and after b, it is relayed through stage 1."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)
        self.scale = nn.Parameter(torch.ones(4))  # read directly: a get_attr node

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        return self.c(self.b(h) + h) * self.scale


@pytest.fixture(scope="module")
def graph() -> AnnotatedGraph:
    return driver.analyze_module(Skip(), (torch.randn(2, 8),), debug=True)


def names(graph: AnnotatedGraph) -> list[str]:
    return [n.meta[META_NAME] for n in graph.compute_nodes() if n.op != "get_attr"]


def make_plan(stage_nodes: list[list[str]], devices: int | None = None) -> Plan:
    n = len(stage_nodes) if devices is None else devices
    return Plan(model="m", batch_size=2, microbatches=1, schedule="gpipe",
                devices=[{"name": "cpu", "kind": "cpu"} for _ in range(n)],
                stages=[StagePlan(k, k % n, list(nodes)) for k, nodes in enumerate(stage_nodes)],
                split_layers=[], bottleneck_s=1.0, lower_bound_s=1.0, predicted_iteration_s=1.0,
                bubble_fraction=0.0)


def three_stages(graph: AnnotatedGraph) -> list[list[str]]:
    order = names(graph)
    cut = order.index("b")  # stage 0: a, relu | stage 1: b | stage 2: add, c, mul
    return [order[:cut], [order[cut]], order[cut + 1:]]


def test_a_sound_plan_passes_with_its_cut_stages(graph):
    plan = make_plan(three_stages(graph))
    verify_plan(graph, plan)
    stages = cut_stages(graph, plan.stage_of())
    assert [p.producer for p in stages[1].sends] == ["relu", "b"]  # relu is relayed
    verify_plan(graph, plan, stages)


def test_the_plan_may_list_get_attr_nodes_once(graph):
    attrs = [n.meta[META_NAME] for n in graph.compute_nodes() if n.op == "get_attr"]
    assert attrs
    groups = three_stages(graph)
    verify_plan(graph, make_plan(groups[:2] + [groups[2] + attrs]))
    with pytest.raises(IRError, match="placed twice"):
        verify_plan(graph, make_plan([groups[0] + attrs, groups[1], groups[2] + attrs]))


@pytest.mark.parametrize("broken,message", [
    (lambda g: [g[0][1:], g[1], g[2]], r"node 'a' is placed in no stage"),
    (lambda g: [g[0], g[1] + ["a"], g[2]], r"node 'a' is placed twice: in stage 0 and stage 1"),
    (lambda g: [g[0], g[1], g[2] + ["nowhere"]], r"stage 2 lists 'nowhere', which is no node"),
    (lambda g: [g[1], g[0], g[2]], r"node 'b' \(stage 0\) uses 'relu' from the later stage 1"),
    (lambda g: [g[0], [], g[1] + g[2]], r"stage 1 holds no node"),
])
def test_broken_plans_fail_naming_what_broke(graph, broken, message):
    with pytest.raises(IRError, match=message):
        verify_plan(graph, make_plan(broken(three_stages(graph))))


def test_a_stage_on_no_device_fails(graph):
    plan = make_plan(three_stages(graph))
    plan.stages[2].device = 7
    with pytest.raises(IRError, match="stage 2 is on device 7, but the plan has 3 devices"):
        verify_plan(graph, plan)
    plan = make_plan(three_stages(graph))
    plan.stages[1].index = 5
    with pytest.raises(IRError, match="plan stage 1 has index 5"):
        verify_plan(graph, plan)


def _with(stages, k: int, **changes):
    out = list(stages)
    out[k] = dataclasses.replace(stages[k], **changes)
    return out


def test_ports_that_do_not_match_fail(graph):
    plan = make_plan(three_stages(graph))
    stages = cut_stages(graph, plan.stage_of())
    relu, b = stages[1].sends
    with pytest.raises(IRError, match=r"stage 1 sends \['relu', 'b'\] but stage 2 receives \['b'\]"):
        verify_plan(graph, plan, _with(stages, 2, receives=[b]))
    with pytest.raises(IRError, match=r"uses 'relu' from stage 0, but stage 2 receives no port"):
        verify_plan(graph, plan, _with(_with(stages, 1, sends=[b]), 2, receives=[b]))
    with pytest.raises(IRError, match="stage 1 sends 'b' twice"):
        verify_plan(graph, plan, _with(stages, 1, sends=[relu, b, b]))
    ghost = Port("ghost", None, "ghost", 1)
    with pytest.raises(IRError, match="stage 1 sends 'ghost', which it neither computes nor receives"):
        verify_plan(graph, plan, _with(_with(stages, 1, sends=[relu, b, ghost]), 2,
                                       receives=[relu, b, ghost]))
    with pytest.raises(IRError, match="the plan has 3 stages but 2 were cut"):
        verify_plan(graph, plan, stages[:2])
    with pytest.raises(IRError, match="the last stage sends no port"):
        verify_plan(graph, plan, _with(stages, 2, sends=[]))


@pytest.mark.parametrize("name", ZOO)
def test_every_cut_of_the_zoo_verifies(name):
    """Random contiguous placements of every zoo model: whatever cut_stages accepts (getitems
    of tuples, x.device, tied weights, relays), verify_plan accepts too, cut or not."""
    _, _, graph = analysed(name)
    verify(graph, costed=True)
    for seed, k in ((0, 2), (1, 3), (2, 4)):
        stage_of = random_stage_of(graph, k, seed)
        groups = [[n for n, s in stage_of.items() if s == i] for i in range(k)]
        plan = make_plan(groups)
        verify_plan(graph, plan)
        verify_plan(graph, plan, cut_stages(graph, plan.stage_of()))
