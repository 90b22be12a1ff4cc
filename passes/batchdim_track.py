"""What the batch walk (``pipecc.passes.batchdim``) knows about each node besides its rules:
where a tensor's batch dim is (from its shape, `bdim`), a batch a view merged inside another dim
and how it lies there (`Layout`, followed through per-row work by `merged` until a view splits
it out again), and a mixture of experts' routing (`routed`: tokens sorted by expert over the
whole batch and put back). A node the walk cannot follow ends it with its `Mixing`."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx as fx

from pipecc.ir.graph import META_NAME, META_VALUE, AnnotatedGraph, TensorInfo, tensors_in
from pipecc.passes.batchdim_mixing import Mixing
from pipecc.passes.batchdim_ops import (Layout, _DATA_FREE, _ELEMENTWISE, _MOVES, _arg, _at, _batch_at,
                                        _batchnorm_owners, _factor, _leads, _order, _sizes)


class _Found(Exception):
    def __init__(self, mixing: Mixing) -> None:
        super().__init__(mixing.why)
        self.mixing = mixing


class BatchTracker:
    """The state of the walk over one graph and the facts it follows from node to node; the
    rules per op are `batchdim._Walk`'s."""

    def __init__(self, graph: AnnotatedGraph, training: bool) -> None:
        self.graph, self.training = graph, training
        self.b = graph.symbols["B"]
        # the batch is no longer the outer factor of its dim: how it lies there (`Layout`), or
        # None where that is not known
        self.dirty: dict[fx.Node, Layout | None] = {}
        self.size: set[fx.Node] = set()         # Python numbers that are the batch size
        self.shape_of: dict[fx.Node, int] = {}  # x.shape of a tensor with the batch at that dim
        self.positions: set[fx.Node] = set()    # arange(batch size): sample positions
        self.batchnorms = _batchnorm_owners(graph)
        # a mixture of experts' routing over the flattened tokens: what each node is (`routed`)
        self.route: dict[fx.Node, str] = {}

    # --- values
    def bdims(self, value: Any) -> list[int]:
        if not isinstance(value, TensorInfo):
            return []
        return [i for i, d in enumerate(value.shape) if self.b in getattr(d, "free_symbols", ())]

    def bdim(self, node: Any) -> int | None:
        """The batch dim of a tensor node (None: none); a tensor with two is refused."""
        if not isinstance(node, fx.Node):
            return None
        dims = self.bdims(node.meta.get(META_VALUE))
        if len(dims) > 1:
            self.found(node, "pairs every sample with every other (the batch is in two dims of "
                       "its output)")
        return dims[0] if dims else None

    def batched(self, value: Any) -> bool:
        return any(self.bdims(t) for t in tensors_in(value))

    def found(self, node: fx.Node, why: str, fix: str = "") -> None:
        raise _Found(Mixing(str(node.meta.get(META_NAME, node.name)), why, fix))


    # --- a mixture of experts: tokens sorted by expert, worked on per row, put back
    def routed(self, node: fx.Node, op: str, inputs: list[fx.Node]) -> bool:
        """Routing as MoE layers write it (transformers' grouped experts): the tokens' expert
        ids sorted over all rows (`sort` of a 1-D batched tensor: "pair", then "sorted" values
        and "perm"), rows gathered in that order ("rows": perm // top_k; gathered: "permuted"),
        the group sizes counted from the sorted ids ("counts": histc, cumsum), a grouped matmul
        per group of rows, the inverse permutation ("inverse": index_put_ of positions at perm)
        and the rows gathered back into token order. Each row's result depends on its own row
        and expert id only, so micro-batches compute what the whole batch does. True: `node`
        was one of those steps (recorded); False: none of its inputs is, the usual rules apply.
        Any other use of a routing value is refused."""
        tags = {n: self.route[n] for n in inputs if n in self.route}
        value = node.meta.get(META_VALUE)
        if not tags:
            x = node.args[0] if node.args else None
            if op in ("sort", "argsort") and isinstance(x, fx.Node) and x not in self.dirty \
                    and self.bdim(x) == 0 and len(x.meta[META_VALUE].shape) == 1:
                self.route[node] = "pair" if op == "sort" else "perm"
                return True
            return False
        kinds = set(tags.values())
        first = node.args[0] if node.args else None
        tag = self.route.get(first) if isinstance(first, fx.Node) else None
        if op in _DATA_FREE:
            return True
        if op == "getitem" and tag == "pair":
            self.route[node] = {0: "sorted", 1: "perm"}.get(node.args[1], "")
            return bool(self.route[node]) or self.misrouted(node, op)
        if op in ("floor_divide", "floordiv") and tag == "perm" and isinstance(node.args[1], int):
            self.route[node] = "rows"
            return True
        if op in ("histc", "bincount") and tag == "sorted" or op == "cumsum" and tag == "counts":
            self.route[node] = "counts"
            return True
        if op in ("to", "_to_copy", "float", "long", "int", "type_as") and tag in ("sorted", "counts"):
            self.route[node] = tag
            return True
        if op in ("index", "_unsafe_index") and isinstance(first, fx.Node):
            indices = _arg(node, 1, "indices", ())
            pick = indices[0] if isinstance(indices, (list, tuple)) and len(indices) == 1 else None
            kind = self.route.get(pick) if isinstance(pick, fx.Node) else None
            if kind in ("perm", "rows") and tag is None and first not in self.dirty \
                    and self.bdim(first) == 0:
                self.route[node] = "permuted"  # rows in expert order
                return True
            if kind == "inverse" and tag == "permuted":
                return True  # rows back in token order: an ordinary batched tensor again
            return self.misrouted(node, op)
        if op in ("index_put",) and len(node.args) > 2 and isinstance(node.args[1], (list, tuple)) \
                and len(node.args[1]) == 1 and self.route.get(node.args[1][0]) == "perm" \
                and isinstance(node.args[2], fx.Node) and node.args[2] in self.positions:
            self.route[node] = "inverse"
            return True
        if op in ("grouped_mm_fallback", "_grouped_mm", "grouped_mm") and tag == "permuted" \
                and len(node.args) > 2 and self.route.get(node.args[2]) == "counts" \
                and self.bdim(node.args[1]) is None:
            self.route[node] = "permuted"
            return True
        if kinds == {"permuted"} and (op in _ELEMENTWISE or op in ("chunk", "split", "unsqueeze",
                                                                        "getitem", "silu", "gelu")) \
                and all(n in tags for n in inputs if self.bdim(n) is not None):
            shapes = [t.shape for t in tensors_in(value)]
            lead = [t.shape[0] for n in tags for t in tensors_in(n.meta.get(META_VALUE))]
            if lead and all(len(sh) and sh[0] == lead[0] for sh in shapes):
                self.route[node] = "permuted"
                return True
        return self.misrouted(node, op)

    def misrouted(self, node: fx.Node, op: str) -> bool:
        self.found(node, f"({op}) uses the order of a sort over the batch (tokens sorted across "
                   "samples) in a way pipecc cannot follow")
        return False


    # --- views: is the batch still the outer factor of its dim?
    def view(self, node: fx.Node, x: Any) -> None:
        """A view or reshape: the batch must stay the outer factor of one output dim."""
        if not isinstance(x, fx.Node) or self.bdim(x) is None:
            return
        after = node.meta.get(META_VALUE)
        if x in self.dirty or not self.view_ok(x.meta[META_VALUE], after):
            self.mark(node, self.regroup(self.layout_of(x), after))

    def view_ok(self, before: TensorInfo, after: Any) -> bool:
        """Whether, read in row-major order, the batch index is the outermost part of one
        dim of `after` as it was of one dim of `before` (same elements before it)."""
        if not isinstance(after, TensorInfo):
            return False
        p, q = self.bdims(before), self.bdims(after)
        if len(p) != 1 or len(q) != 1:
            return False
        point = self.graph.point
        ins = [_at(d, point) for d in before.shape]
        outs = [_at(d, point) for d in after.shape]
        batch = int(point[self.b])
        inner_in = _factor(before.shape[p[0]], self.b, point) * math.prod(ins[p[0] + 1:])
        inner_out = _factor(after.shape[q[0]], self.b, point)
        if inner_in is None or inner_out is None:
            return False
        inner_out *= math.prod(outs[q[0] + 1:])
        return inner_in == inner_out and math.prod(ins[:p[0]]) == math.prod(outs[:q[0]]) \
            and ins[p[0]] % batch == 0

    # --- a batch merged inside another dim (multi-head attention's (T, B·H) -> (T·B, H·D))
    def layout_of(self, node: fx.Node) -> Layout | None:
        """How the batch lies in `node`: its recorded layout when merged, else from its shape."""
        if node in self.dirty:
            return self.dirty[node]
        value = node.meta.get(META_VALUE)
        if not isinstance(value, TensorInfo):
            return None
        dims = []
        for d in value.shape:
            if self.b not in getattr(d, "free_symbols", ()):
                dims.append(((_at(d, self.graph.point), False),))
                continue
            k = _factor(d, self.b, self.graph.point)
            if k is None:
                return None
            dims.append(((self.batch, True),) + (((k, False),) if k > 1 else ()))
        return tuple(dims)

    @property
    def batch(self) -> int:
        return int(self.graph.point[self.b])

    def mark(self, node: fx.Node, layout: Layout | None) -> None:
        """`node`'s batch lies as `layout` says: clean again (the outer factor of the dim its
        shape puts it in) or merged; None: not known, merged."""
        if layout is not None and _leads(layout, self.bdims(node.meta.get(META_VALUE))):
            self.dirty.pop(node, None)
        else:
            self.dirty[node] = layout

    def regroup(self, layout: Layout | None, after: Any) -> Layout | None:
        """`layout` read in row-major order and regrouped into the dims of `after` (a view):
        a factor other than the batch may split, the batch may not; None where it does not fit."""
        if layout is None or not isinstance(after, TensorInfo) or self.batch < 2:
            return None
        factors = [f for dim in layout for f in dim if f[1] or f[0] != 1]
        out: list[tuple[tuple[int, bool], ...]] = []
        i = 0
        for size in (_at(d, self.graph.point) for d in after.shape):
            dim: list[tuple[int, bool]] = []
            prod = 1
            while prod < size:
                if i >= len(factors):
                    return None
                f, is_batch = factors[i]
                if size % (prod * f) == 0:
                    dim.append(factors[i])
                    prod *= f
                    i += 1
                elif is_batch or size % prod or f % (size // prod):
                    return None
                else:
                    dim.append((size // prod, False))
                    factors[i] = (f // (size // prod), False)
                    prod = size
            if prod != size:
                return None
            out.append(tuple(dim) or ((1, False),))
        return tuple(out) if i == len(factors) else None

    def merged(self, node: fx.Node, op: str, batched: list[fx.Node]) -> bool:
        """An op on a tensor whose batch is merged inside a dim: True when it works on each
        index of that dim alone (elementwise, a layout op, a linear or norm or softmax over
        other dims), with `node`'s layout recorded; False: refuse it."""
        layouts = [self.layout_of(n) for n in batched]
        layout = layouts[0] if all(lay == layouts[0] for lay in layouts) else None
        value = node.meta.get(META_VALUE)
        shape = tuple(_at(d, self.graph.point) for d in value.shape) if isinstance(value, TensorInfo) else None
        where = _batch_at(layout) if layout is not None else None
        rank = len(layout) if layout is not None else 0

        def same(new: Layout | None) -> bool:
            self.mark(node, new if new is not None and _sizes(new) == shape else None)
            return True

        if op in _ELEMENTWISE:
            return same(layout)
        if op == "getitem" and isinstance(batched[0].meta.get(META_VALUE), (tuple, list)):
            return same(layout)  # one result of a tuple-valued op (native_layer_norm)
        if op in ("permute", "transpose", "t", "swapaxes", "swapdims") and layout is not None:
            order = _order(node, op, rank)
            return same(tuple(layout[k] for k in order) if order is not None else None)
        if op in _MOVES:
            self.mark(node, None)  # as before: merged, its layout not followed
            return True
        if where is None or layout is None:
            return False
        last = where[0] == rank - 1
        if op == "linear" and not last and self.bdim(node.args[1]) is None:
            return same(layout[:-1] + (((shape[-1], False),),) if shape else None)
        if op in ("layer_norm", "native_layer_norm", "rms_norm"):
            norm = _arg(node, 1, "normalized_shape", ())
            n = len(norm) if isinstance(norm, (list, tuple)) else rank
            return where[0] < rank - n and same(layout)
        if op in ("softmax", "log_softmax", "_softmax", "_log_softmax"):
            dim = _arg(node, 1, "dim", None)
            return isinstance(dim, int) and dim % rank != where[0] and same(layout)
        if op == "scaled_dot_product_attention" and len(batched) >= 3 \
                and all(n in node.args[:3] for n in batched):
            return where[0] < rank - 2 and same(layout[:-1] + (((shape[-1], False),),) if shape else None)
        return False

    def merged_module(self, node: fx.Node, m: torch.nn.Module, x: fx.Node) -> None:
        """A module on a tensor whose batch is merged inside a dim (as `merged`)."""
        layout = self.layout_of(x)
        value = node.meta.get(META_VALUE)
        shape = tuple(_at(d, self.graph.point) for d in value.shape) if isinstance(value, TensorInfo) else None
        where = _batch_at(layout) if layout is not None else None
        new: Layout | None = None
        if where is not None and shape is not None:
            rank = len(layout)
            if isinstance(m, (torch.nn.Dropout, torch.nn.Identity)) or type(m).__module__ == \
                    "torch.nn.modules.activation" and not isinstance(m, (torch.nn.Softmax, torch.nn.LogSoftmax,
                                                                         torch.nn.Softmin, torch.nn.MultiheadAttention)):
                new = layout
            elif isinstance(m, torch.nn.Linear) and where[0] != rank - 1:
                new = layout[:-1] + (((shape[-1], False),),)
            elif isinstance(m, (torch.nn.LayerNorm, torch.nn.RMSNorm)) and \
                    where[0] < rank - len(tuple(m.normalized_shape)):
                new = layout
        if new is None or _sizes(new) != shape:
            self.found(node, f"({type(m).__name__}) reads a tensor whose batch a view merged inside "
                       "another dim")
        self.mark(node, new)

