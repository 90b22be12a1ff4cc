"""Intra-layer split (BaPipe): rewrite one Linear / Conv2d / Embedding node into shards plus a
combine, so the balance pass can spread one heavy layer over neighbouring stages.

Why each rewrite computes the same function (W: weight, b: bias, shard i owns [a_i, b_i)):
  Linear, dim 0 (output features). Output feature j of x·Wᵀ + b depends only on row j of W
    and b[j], so row block i gives exactly x·W[a_i:b_i]ᵀ + b[a_i:b_i]; concatenating the blocks
    in order along the last dim is y. Each element is the same dot product as before.
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
Gradients reach the original parameters: a shard holds an unregistered reference to the
original module and slices its Parameters (views) on every call, so `state_dict()` and
`parameters()` of the graph module are unchanged and autograd accumulates into the parent.

Extra traffic the rewrite creates: the input x is needed on every stage that holds a shard,
and every shard output travels to the combine (for dim 1 and embeddings each partial is as
large as the whole output). Nothing here charges it: shard outputs and x are live until the
combine, so the partitioner's live-tensor cut model prices any cut between the shards.

Graph layout after `split_node(graph, "fc", sizes)`: in place of the original node, for each
shard i its helper `fc.shard<i>.in` (the narrow, Linear dim 1 only) then `fc.shard<i>`; after
all shards the combine: one `torch.cat` named `fc.combine`, or a chain of adds named
`fc.combine.2`, ..., `fc.combine` (the last one), which takes over the original's users.
Preconditions: an fx-captured graph (call_module nodes; torch.export's aten.linear and ONNX
Gemm are not split) whose node owns its parameters (META_PARAMS lists all of them).
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

    def extra_repr(self) -> str:
        return f"of={self.pipecc_shard_of!r}, dim={self.dim}, start={self.start}, size={self.size}"


class LinearShard(_Shard):
    """dim 0: output features [start, end) of an nn.Linear; dim 1: the partial product of
    input features [start, end) (its input is already narrowed to them)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Conv2dShard(_Shard):
    """Output channels [start, end) of an nn.Conv2d with groups == 1."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.parent
        padding = p.padding
        if p.padding_mode != "zeros":  # as nn.Conv2d._conv_forward does
            x = F.pad(x, p._reversed_padding_repeated_twice, mode=p.padding_mode)
            padding = 0
        return F.conv2d(x, self.weight, self.bias, p.stride, padding, p.dilation, 1)


class EmbeddingShard(_Shard):
    """Table rows [start, end) of an nn.Embedding: the row for ids in range, zeros elsewhere."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        end, pad = self.start + self.size, self.parent.padding_idx
        local_pad = pad - self.start if pad is not None and self.start <= pad < end else None
        rows = F.embedding((ids - self.start).clamp(0, self.size - 1), self.weight, local_pad)
        inside = (ids >= self.start) & (ids < end)
        return torch.where(inside.unsqueeze(-1), rows, 0.0)


def shard_ranges(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """[(start, end)] of consecutive parts with the given sizes: [2, 3] -> [(0, 2), (2, 5)]."""
    out, start = [], 0
    for size in sizes:
        out.append((start, start + int(size)))
        start += int(size)
    return out


def _refusal(graph: AnnotatedGraph, node: fx.Node) -> str | None:
    """Why `node` cannot be split at all, or None."""
    if node.op != "call_module":
        return f"it is a {node.op} node ({node.meta.get(META_OP)}); only calls of nn.Linear, " \
               "nn.Conv2d and nn.Embedding modules split"
    module = graph.gm.get_submodule(str(node.target))
    if not isinstance(module, (nn.Linear, nn.Conv2d, nn.Embedding)):
        return f"it calls a {type(module).__name__}; only nn.Linear, nn.Conv2d and nn.Embedding split"
    if isinstance(module, nn.Conv2d) and module.groups != 1:
        return f"it is a grouped convolution (groups={module.groups})"
    if isinstance(module, nn.Embedding) and (module.max_norm is not None
                                             or module.scale_grad_by_freq or module.sparse):
        return "max_norm, scale_grad_by_freq and sparse embeddings depend on the whole table"
    if len(node.meta.get(META_PARAMS, [])) != len(list(module.parameters())):
        return "it shares its parameters with another node (a reused or tied module) that owns them"
    if len(node.args) != 1 or node.kwargs or not isinstance(node.args[0], fx.Node) \
            or not isinstance(node.args[0].meta.get(META_VALUE), TensorInfo) \
            or not isinstance(node.meta.get(META_VALUE), TensorInfo):
        return "its input or output is not a single annotated tensor"
    return None


def _extent(module: nn.Module, dim: int) -> tuple[int, str]:
    """Length of the split dimension and what it is called."""
    if isinstance(module, nn.Linear):
        return (module.out_features, "out_features") if dim == 0 else (module.in_features, "in_features")
    if isinstance(module, nn.Conv2d):
        return module.out_channels, "out_channels"
    return module.num_embeddings, "num_embeddings"


def splittable(graph: AnnotatedGraph, node: fx.Node) -> tuple[int, ...]:
    """The dims `node` may be split along (length >= 2 only); () when it cannot be split."""
    if _refusal(graph, node) is not None:
        return ()
    module = graph.gm.get_submodule(str(node.target))
    dims = (0, 1) if isinstance(module, nn.Linear) else (0,)
    return tuple(d for d in dims if _extent(module, d)[0] >= 2)


def _with_dim(shape: tuple, index: int, size: int) -> tuple:
    out = list(shape)
    out[index] = size
    return tuple(out)


def _shard_params(node: fx.Node, a: int, b: int, dim: int, first: bool) -> list[tuple[str, TensorInfo]]:
    """The shard's slices of the original node's META_PARAMS, named `fc.weight[0:128]`."""
    out = []
    for qual, info in node.meta[META_PARAMS]:
        if qual.endswith(".weight"):
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


def _free_attr(gm: fx.GraphModule, base: str) -> str:
    name, k = base, 1
    while hasattr(gm, name):
        name, k = f"{base}_{k}", k + 1
    return name


def split_node(graph: AnnotatedGraph, name: str, sizes: Sequence[int], dim: int = 0) -> list[str]:
    """Split node `name` in place into len(sizes) shards and a combine; re-cost the graph.

    Precondition: `splittable(graph, node)` contains `dim`; `sizes` are >= 2 positive integers
    summing to the split dimension. Raises ValueError (naming the node) otherwise, before
    changing anything. Returns the shard nodes' names in order.
    """
    node = graph.by_name().get(name)
    if node is None:
        raise ValueError(f"cannot split {name!r}: no node has that name")
    why = _refusal(graph, node)
    if why is not None:
        raise ValueError(f"cannot split {name!r}: {why}")
    module = graph.gm.get_submodule(str(node.target))
    if dim not in splittable(graph, node):
        raise ValueError(f"cannot split {name!r} along dim {dim}: {type(module).__name__} "
                         f"{str(node.target)!r} splits along dims {splittable(graph, node)}")
    total, what = _extent(module, dim)
    if len(sizes) < 2 or any(not isinstance(s, numbers.Integral) or s <= 0 for s in sizes) \
            or sum(sizes) != total:
        raise ValueError(f"cannot split {name!r}: sizes {list(sizes)} must be two or more positive "
                         f"integers summing to {total} ({what} of {str(node.target)!r})")
    n = len(sizes)
    new_names = [f"{name}.shard{i}{suffix}" for i in range(n) for suffix in ("", ".in")] \
        + [f"{name}.combine"] + [f"{name}.combine.{k}" for k in range(2, n)]
    clash = sorted(set(new_names) & set(graph.by_name()))
    if clash:
        raise ValueError(f"cannot split {name!r}: nodes named {clash} already exist")

    gm, g = graph.gm, graph.gm.graph
    x: fx.Node = node.args[0]  # type: ignore[assignment]
    x_info: TensorInfo = x.meta[META_VALUE]
    out: TensorInfo = node.meta[META_VALUE]
    shard_cls, op = {nn.Linear: (LinearShard, "linear"), nn.Conv2d: (Conv2dShard, "conv2d"),
                     nn.Embedding: (EmbeddingShard, "embedding")}[next(
                         c for c in (nn.Linear, nn.Conv2d, nn.Embedding) if isinstance(module, c))]
    # the output dim that the shards cut (None: every shard produces the whole output shape)
    out_dim = -1 if isinstance(module, nn.Linear) and dim == 0 else \
        -3 if isinstance(module, nn.Conv2d) else None
    shards: list[fx.Node] = []
    with g.inserting_before(node):
        for i, (a, b) in enumerate(shard_ranges(sizes)):
            arg, arg_info = x, x_info
            if isinstance(module, nn.Linear) and dim == 1:
                arg_info = TensorInfo(_with_dim(x_info.shape, -1, b - a), x_info.dtype,
                                      x_info.requires_grad)
                arg = _create(g, "call_method", "narrow", (x, -1, a, b - a), f"{name}.shard{i}.in")
                _annotate(graph, arg, node, f"{name}.shard{i}.in", arg_info)
            target = _free_attr(gm, f"{str(node.target).replace('.', '_')}__shard{i}")
            gm.add_submodule(target, shard_cls(module, str(node.target), a, b - a, dim))
            shard = _create(g, "call_module", target, (arg,), f"{name}.shard{i}")
            params = _shard_params(node, a, b, dim, first=i == 0)
            grad = arg_info.requires_grad or any(p.requires_grad for _, p in params)
            shape = out.shape if out_dim is None else _with_dim(out.shape, out_dim, b - a)
            _annotate(graph, shard, node, f"{name}.shard{i}", TensorInfo(shape, out.dtype, grad),
                      op=op, params=params)
            shards.append(shard)
        grad = any(s.meta[META_VALUE].requires_grad for s in shards)
        combined = TensorInfo(out.shape, out.dtype, grad)
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
    g.erase_node(node)  # NOTE: the module stays registered: its Parameters are the real ones
    gm.recompile()
    _recost(graph)
    return [s.meta[META_NAME] for s in shards]


def _recost(graph: AnnotatedGraph) -> None:
    """Re-run the cost model over the whole graph without repeating its warnings."""
    before = list(graph.warnings)
    cost.annotate(graph)
    graph.warnings[:] = before + [w for w in graph.warnings[len(before):] if w not in before]


__all__ = ["LinearShard", "Conv2dShard", "EmbeddingShard", "splittable", "split_node",
           "shard_ranges"]
