"""Intra-layer split (BaPipe): rewrite one linear / conv2d / embedding layer into shards plus a
combine, so the balance pass can spread one heavy layer over neighbouring stages.

Which nodes are layers, in fx, torch.export and ONNX graphs: `split_forms.recognise`, a rule
that says why when it declines (`splittable` and `extent` are re-exported here).

Two forms of shard:
  module shards (`LinearShard`, `Conv2dShard`, `EmbeddingShard`) slice the parameters of a
    parent module: the fx module itself or, for a call, a proxy module holding the very
    Parameters the get_attr nodes read. The call, the weight's transposes and its get_attr
    nodes are replaced, so the graph looks like a split fx module (stage code generation
    writes each shard's slice as a parameter of its own).
  call shards, for a weight stored [in, out] (x @ W, ONNX MatMul or Gemm transB=0 over a raw
    parameter): a Linear shard's weight is [out, in] and a transpose of a slice is no slice,
    so each shard repeats the original call on `W.narrow(...)` helper nodes. The get_attr node
    stays and owns the whole weight: every stage holding a shard references it (a tied weight
    for the stage cut), so that weight's memory is not split.

Why each rewrite computes the same function (W: weight, b: bias, shard i owns [a_i, b_i)):
  Linear, dim 0 (output features). Output feature j of x·Wᵀ + b depends only on row j of W
    and b[j], so row block i gives exactly x·W[a_i:b_i]ᵀ + b[a_i:b_i]; concatenating the blocks
    in order along the last dim is y. Each element is the same dot product as before. (Stored
    [in, out], the block is the column block W[:, a_i:b_i] of x·W.)
  Linear, dim 1 (input features). x·Wᵀ = Σ_i x[..., a_i:b_i]·W[:, a_i:b_i]ᵀ by linearity (a dot
    product over a partition of its terms is the sum of the partial dot products); b is added
    once, in shard 0. The partials are summed left to right by a chain of adds: a
    reassociation of the float sum, so results agree to rounding, not bit for bit.
  Conv2d, dim 0 (output channels, groups == 1). Channel c depends only on filter c and b[c];
    channel blocks concatenated along the channel dim (-3) are the output.
  Embedding, dim 0 (table rows). The ranges are disjoint and cover the table, so each id falls
    in exactly one. Shard i looks up (id - a_i) clamped into its table (a valid row whatever
    the id) and keeps it only where a_i <= id < b_i (torch.where: exact zeros elsewhere, and a
    NaN in a row the shard does not own cannot leak); the sum adds one exact row to zeros, so
    output and gradients are bit-exact. Difference: an id outside the table raises in
    nn.Embedding but gives a zero row here.
  Transposes. addmm(b, x, Wᵀ), mm(x, Wᵀ) and ONNX Gemm(x, W, b, transB=1) are x·Wᵀ + b with W
    [out, in]: the Linear rewrite applies to W itself.
Gradients reach the original parameters: shards slice the Parameters (views) on every call, a
module shard through an unregistered reference to its parent, so `state_dict()` and
`parameters()` of the graph module are unchanged and autograd accumulates into the originals.

Extra traffic the rewrite creates: the input x is needed on every stage that holds a shard,
and every shard output travels to the combine (for dim 1 and embeddings each partial is as
large as the whole output). Nothing here charges it: shard outputs and x are live until the
combine, so the partitioner's live-tensor cut model prices any cut between the shards.

Graph layout after `split_node(graph, "fc", sizes)`: in place of the original node, for each
shard i its helpers `fc.shard<i>.in` (x narrowed, Linear dim 1 only), `fc.shard<i>.weight` and
`fc.shard<i>.bias` (call shards only) then `fc.shard<i>`; after all shards the combine: one
`torch.cat` named `fc.combine`, or a chain of adds named `fc.combine.2`, ..., `fc.combine` (the
last one), which takes over the original's users.
Preconditions: the graph is annotated (META_VALUE, META_OP, META_PARAMS) and verified.
"""
from __future__ import annotations

import numbers
import operator
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from pipecc import cost
from pipecc.ir.graph import (META_KIND, META_NAME, META_OP, META_PARAMS, META_VALUE, AnnotatedGraph,
                             TensorInfo)
from pipecc.ir.ops import node_op, op_kind
from pipecc.passes.split_forms import Layer, extent, recognise, splittable

_COPIED_META = ("nn_module_stack", "stack_trace")  # for readable generated stage code


class _Shard(nn.Module):
    """Rows/columns [start, start + size) along `dim` of a parent module's parameters."""

    parent: nn.Module

    def __init__(self, parent: nn.Module, parent_name: str, start: int, size: int, dim: int):
        super().__init__()
        # NOTE: through __dict__, not setattr: a registered parent would put its Parameters
        # in this module's parameters() and the graph module's state_dict a second time.
        self.__dict__["parent"] = parent
        self.pipecc_shard_of = parent_name
        self.start, self.size, self.dim = start, size, dim

    @property
    def weight(self) -> torch.Tensor:
        return self.parent.weight.narrow(self.dim, self.start, self.size)

    @property
    def bias(self) -> torch.Tensor | None:
        bias = getattr(self.parent, "bias", None)
        if bias is None or self.dim == 0:
            return None if bias is None else bias.narrow(0, self.start, self.size)
        return bias if self.start == 0 else None  # input-feature split: bias once, in shard 0

    def on(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight, bias) on `x`'s device: the parent sits on its first shard's device (the drop-in
        module places it so), and a shard on another device reads its slice through a copy that
        carries the gradient back."""
        weight, bias = self.weight, self.bias
        if weight.device != x.device:
            weight, bias = weight.to(x.device), None if bias is None else bias.to(x.device)
        return weight, bias

    def extra_repr(self) -> str:
        return f"of={self.pipecc_shard_of!r}, dim={self.dim}, start={self.start}, size={self.size}"


class LinearShard(_Shard):
    """dim 0: output features [start, end) of an nn.Linear; dim 1: the partial product of
    input features [start, end) (its input is already narrowed to them)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, *self.on(x))


class Conv2dShard(_Shard):
    """Output channels [start, end) of an nn.Conv2d with groups == 1."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.parent
        padding = p.padding
        if p.padding_mode != "zeros":  # as nn.Conv2d._conv_forward does
            x = F.pad(x, p._reversed_padding_repeated_twice, mode=p.padding_mode)
            padding = 0
        return F.conv2d(x, *self.on(x), p.stride, padding, p.dilation, 1)


class EmbeddingShard(_Shard):
    """Table rows [start, end) of an nn.Embedding: the row for ids in range, zeros elsewhere."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        end, pad = self.start + self.size, self.parent.padding_idx
        local_pad = pad - self.start if pad is not None and self.start <= pad < end else None
        rows = F.embedding((ids - self.start).clamp(0, self.size - 1), self.on(ids)[0], local_pad)
        inside = (ids >= self.start) & (ids < end)
        return torch.where(inside.unsqueeze(-1), rows, 0.0)


_SHARDS = {"linear": LinearShard, "conv2d": Conv2dShard, "embedding": EmbeddingShard}


def shard_ranges(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """[(start, end)] of consecutive parts with the given sizes: [2, 3] -> [(0, 2), (2, 5)]."""
    out, start = [], 0
    for size in sizes:
        out.append((start, start + int(size)))
        start += int(size)
    return out


# ----------------------------------------------------------------------------- the rewrite
def _with_dim(shape: tuple, index: int, size: int) -> tuple:
    out = list(shape)
    out[index] = size
    return tuple(out)


def _shard_params(params: list[tuple[str, str, TensorInfo]], a: int, b: int, dim: int,
                  first: bool) -> list[tuple[str, TensorInfo]]:
    """The shard's slices of the layer's parameters, named `fc.weight[0:128]`."""
    out = []
    for role, qual, info in params:
        if role == "weight":
            index = f"[{a}:{b}]" if dim == 0 else f"[:, {a}:{b}]"
            out.append((qual + index, TensorInfo(_with_dim(info.shape, dim, b - a), info.dtype,
                                                 info.requires_grad)))
        elif dim == 0:  # bias, split with the output features
            out.append((f"{qual}[{a}:{b}]", TensorInfo((b - a,), info.dtype, info.requires_grad)))
        elif first:  # bias, whole, in shard 0 of an input-feature split
            out.append((qual, info))
    return out


def _annotate(graph: AnnotatedGraph, node: fx.Node, origin: fx.Node, name: str, value: TensorInfo,
              op: str | None = None, params: list | None = None) -> None:
    node.meta[META_VALUE] = value
    node.meta[META_OP] = op or node_op(node, graph.gm)
    node.meta[META_KIND] = op_kind(node.meta[META_OP])
    node.meta[META_NAME] = name
    node.meta[META_PARAMS] = params or []
    for key in _COPIED_META:
        if key in origin.meta:
            node.meta[key] = origin.meta[key]


def _create(g: fx.Graph, op: str, target: Any, args: tuple, label: str,
            kwargs: dict | None = None) -> fx.Node:
    """A node whose fx name follows its human name (`fc_shard0`), for readable stage code."""
    return g.create_node(op, target, args, kwargs or {}, name=label.replace(".", "_"))


def _narrowed(graph: AnnotatedGraph, origin: fx.Node, src: fx.Node, dim: int, a: int, b: int,
              label: str) -> fx.Node:
    """`src.narrow(dim, a, b - a)`, annotated."""
    info: TensorInfo = src.meta[META_VALUE]
    node = _create(graph.gm.graph, "call_method", "narrow", (src, dim, a, b - a), label)
    _annotate(graph, node, origin, label,
              TensorInfo(_with_dim(info.shape, dim, b - a), info.dtype, info.requires_grad))
    return node


def _free_attr(gm: fx.GraphModule, base: str) -> str:
    name, k = base, 1
    while hasattr(gm, name):
        name, k = f"{base}_{k}", k + 1
    return name


def _module_shard(graph: AnnotatedGraph, node: fx.Node, layer: Layer, parent: nn.Module,
                  arg: fx.Node, i: int, a: int, b: int, dim: int, label: str) -> fx.Node:
    target = _free_attr(graph.gm, f"{layer.attr}__shard{i}")
    graph.gm.add_submodule(target, _SHARDS[layer.kind](parent, layer.label, a, b - a, dim))
    shard = _create(graph.gm.graph, "call_module", target, (arg,), label)
    params = _shard_params(layer.params, a, b, dim, first=i == 0)
    grad = arg.meta[META_VALUE].requires_grad or any(p.requires_grad for _, p in params)
    _annotate(graph, shard, node, label, _shard_value(node, layer, dim, b - a, grad),
              op=layer.kind, params=params)
    return shard


def _call_shard(graph: AnnotatedGraph, node: fx.Node, layer: Layer, arg: fx.Node, i: int,
                a: int, b: int, dim: int, label: str) -> fx.Node:
    """The original call over slices of its [in, out] weight (and bias): helper nodes first."""
    assert layer.weight is not None
    weight = _narrowed(graph, node, layer.weight, 1 if dim == 0 else 0, a, b, f"{label}.weight")
    bias = layer.bias
    if bias is not None and dim == 0:
        bias = _narrowed(graph, node, bias, 0, a, b, f"{label}.bias")
    elif dim == 1 and i > 0:
        bias = None  # input-feature split: bias once, in shard 0
    swap = {layer.x: arg, layer.weight: weight, layer.bias: bias}
    target, args, kwargs = node.target, fx.map_arg(node.args, lambda n: swap.get(n, n)), \
        fx.map_arg(node.kwargs, lambda n: swap.get(n, n))
    if node.meta[META_OP] == "addmm" and bias is None:  # addmm takes no None bias
        aten = isinstance(target, torch._ops.OpOverload)
        target, args, kwargs = torch.ops.aten.mm.default if aten else torch.mm, (arg, weight), {}
    shard = _create(graph.gm.graph, "call_function", target, tuple(args), label, dict(kwargs))
    grad = any(n.meta[META_VALUE].requires_grad for n in shard.all_input_nodes)
    _annotate(graph, shard, node, label, _shard_value(node, layer, dim, b - a, grad))
    return shard


def _out_dim(layer: Layer, dim: int) -> int | None:
    """The output dim the shards cut (None: every shard produces the whole output shape)."""
    return -1 if layer.kind == "linear" and dim == 0 else -3 if layer.kind == "conv2d" else None


def _shard_value(node: fx.Node, layer: Layer, dim: int, size: int, grad: bool) -> TensorInfo:
    out: TensorInfo = node.meta[META_VALUE]
    out_dim = _out_dim(layer, dim)
    shape = out.shape if out_dim is None else _with_dim(out.shape, out_dim, size)
    return TensorInfo(shape, out.dtype, grad)


def split_node(graph: AnnotatedGraph, name: str, sizes: Sequence[int], dim: int = 0,
               recost: bool = True) -> list[str]:
    """Split node `name` in place into len(sizes) shards and a combine; re-cost the graph
    (`recost` False: the caller costs what it added, `recost_added`, once after several splits).

    Precondition: `splittable(graph, node)` contains `dim`; `sizes` are >= 2 positive integers
    summing to the split dimension. Raises ValueError (naming the node) otherwise, before
    changing anything. Returns the shard nodes' names in order.
    """
    names = graph.by_name()
    node = names.get(name)
    if node is None:
        raise ValueError(f"cannot split {name!r}: no node has that name")
    layer = recognise(graph, node)
    if isinstance(layer, str):
        raise ValueError(f"cannot split {name!r}: {layer}")
    if dim not in layer.dims():
        raise ValueError(f"cannot split {name!r} along dim {dim}: {layer.describe} splits along "
                         f"dims {layer.dims()}")
    total, what = layer.extents[dim]
    if len(sizes) < 2 or any(not isinstance(s, numbers.Integral) or s <= 0 for s in sizes) \
            or sum(sizes) != total:
        raise ValueError(f"cannot split {name!r}: sizes {list(sizes)} must be two or more positive "
                         f"integers summing to {total} ({what} of {layer.label!r})")
    n = len(sizes)
    new_names = [f"{name}.shard{i}{suffix}" for i in range(n)
                 for suffix in ("", ".in", ".weight", ".bias")] \
        + [f"{name}.combine"] + [f"{name}.combine.{k}" for k in range(2, n)]
    clash = sorted(set(new_names) & set(names))  # NOTE: nothing changed the graph since `names`
    if clash:
        raise ValueError(f"cannot split {name!r}: nodes named {clash} already exist")

    gm, g = graph.gm, graph.gm.graph
    old = set(g.nodes)
    parent = layer.parent() if layer.parent is not None else None
    shards: list[fx.Node] = []
    with g.inserting_before(node):
        for i, (a, b) in enumerate(shard_ranges(sizes)):
            label, arg = f"{name}.shard{i}", layer.x
            if layer.kind == "linear" and dim == 1:
                arg = _narrowed(graph, node, layer.x, -1, a, b, f"{label}.in")
            if parent is not None:
                shards.append(_module_shard(graph, node, layer, parent, arg, i, a, b, dim, label))
            else:
                shards.append(_call_shard(graph, node, layer, arg, i, a, b, dim, label))
        out: TensorInfo = node.meta[META_VALUE]
        combined = TensorInfo(out.shape, out.dtype,
                              any(s.meta[META_VALUE].requires_grad for s in shards))
        out_dim = _out_dim(layer, dim)
        if out_dim is not None:
            combine = _create(g, "call_function", torch.cat, (shards,), f"{name}.combine",
                              {"dim": out_dim})
            _annotate(graph, combine, node, f"{name}.combine", combined)
        else:
            combine = shards[0]
            for k, shard in enumerate(shards[1:], start=2):
                label = f"{name}.combine" if k == n else f"{name}.combine.{k}"
                combine = _create(g, "call_function", operator.add, (combine, shard), label)
                _annotate(graph, combine, node, label, combined)
    node.replace_all_uses_with(combine)
    g.erase_node(node)  # NOTE: modules and parameters stay registered: they are the real ones
    for dead in reversed([n for n in g.nodes if n in layer.dead]):  # users before their inputs
        if not dead.users:  # (call shards still read the weight)
            g.erase_node(dead)
    gm.recompile()
    if recost:
        _recost(graph, {n for n in g.nodes if n not in old})
    return [s.meta[META_NAME] for s in shards]


def recost_added(graph: AnnotatedGraph, before: set[fx.Node]) -> None:
    """Cost every node of `graph` not in `before` (the nodes of splits made with
    recost=False). NOTE: the same costs as one `_recost` per split: a node's cost reads only
    itself, its inputs' values and whether it reaches the output or depends on the inputs, and
    a later split changes none of these for an earlier split's nodes (its combine takes over
    the replaced layer's uses)."""
    _recost(graph, {n for n in graph.gm.graph.nodes if n not in before})


def _recost(graph: AnnotatedGraph, nodes: set[fx.Node]) -> None:
    """Cost the nodes the split added without repeating the cost model's warnings. NOTE: the
    others keep theirs: the combine carries the layer's value to its users and every other
    node's inputs, liveness and dependence on the inputs are unchanged (what a node's cost reads)."""
    before = list(graph.warnings)
    cost.annotate(graph, nodes=nodes)
    graph.warnings[:] = before + [w for w in graph.warnings[len(before):] if w not in before]


__all__ = ["LinearShard", "Conv2dShard", "EmbeddingShard", "splittable", "extent", "split_node",
           "recost_added", "shard_ranges"]
