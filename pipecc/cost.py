"""The symbolic cost model: FLOPs forward and backward, parameter bytes, activation bytes and
bytes moved for every node, as sympy expressions in the graph's symbols (B, ...) plus their
values at the example point. Sympy lives here and nowhere else in the compiler.

Conventions (CONTRACT §5):
  * a multiply-add counts 2 FLOPs;
  * *matmul-class* FLOPs (linear, matmul/bmm, convolution and transposed convolution,
    attention products, recurrent gate products) follow `torch.utils.flop_counter.
    FlopCounterMode`: 2·(output elements)·(reduction length) forward; backward counts one
    such product per operand that needs a gradient (so the first layer, whose input needs
    none, costs only its weight gradient). Attention is counted as the math path does
    (QKᵀ and AV, and their gradients, without flash attention's recomputation). Where the
    reference is wrong we count correctly: torch 2.13 ignores `groups` in convolution
    backward (pytorch PR #183405), we do not;
  * other work (norms, softmax, activations, elementwise, reductions) has a per-element
    constant (`pipecc.cost_formulas`, where every op's formula is); its backward costs the
    same again when any input needs a gradient;
  * views and reshapes cost no FLOPs and hold no memory; cat/copies move bytes;
  * the backward splits into an input-gradient part and a weight-gradient part
    (`backward_weight_flops`; the input part is the rest), as zero-bubble schedules run them
    (Qi et al., ICLR 2024: B = dX, W = dW). For matmul-class ops that is one product per
    operand: dX = dY·Wᵀ is input work, dW = Xᵀ·dY (and the bias's Σ dY) weight work, where a
    *weight* is an operand computed from parameters alone (a `get_attr`, or a view of one).
    Recurrent layers: the gate-weight products are weight work, the hidden-state and input
    gradients input work. Norms with an affine weight: dγ = Σ dY·x̂ and dβ = Σ dY, 3 FLOPs per
    output element (the rest of the norm's backward is input work). Embeddings: all weight
    work (the indices take no gradient). Ops without weights: all input work;
  * a call of a library function kept as one node (a `torch.fx.wrap`ped function: torchvision's
    `stochastic_depth`, Swin's attention, the model file's own) is costed by what it runs,
    measured on fake tensors under FlopCounterMode at a few sizes (`pipecc.cost_opaque`);
  * ops the table does not know cost one FLOP per output element and move all their bytes: a
    guess, which can be far below their real work, so they are listed in a warning that says
    so, never silently zero. (Composite torch.nn modules such as nn.TransformerEncoderLayer
    are not such ops: the frontend traces into them, see `frontend.fx_tracer`.)
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Collection

import sympy
import torch.fx as fx

from pipecc.ir.graph import (META_COST, META_KIND, META_OP, META_PARAMS, META_VALUE,
                       AnnotatedGraph, tensors_in, value_bytes)
from pipecc import cost_formulas as formulas
from pipecc import cost_precision as mixed
from pipecc.cost_opaque import Measurer, is_opaque, measured_names
from pipecc import cost_saved
from pipecc.cost_saved import META_SAVES, Saves, is_view_node


@dataclass
class NodeCost:
    """Costs of one node. Expressions are sympy; the `*_v` twins are values at the point."""

    forward_flops: Any = 0
    backward_flops: Any = 0
    forward_flops_matmul: Any = 0
    backward_flops_matmul: Any = 0
    param_bytes: int = 0
    output_bytes: Any = 0      # size of what the node produces (what crosses a cut)
    stash_bytes: Any = 0       # memory it holds for backward (0 for views)
    bytes_moved: Any = 0       # memory traffic of the forward (inputs + params + outputs)
    values: dict[str, int] | None = None
    # the part of backward_flops (of backward_flops_matmul) that computes weight gradients;
    # the rest is the input gradient (module docstring)
    backward_weight_flops: Any = 0
    backward_weight_flops_matmul: Any = 0

    FIELDS = ("forward_flops", "backward_flops", "forward_flops_matmul",
              "backward_flops_matmul", "param_bytes", "output_bytes", "stash_bytes", "bytes_moved",
              "backward_weight_flops", "backward_weight_flops_matmul")

    def value(self, field: str) -> int:
        assert self.values is not None, "cost not evaluated"
        return self.values[field]


def node_cost(node: fx.Node, gm: fx.GraphModule,
              data: set[fx.Node] | None = None, flash_attention: bool = False,
              low: set[fx.Node] | None = None, autocast_device: str = "cuda") -> tuple[NodeCost, bool]:
    """Cost of one node; the flag says whether the op was unknown to the table. `data`: the
    nodes computed from a graph input (`annotate` passes them); an operand outside it is a
    weight for the backward split (without it, only `get_attr` operands are).
    `flash_attention`: fused attention keeps no scores and recomputes them in backward
    (`cost_formulas.attention_memory`). `low`: under mixed precision, the nodes autocast computes in the low
    dtype (`cost_precision.autocast_low`; None: float32), which sets the bytes it holds, sends
    and moves (`pipecc.cost_precision`'s docstring)."""
    kind = node.meta[META_KIND]
    value = node.meta.get(META_VALUE)
    param_bytes = sum(int(info.nbytes) for _, info in node.meta.get(META_PARAMS, []))
    out_bytes = value_bytes(value) if kind not in ("param",) else 0
    held = out_bytes
    if low is not None and kind != "param":  # mixed precision: sent in the low dtype, held as autocast gives it
        out_bytes, held = mixed.wire_bytes(value), mixed.held_bytes(node, low)
    if node.op in ("placeholder", "get_attr", "output"):
        return NodeCost(param_bytes=param_bytes,
                        output_bytes=out_bytes if node.op == "placeholder" else 0), False
    o = formulas.operands(node, gm, data)
    fwd, bwd, fwd_mm, bwd_mm, unknown = formulas.flops(o)
    try:
        bwd_w, bwd_w_mm = (0, 0) if unknown else formulas.weight_backward(o, fwd_mm, bwd)
    except (IndexError, AttributeError, TypeError, ZeroDivisionError):
        bwd_w, bwd_w_mm = 0, 0  # NOTE: a shape the split cannot read: all input work
    is_view = is_view_node(node)
    in_bytes = sum((t.nbytes for t in o.inputs), 0) if low is None else \
        sum((mixed.held_bytes(a, low) for a in node.all_input_nodes), 0)
    moved = 0 if is_view else in_bytes + held + param_bytes
    stash = 0 if is_view or not any(t.requires_grad for t in tensors_in(value)) else held
    scores = None
    if kind == "attention" and not unknown:
        stash, bwd, bwd_mm = formulas.attention_memory(o, stash, bwd, bwd_mm, flash_attention)
        scores = stash - held if stash != 0 else 0
    weight_nodes = {a for a in node.all_input_nodes if a.op == "get_attr"}  # parameters and buffers
    rule = cost_saved.saves(node, o.module, o.params, weight_nodes, held, scores)
    if unknown:  # no formula: the conservative charge (cost_saved's docstring)
        rule = Saves(stash != 0, tuple(a for a in node.all_input_nodes if a not in weight_nodes), 0, held)
    data_grad = any(t.requires_grad for t in o.inputs if not o.is_weight(t) and id(t) not in o.weights)
    if low is not None and stash != 0 and data_grad:  # autocast's weight copies, saved per micro-batch
        weights = o.params or [t for t in o.inputs if id(t) in o.weights]  # (for the input's gradient)
        copies = mixed.weight_copy_bytes(node, weights)
        stash = stash + copies
        rule = Saves(rule.own, rule.keeps, rule.extra + copies, held)
    if low is not None and rule.keeps:  # an operand autocast casts for the op is kept as that copy
        keeps, cast = mixed.kept_casts(node, rule.keeps, low, autocast_device)
        rule = Saves(rule.own, keeps, rule.extra + cast, held)
    node.meta[META_SAVES] = rule
    return NodeCost(forward_flops=fwd, backward_flops=bwd, forward_flops_matmul=fwd_mm,
                    backward_flops_matmul=bwd_mm, param_bytes=param_bytes,
                    output_bytes=out_bytes, stash_bytes=stash, bytes_moved=moved,
                    backward_weight_flops=bwd_w, backward_weight_flops_matmul=bwd_w_mm), unknown


def _apply_saved(graph: AnnotatedGraph, data: set[fx.Node]) -> None:
    """Every node's `stash_bytes` from the graph's saved-tensor rules (`pipecc.cost_saved`): its
    own buffers plus its output once if any backward keeps its storage. Nodes whose figure did
    not change keep their evaluated values."""
    nodes = list(graph.gm.graph.nodes)
    alias = cost_saved.alias_map(graph.gm)
    kept = cost_saved.kept_roots(nodes, alias)
    for node in nodes:
        rule: Saves | None = node.meta.get(META_SAVES)
        cost: NodeCost | None = node.meta.get(META_COST)
        if rule is None or cost is None:
            continue
        charged = node in kept and not alias.get(node)
        node.meta[cost_saved.META_KEPT] = node in kept or bool(alias.get(node)) and cost_saved.root(node, alias) in kept
        if node not in data:  # computed without the inputs (a weight's transform, position ids):
            stash = _simplify(rule.held) if charged else 0  # a new tensor each forward when kept
        else:
            stash = _simplify(rule.extra + rule.held if charged else rule.extra)
        if cost.values is None or stash != cost.stash_bytes:
            cost.stash_bytes = stash
            if cost.values is not None:
                cost.values["stash_bytes"] = _evaluate(stash, graph.point)


def _reaches_output(graph: fx.Graph) -> set[fx.Node]:
    """Nodes with a path to the output node (the others get no gradient in backward)."""
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    live, stack = {out}, [out]
    while stack:
        for src in stack.pop().all_input_nodes:
            if src not in live:
                live.add(src)
                stack.append(src)
    return live


def _depends_on_inputs(graph: fx.Graph) -> set[fx.Node]:
    """Nodes computed (transitively) from a graph input, i.e. real activations."""
    data: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder" or any(a in data for a in node.all_input_nodes):
            data.add(node)
    return data


def _simplify(x: Any) -> Any:
    if isinstance(x, sympy.Expr):
        return sympy.expand(x)
    if isinstance(x, float) and x.is_integer():
        return int(x)
    return x


def _evaluate(x: Any, point: dict) -> int:
    if isinstance(x, sympy.Expr):
        return _evaluate_at(x, tuple(point.items()))
    return int(math.ceil(x - 1e-9)) if isinstance(x, float) else int(x)


@functools.lru_cache(maxsize=1 << 16)
def _evaluate_at(x: sympy.Expr, point: tuple) -> int:
    # NOTE: a pure function of the expression and the point: the layer-split search costs
    # thousands of equal shards (issue 31)
    return int(math.ceil(float(x.subs(dict(point))) - 1e-9))


FLASH_ATTENTION = "pipecc.flash_attention"  # graph.gm.meta key: the attention mode last costed


def flash_attention(graph: AnnotatedGraph) -> bool:
    """Whether `graph` was last costed with flash attention (`annotate(graph, True)`)."""
    return bool(graph.gm.meta.get(FLASH_ATTENTION, False))


PRECISION = "pipecc.precision"  # graph.gm.meta key: (precision, autocast device) last costed (cost_precision)


def recost_attention(graph: AnnotatedGraph, flash: bool, precision: str = "fp32",
                     kinds: Collection[str] = ()) -> None:
    """Re-cost `graph` when it was last costed in the other attention mode or another precision
    (for devices of these `kinds`: whose autocast lists count, `cost_precision.autocast_device`;
    its warnings kept)."""
    autocast_device = mixed.autocast_device(list(kinds), precision)
    mode = (precision, autocast_device if precision != "fp32" else "")
    if flash != flash_attention(graph) or mode != graph.gm.meta.get(PRECISION, ("fp32", "")):
        warned = list(graph.warnings)
        annotate(graph, flash_attention=flash, precision=precision, autocast_device=autocast_device)
        graph.warnings[:] = warned


def move_point(graph: AnnotatedGraph, values: dict[str, int]) -> None:
    """Evaluate `graph`'s costs at another point of its symbols (`values` by symbol name; e.g.
    the maximum of a declared length range): `graph.point` and every node's `values` change,
    its expressions do not."""
    graph.point.update({graph.symbols[name]: int(v) for name, v in values.items()})
    for node in graph.gm.graph.nodes:
        cost = node.meta.get(META_COST)
        if cost is not None:
            cost.values = {f: _evaluate(getattr(cost, f), graph.point) for f in NodeCost.FIELDS}


def annotate(graph: AnnotatedGraph, flash_attention: bool | None = None,
             nodes: Collection[fx.Node] | None = None, precision: str | None = None,
             autocast_device: str = "cuda") -> list[str]:
    """Write META_COST on every node (`nodes`: only on those, e.g. what a rewrite added; a
    node's cost reads only itself, its inputs' values and which nodes reach the output or
    depend on the inputs, computed here over the whole graph). Returns the warnings
    (unknown ops, listed once).
    `flash_attention` (None: as the graph was last costed, else the math path) sets how fused
    attention nodes keep their scores (`cost_formulas.attention_memory`); the mode is kept in the graph so
    re-costing after a rewrite keeps it; `precision` likewise (None: as last costed, else
    "fp32"; "bf16"/"fp16": the bytes under autocast on `autocast_device`, `pipecc.cost_precision`)."""
    if flash_attention is None:
        flash_attention = bool(graph.gm.meta.get(FLASH_ATTENTION, False))
    graph.gm.meta[FLASH_ATTENTION] = bool(flash_attention)
    if precision is None:
        precision, autocast_device = graph.gm.meta.get(PRECISION, ("fp32", ""))
    graph.gm.meta[PRECISION] = (precision, autocast_device if precision != "fp32" else "")
    low = mixed.autocast_low(graph.gm, autocast_device) if precision != "fp32" else None
    unknown: dict[str, int] = {}
    live = _reaches_output(graph.gm.graph)
    data = _depends_on_inputs(graph.gm.graph)
    measurer = Measurer(graph, data)
    for node in graph.gm.graph.nodes:
        if nodes is not None and node not in nodes:
            continue
        cost, is_unknown = node_cost(node, graph.gm, data, flash_attention, low, autocast_device)
        if is_opaque(node):  # a library function kept as one node: costed by what it runs
            measured = measurer.measure(node)
            if measured is not None:
                for f, v in measured.items():
                    setattr(cost, f, v)
                grads = bool(measured["backward_flops"] or measured["stash_bytes"])
                cost.stash_bytes = cost.stash_bytes + cost.output_bytes if grads else 0
                # what it saves inside is measured; its output and operands: the conservative charge
                node.meta[META_SAVES] = Saves(grads, tuple(a for a in node.all_input_nodes if a in data) if grads else (),
                                              measured["stash_bytes"] if grads else 0, cost.output_bytes)
                is_unknown = False
        if node not in live:  # its result never reaches the loss: autograd skips it
            cost.backward_flops = cost.backward_flops_matmul = 0
            cost.backward_weight_flops = cost.backward_weight_flops_matmul = 0
        if node not in data:  # computed from weights alone (weight norm, exporter's concats)
            cost.stash_bytes = 0
            # NOTE: its gradient flows only to weights: all of its backward is weight work
            cost.backward_weight_flops = cost.backward_flops
            cost.backward_weight_flops_matmul = cost.backward_flops_matmul
        for f in NodeCost.FIELDS:
            setattr(cost, f, _simplify(getattr(cost, f)))
        cost.values = {f: _evaluate(getattr(cost, f), graph.point) for f in NodeCost.FIELDS}
        node.meta[META_COST] = cost
        if is_unknown:
            unknown[node.meta[META_OP]] = unknown.get(node.meta[META_OP], 0) + 1
    _apply_saved(graph, data)
    notes = []
    if unknown:
        listed = ", ".join(f"{op} (x{n})" for op, n in sorted(unknown.items()))
        cannot = f" ({measured_names(measurer.failed)} could not be run on fake tensors to measure it)" \
            if measurer.failed else ""
        notes.append(f"no cost formula for {listed}{cannot}: guessed as one FLOP per output element "
                     "plus all bytes moved, which can be far below their real work (the plan "
                     "may be unbalanced around them)")
    notes.extend(measurer.notes)
    graph.warnings.extend(notes)
    return notes


TOTAL_FIELDS = ("forward_flops", "backward_flops", "forward_flops_matmul",
                "backward_flops_matmul", "param_bytes", "activation_bytes")


def totals(graph: AnnotatedGraph, symbolic: bool = False) -> dict[str, Any]:
    """Graph totals; activation bytes are what the nodes stash for backward (`pipecc.cost_saved`)."""
    out: dict[str, Any] = {f: 0 for f in TOTAL_FIELDS}
    for node in graph.gm.graph.nodes:
        cost: NodeCost = node.meta[META_COST]
        for f in TOTAL_FIELDS:
            src = "stash_bytes" if f == "activation_bytes" else f
            if f == "activation_bytes" and node.op in ("placeholder", "get_attr", "output"):
                continue
            out[f] = out[f] + (getattr(cost, src) if symbolic else cost.value(src))
    if symbolic:
        out = {k: sympy.expand(v) if isinstance(v, sympy.Expr) else v for k, v in out.items()}
    return out


__all__ = ["NodeCost", "annotate", "totals", "node_cost", "TOTAL_FIELDS"]
