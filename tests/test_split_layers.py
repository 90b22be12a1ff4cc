"""Intra-layer split (BaPipe): each rewrite keeps the IR verified, computes the original outputs
and the original parameters' gradients, and splits FLOPs and parameter bytes without changing
their totals; symbolic dims survive; bad requests are refused with a named reason."""
from __future__ import annotations

import importlib
import re

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st

from pipecc import cost, driver
from pipecc.ir.graph import (META_KIND, META_NAME, META_OP, META_PARAMS, META_VALUE, AnnotatedGraph,
                             verify)
from pipecc.passes.split_forms import recognise
from pipecc.passes.split_layers import (Conv2dShard, EmbeddingShard, LinearShard, shard_ranges,
                                        split_node, splittable)

SETTINGS = settings(max_examples=20, deadline=None)
UNCHANGED = ("forward_flops_matmul", "backward_flops_matmul", "param_bytes")


class Net(nn.Module):
    """One layer followed by a non-linearity, so the combine node has a real user."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.layer(x))


@st.composite
def partitions(draw, total: int) -> list[int]:
    """Two to four positive sizes summing to `total` (total >= 2)."""
    n = draw(st.integers(2, min(total, 4)))
    cuts = sorted(draw(st.lists(st.integers(1, total - 1), min_size=n - 1, max_size=n - 1,
                                unique=True)))
    bounds = [0, *cuts, total]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def _grads(model: nn.Module, inputs: tuple, out: torch.Tensor) -> dict[str, torch.Tensor]:
    """Gradients of out.sum() w.r.t. the model's parameters and float inputs; then clears them."""
    out.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    grads.update({f"input{i}": x.grad.clone() for i, x in enumerate(inputs) if x.requires_grad})
    model.zero_grad(set_to_none=True)
    for x in inputs:
        x.grad = None
    return grads


def check_split(model: nn.Module, inputs: tuple, name: str, sizes: list[int], dim: int = 0,
                graph: AnnotatedGraph | None = None) -> AnnotatedGraph:
    """Build → verify → split → verify → structure → costs → numerics and gradients.

    `graph` defaults to the fx capture of `model`; a graph given instead (torch.export, ONNX)
    must run on the same parameter objects as `model` (its own graph module, for ONNX)."""
    ref = model(*inputs)
    ref_grads = _grads(model, inputs, ref)
    graph = graph or driver.analyze_module(model, inputs, debug=True)
    verify(graph, costed=True)
    gm = graph.gm
    # the graph shares the parameter objects with the model, so gradients land on the model's
    assert {id(p) for p in gm.parameters()} == {id(p) for p in model.parameters()}
    before, keys = cost.totals(graph), set(gm.state_dict())
    layer = recognise(graph, graph.by_name()[name])
    assert not isinstance(layer, str), layer
    original = graph.by_name()[name]
    target, op, weight = original.target, original.meta[META_OP], layer.params[:1]
    dead = {n.name for n in layer.dead}  # a call's transposes and get_attr nodes
    dropped = [n for n in layer.dead if n.op == "call_function" and n.meta[META_KIND] != "shape"]

    names = split_node(graph, name, sizes, dim)
    verify(graph, costed=True)

    assert names == [f"{name}.shard{i}" for i in range(len(sizes))]
    order = [n.meta[META_NAME] for n in gm.graph.nodes]
    assert name not in order
    by_name = graph.by_name()
    helpers = [".in"] if dim == 1 and layer.kind == "linear" else []
    if layer.parent is None:  # call shards: slices of the [in, out] weight (and bias) first
        helpers += [".weight"] + ([".bias"] if layer.bias is not None and dim == 0 else [])
    else:  # module shards replace a call's transposes and get_attr nodes too
        assert not dead & {n.name for n in gm.graph.nodes}
    expected = [x for s in names for x in [s + h for h in helpers] + [s]]
    start = order.index(expected[0])
    assert order[start:start + len(expected)] == expected
    combine = order[start + len(expected):order.index(f"{name}.combine") + 1]
    assert combine and all(c.startswith(f"{name}.combine") for c in combine)
    for i, ((a, b), s) in enumerate(zip(shard_ranges(sizes), names)):
        node = by_name[s]
        if layer.parent is None:
            assert node.op == "call_function" and node.meta[META_PARAMS] == []
            assert node.target is target or (op == "addmm" and i > 0 and dim == 1)
        else:
            shard = gm.get_submodule(str(node.target))
            assert shard.pipecc_shard_of == layer.label and (shard.start, shard.size) == (a, b - a)
            assert list(shard.parameters()) == []
            index = f"[{a}:{b}]" if dim == 0 else f"[:, {a}:{b}]"
            assert node.meta[META_PARAMS][0][0] == f"{weight[0][1]}{index}"
        if "B" in graph.symbols:  # the batch dim stays symbolic in every shard
            assert node.meta[META_VALUE].shape[0] == graph.symbols["B"]
    assert set(gm.state_dict()) == keys  # shards register no parameters of their own

    after = cost.totals(graph)
    assert {f: after[f] for f in UNCHANGED} == {f: before[f] for f in UNCHANGED}
    if not dropped:  # the combine adds work (unless a computed zero bias went with the call)
        assert after["forward_flops"] >= before["forward_flops"]

    out = gm(*inputs)
    torch.testing.assert_close(out, ref.detach())
    grads = _grads(model, inputs, out)
    assert grads.keys() == ref_grads.keys()
    for key in ref_grads:
        torch.testing.assert_close(grads[key], ref_grads[key], msg=lambda m: f"{key}: {m}")
    verify(graph, costed=True)
    return graph


@SETTINGS
@given(data=st.data(), b=st.integers(1, 3), t=st.sampled_from([None, 3]), fin=st.integers(2, 9),
       fout=st.integers(2, 9), bias=st.booleans(), dim=st.sampled_from([0, 1]),
       input_grad=st.booleans())
def test_linear(data, b, t, fin, fout, bias, dim, input_grad) -> None:
    torch.manual_seed(0)
    model = Net(nn.Linear(fin, fout, bias=bias))
    x = torch.randn((b, fin) if t is None else (b, t, fin)).requires_grad_(input_grad)
    sizes = data.draw(partitions(fout if dim == 0 else fin))
    graph = check_split(model, (x,), "layer", sizes, dim)
    shard = graph.gm.get_submodule(str(graph.by_name()["layer.shard0"].target))
    assert isinstance(shard, LinearShard) and graph.by_name()["layer.shard0"].meta[META_OP] == "linear"


@SETTINGS
@given(data=st.data(), b=st.integers(1, 2), cin=st.integers(1, 3), cout=st.integers(2, 6),
       k=st.integers(1, 3), stride=st.integers(1, 2), padding=st.integers(0, 2),
       dilation=st.integers(1, 2), hw=st.integers(5, 7), bias=st.booleans(),
       mode=st.sampled_from(["zeros", "reflect", "circular"]))
def test_conv2d(data, b, cin, cout, k, stride, padding, dilation, hw, bias, mode) -> None:
    torch.manual_seed(0)
    model = Net(nn.Conv2d(cin, cout, k, stride=stride, padding=padding, dilation=dilation,
                          bias=bias, padding_mode=mode))
    x = torch.randn(b, cin, hw, hw + 1)
    graph = check_split(model, (x,), "layer", data.draw(partitions(cout)))
    node = graph.by_name()["layer.shard0"]
    assert isinstance(graph.gm.get_submodule(str(node.target)), Conv2dShard)
    assert node.meta[META_OP] == "conv2d"


@SETTINGS
@given(data=st.data(), b=st.integers(1, 3), t=st.integers(1, 4), num=st.integers(2, 20),
       width=st.integers(1, 5), pad=st.booleans())
def test_embedding(data, b, t, num, width, pad) -> None:
    torch.manual_seed(0)
    padding_idx = data.draw(st.integers(0, num - 1)) if pad else None
    model = Net(nn.Embedding(num, width, padding_idx=padding_idx))
    ids = torch.randint(num, (b, t))
    graph = check_split(model, (ids,), "layer", data.draw(partitions(num)))
    node = graph.by_name()["layer.shard0"]
    assert isinstance(graph.gm.get_submodule(str(node.target)), EmbeddingShard)
    assert node.meta[META_OP] == "embedding"


def test_matmul_flops_split_by_shard_size() -> None:
    model = Net(nn.Linear(8, 12))
    graph = driver.analyze_module(model, (torch.randn(2, 8),))
    whole = graph.by_name()["layer"].meta["pipecc.cost"].value("forward_flops_matmul")
    split_node(graph, "layer", [3, 9])
    by_name = graph.by_name()
    parts = [by_name[f"layer.shard{i}"].meta["pipecc.cost"].value("forward_flops_matmul")
             for i in range(2)]
    assert parts == [whole * 3 // 12, whole * 9 // 12]


def test_gpt_biggest_linear_in_three_parts() -> None:
    zoo = importlib.import_module("pipecc.models.gpt")
    torch.manual_seed(0)
    model = zoo.build_model(**zoo.TINY)
    inputs = zoo.example_inputs(2, **zoo.TINY)
    ref = model(*inputs).detach()
    graph = driver.analyze_module(model, inputs, debug=True)
    before = cost.totals(graph)
    linears = [n for n in graph.gm.graph.nodes if n.op == "call_module"
               and isinstance(graph.gm.get_submodule(str(n.target)), nn.Linear)]
    big = max(linears, key=lambda n: graph.gm.get_submodule(str(n.target)).weight.numel())
    out = graph.gm.get_submodule(str(big.target)).out_features
    split_node(graph, big.meta[META_NAME], [out // 3, out // 3, out - 2 * (out // 3)])
    split_node(graph, "lm_head", [10, 22], dim=1)
    split_node(graph, "wte", [50, 30, 21])
    verify(graph, costed=True)
    torch.testing.assert_close(graph.gm(*inputs), ref)
    after = cost.totals(graph)
    assert {f: after[f] for f in UNCHANGED} == {f: before[f] for f in UNCHANGED}


def test_refusals_name_the_node_and_the_reason() -> None:
    class Reuse(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.relu = nn.ReLU()
            self.grouped = nn.Conv2d(4, 4, 1, groups=2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.fc(self.relu(self.fc(x)))
            return y + self.grouped(y[:, :, None, None]).flatten(1)

    model = Reuse()
    x = torch.randn(2, 4)
    graph = driver.analyze_module(model, (x,))
    nodes = graph.by_name()
    assert splittable(graph, nodes["relu"]) == () and splittable(graph, nodes["fc_1"]) == ()
    assert splittable(graph, nodes["fc"]) == (0, 1) and splittable(graph, nodes["grouped"]) == ()
    cases = [("relu", [2, 2], 0, "ReLU"), ("fc_1", [2, 2], 0, "shares its parameters"),
             ("grouped", [2, 2], 0, "groups=2"), ("fc", [2, 3], 0, "summing to 4 (out_features"),
             ("fc", [4, 0], 1, "summing to 4 (in_features"), ("fc", [4], 0, "two or more"),
             ("fc", [2, 2], 2, "along dim 2"), ("nope", [2, 2], 0, "no node")]
    for name, sizes, dim, why in cases:
        with pytest.raises(ValueError, match=f"cannot split {re.escape(repr(name))}.*{re.escape(why)}"):
            split_node(graph, name, sizes, dim)
    verify(graph, costed=True)  # refusals change nothing
    # the first call owns the parameters: splitting it leaves the second call intact
    ref = model(x)
    split_node(graph, "fc", [1, 3])
    verify(graph, costed=True)
    torch.testing.assert_close(graph.gm(x), ref)


def test_shard_ranges() -> None:
    assert shard_ranges([2, 3, 1]) == [(0, 2), (2, 5), (5, 6)]


def test_a_clone_of_a_split_graph_owns_the_same_parameters():
    """split_search clones graphs between rounds; a split layer's module is called by no node
    (its shards read it), so the clone must register it again, or a later round's stages and
    state_dict would lose those weights."""
    from pipecc import driver
    from pipecc.passes import split_layers, split_search
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    graph = driver.analyze_module(model, (torch.randn(2, 8),))
    split_layers.split_node(graph, "0", [8, 8], 0)
    twice = split_search.clone(split_search.clone(graph))
    assert dict(twice.gm.named_parameters()).keys() == dict(graph.gm.named_parameters()).keys()
    for name, p in twice.gm.named_parameters():
        assert p is graph.gm.get_parameter(name)
    x = torch.randn(3, 8)
    torch.testing.assert_close(twice.gm(x), model(x))


def test_a_shard_reads_its_slice_on_the_inputs_device():
    """The drop-in places a split layer's parent on its first shard's device; a shard on another
    device gets its slice there (here the meta device stands for a second device)."""
    from pipecc.passes.split_layers import Conv2dShard, LinearShard
    lin = nn.Linear(6, 8)
    out = LinearShard(lin, "fc", 2, 4, 0)(torch.empty(3, 6, device="meta"))
    assert out.device.type == "meta" and out.shape == (3, 4)
    conv = nn.Conv2d(3, 8, 3, padding=1)
    out = Conv2dShard(conv, "conv", 0, 5, 0)(torch.empty(1, 3, 4, 4, device="meta"))
    assert out.device.type == "meta" and out.shape == (1, 5, 4, 4)
    x = torch.randn(3, 6)  # same device: the parent's own slice, gradients into the parent
    LinearShard(lin, "fc", 2, 4, 0)(x).sum().backward()
    assert lin.weight.grad[2:6].abs().sum() > 0 and lin.weight.grad[:2].abs().sum() == 0
