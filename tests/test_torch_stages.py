"""Cutting the graph into stages: the stages run in sequence compute what the captured graph
computes, over the model's own parameters, with ports that follow the relay convention."""
from __future__ import annotations

import json
import random
from functools import lru_cache
from typing import Any

import pytest
import torch
import torch.nn as nn

from helpers import ZOO, zoo_module
from pipecc import driver
from pipecc.backends.torch.stages import Stage, cut_stages, normalise_stage_of, ports_json
from pipecc.ir.graph import META_NAME, META_VALUE, AnnotatedGraph, IRError, ScalarInfo, TensorInfo


# ----------------------------------------------------------------------------- shared helpers
@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run fastest on one thread; several threads stall when other tests share the CPUs."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def placeable(graph: AnnotatedGraph) -> list:
    """The nodes a planner places (get_attr nodes go wherever they are used)."""
    return [n for n in graph.compute_nodes() if n.op != "get_attr"]


def stage_of_at(graph: AnnotatedGraph, bounds: list[int]) -> dict[str, int]:
    """Contiguous stages: stage k starts at placeable node bounds[k-1]."""
    return {n.meta[META_NAME]: sum(i >= b for b in bounds) for i, n in enumerate(placeable(graph))}


def stage_of_fractions(graph: AnnotatedGraph, fractions: list[float]) -> dict[str, int]:
    count = len(placeable(graph))
    return stage_of_at(graph, [max(1, min(count - 1, round(f * count))) for f in fractions])


def random_stage_of(graph: AnnotatedGraph, num_stages: int, seed: int) -> dict[str, int]:
    """Random contiguous cut points (seeded), every stage non-empty."""
    count = len(placeable(graph))
    bounds = sorted(random.Random(seed).sample(range(1, count), num_stages - 1))
    return stage_of_at(graph, bounds)


def tiny(name: str, batch: int = 2, **overrides: Any) -> tuple[Any, nn.Module, tuple]:
    zoo = zoo_module(name)
    torch.manual_seed(0)
    model = zoo.build_model(**{**zoo.TINY, **overrides})
    return zoo, model, zoo.example_inputs(batch, **zoo.TINY)


@lru_cache(maxsize=None)
def analysed(name: str) -> tuple[nn.Module, tuple, AnnotatedGraph]:
    """(model, inputs, graph) of a zoo model at TINY size; shared: tests must not train it."""
    _, model, inputs = tiny(name)
    return model, inputs, driver.analyze_module(model, inputs, model_name=name, debug=True)


def run_stages(stages: list[Stage], graph: AnnotatedGraph, inputs: tuple) -> dict[str, Any]:
    """Run stage GraphModules in order, each on exactly its receives; the last stage's sends."""
    env = {n.name: v for n, v in zip([n for n in graph.gm.graph.nodes if n.op == "placeholder"], inputs)}
    for stage in stages:
        outputs = stage.gm(*[env[p.name] for p in stage.receives])
        assert isinstance(outputs, tuple) and len(outputs) == len(stage.sends)
        env = dict(zip([p.name for p in stage.sends], outputs))
    return env


def check_relay_convention(graph: AnnotatedGraph, stages: list[Stage]) -> None:
    """Stage k receives exactly what is live across cut k-1 and sends what is live across cut k."""
    n = len(stages)
    where = {name: s.index for s in stages for name in s.nodes}
    nodes = {node.name: node for node in graph.gm.graph.nodes}
    output = next(node for node in graph.gm.graph.nodes if node.op == "output")

    def produced(node: Any) -> int:
        return -1 if node.op == "placeholder" else where[node.meta[META_NAME]]

    def last_use(node: Any) -> int:
        uses = [n if u is output else where[u.meta[META_NAME]] for u in node.users]
        return max(uses, default=-1)

    for k, stage in enumerate(stages):
        if k > 0:
            assert [p.name for p in stage.receives] == [p.name for p in stages[k - 1].sends]
        for port in stage.sends:
            node = nodes[port.name]
            assert produced(node) <= k < last_use(node), (k, port.name)
            assert isinstance(port.value, (TensorInfo, ScalarInfo)), f"{port.name}: {port.value}"
        live = {name for name, node in nodes.items() if node.op not in ("get_attr", "output")
                and produced(node) <= k < last_use(node)}
        assert {p.name for p in stage.sends} == live
    assert {p.name for p in stages[-1].sends} == {a.name for a in output.all_input_nodes}
    assert all(p.stage == -1 for p in stages[0].receives)


# ----------------------------------------------------------------------------- the zoo
@pytest.mark.parametrize("num_stages", [2, 3, 4])
@pytest.mark.parametrize("name", ZOO)
def test_stages_in_sequence_equal_the_graph(name: str, num_stages: int) -> None:
    model, inputs, graph = analysed(name)
    originals = {id(p) for p in model.parameters()} | {id(b) for b in model.buffers()}
    for seed in range(2):
        stages = cut_stages(graph, random_stage_of(graph, num_stages, seed))
        assert len(stages) == num_stages
        check_relay_convention(graph, stages)
        for stage in stages:  # the original weights, never copies
            stage.gm.graph.lint()
            assert {id(t) for t in [*stage.gm.parameters(), *stage.gm.buffers()]} <= originals
        with torch.no_grad():
            env = run_stages(stages, graph, inputs)
            expected = graph.gm(*inputs)
        out = env[stages[-1].model_output["port"]]
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        ports = [ports_json(s, num_stages) for s in stages]
        json.dumps(ports)  # plain JSON
        for port in ports[0]["receives"]:
            assert port["kind"] == "tensor" and port["batch_dim"] == 0 and port["shape"][0] == 2


def test_every_node_lands_in_exactly_one_stage() -> None:
    _, _, graph = analysed("gpt")
    stages = cut_stages(graph, random_stage_of(graph, 3, 7))
    held = [name for s in stages for name in s.nodes]
    assert sorted(held) == sorted(n.meta[META_NAME] for n in placeable(graph))


# ----------------------------------------------------------------------------- placement rules
def test_tuple_unpacking_follows_its_tuple() -> None:
    """Cut right after every LSTM of GNMT: its (out, (h, c)) never crosses, only tensors do."""
    _, inputs, graph = analysed("gnmt")
    nodes = placeable(graph)
    lstms = [i for i, n in enumerate(nodes) if isinstance(n.meta[META_VALUE], tuple)]
    assert lstms
    for i in lstms[:3]:
        stages = cut_stages(graph, stage_of_at(graph, [i + 1]))
        assert all(isinstance(p.value, TensorInfo) for s in stages for p in s.sends)
        with torch.no_grad():
            torch.testing.assert_close(run_stages(stages, graph, inputs)[stages[-1].model_output["port"]],
                                       graph.gm(*inputs))


def test_device_attribute_moves_to_its_user() -> None:
    """BERT's `idx.device` feeds torch.arange; a cut between them sends no device object."""
    _, inputs, graph = analysed("bert")
    nodes = placeable(graph)
    i = next(i for i, n in enumerate(nodes) if n.target is getattr)
    stages = cut_stages(graph, stage_of_at(graph, [i + 1]))
    assert all(p.value != ScalarInfo(None) for s in stages for p in s.sends)
    with torch.no_grad():
        torch.testing.assert_close(run_stages(stages, graph, inputs)[stages[-1].model_output["port"]],
                                   graph.gm(*inputs))


def test_a_skipping_value_is_relayed() -> None:
    """GNMT's decoder needs the target tokens: with 4 stages, every stage before relays them."""
    _, _, graph = analysed("gnmt")
    stages = cut_stages(graph, random_stage_of(graph, 4, 0))
    check_relay_convention(graph, stages)
    user = min(s.index for s in stages if any("decoder" in n for n in s.nodes))
    for stage in stages[:user]:
        assert "tgt" in [p.name for p in stage.sends]


def test_bad_placements_are_refused() -> None:
    _, _, graph = analysed("mlp")
    good = stage_of_at(graph, [2])
    missing = dict(good)
    missing.pop(next(iter(missing)))
    with pytest.raises(IRError, match="not assigned"):
        cut_stages(graph, missing)
    backwards = {name: 1 - s for name, s in good.items()}
    with pytest.raises(IRError, match="later stage"):
        normalise_stage_of(graph, backwards)


# ----------------------------------------------------------------------------- tied weights, export
class TwiceUsed(nn.Module):
    """One Linear applied at both ends: a tied weight once the two calls sit in different stages."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(8, 8)
        self.mid = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(torch.relu(self.mid(self.shared(x) * self.scale))) * self.scale


def test_tied_weights_are_referenced_by_both_stages() -> None:
    torch.manual_seed(0)
    model, x = TwiceUsed(), torch.randn(3, 8)
    graph = driver.analyze_module(model, (x,), debug=True)
    stages = cut_stages(graph, stage_of_fractions(graph, [0.5]))
    for stage in stages:
        assert stage.tied == ["scale", "shared.bias", "shared.weight"]
    assert stages[0].gm.get_submodule("shared") is stages[1].gm.get_submodule("shared") is model.shared
    out = run_stages(stages, graph, (x,))[stages[-1].model_output["port"]]
    out.sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model(x).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad)


class ShapeBranch(nn.Module):
    """Python control flow on a shape: torch.fx cannot trace it, torch.export captures it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.a(x))
        if x.shape[0] > 1:
            h = h * 2
        return self.b(h), h


def test_export_graphs_cut_too() -> None:
    torch.manual_seed(0)
    model, x = ShapeBranch(), torch.randn(4, 6)
    graph = driver.analyze_module(model, (x,), debug=True)
    assert graph.source == "export"
    stages = cut_stages(graph, stage_of_fractions(graph, [0.5]))
    assert stages[-1].model_output["tuple"][0].keys() == {"port"}
    env = run_stages(stages, graph, (x,))
    expected = model(x)
    got = tuple(env[t["port"]] for t in stages[-1].model_output["tuple"])
    torch.testing.assert_close(got, expected)
