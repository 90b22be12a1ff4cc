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
    constant below; its backward costs the same again when any input needs a gradient;
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

# NOTE(size): one module holds every op's cost formula (the sympy side of the cost model), so a
# formula and the ops it covers are read together; opaque calls are in cost_opaque.
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Collection

import sympy
import torch.fx as fx

from pipecc.ir.graph import (META_COST, META_KIND, META_OP, META_PARAMS, META_VALUE,
                       AnnotatedGraph, Dim, TensorInfo, tensors_in, value_bytes)
from pipecc import cost_precision as mixed
from pipecc.cost_opaque import Measurer, is_opaque, measured_names
from pipecc import cost_saved
from pipecc.cost_saved import META_SAVES, Saves, is_view_node

# FLOPs per output element of non-matmul work (forward). Sources: the usual counting
# conventions of fvcore/ptflops (1 per elementwise op; norms ~5: mean, var, normalise, scale,
# shift; softmax ~5: max, sub, exp, sum, div; GELU's tanh approximation ~8).
_PER_ELEMENT = {"norm": 5, "softmax": 5, "activation": 1, "elementwise": 1, "reduction": 1,
                "pool": 1, "loss": 5, "embedding": 0, "shape": 0, "param": 0, "input": 0}
_ACTIVATION_COST = {"gelu": 8, "silu": 4, "sigmoid": 4, "tanh": 4, "mish": 6, "softplus": 4,
                    "elu": 3, "hardswish": 3, "hardsigmoid": 2, "erf": 4}


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


@dataclass
class _Operands:
    op: str
    kind: str
    inputs: list[TensorInfo]        # tensor args in order (params of a module appended)
    params: list[TensorInfo]        # the node's own parameters (call_module)
    output: list[TensorInfo]
    module: Any                     # the nn.Module for call_module, else None
    node: fx.Node
    weights: frozenset[int] = frozenset()  # id() of the inputs computed from parameters alone

    def is_weight(self, t: TensorInfo | None) -> bool:
        """True for one of the node's own parameters or an input computed from weights alone."""
        return t is not None and (any(t is p for p in self.params) or id(t) in self.weights)


def _prod(xs) -> Dim:
    out: Dim = 1
    for x in xs:
        out = out * x
    return out


def _numel(t: TensorInfo | None) -> Dim:
    return t.numel if t is not None else 0


def _mm(fwd_mm: Dim, operands_need_grad: int, other_fwd: Dim = 0, other_bwd: Dim = 0):
    return fwd_mm + other_fwd, fwd_mm * operands_need_grad + other_bwd, fwd_mm, fwd_mm * operands_need_grad


# Each rule returns (forward, backward, forward_matmul, backward_matmul) FLOPs.
def _linear(o: _Operands):
    x = o.inputs[0]
    w = o.params[0] if o.params else (o.inputs[1] if len(o.inputs) > 1 else None)
    bias = (o.params[1] if len(o.params) > 1 else None) if o.params else \
        (o.inputs[2] if len(o.inputs) > 2 else None)
    if o.op == "addmm":  # addmm(bias, a, b)
        bias, x, w = o.inputs[0], o.inputs[1], o.inputs[2]
        k = x.shape[-1]
    elif o.op == "gemm":  # onnx Gemm(A, B, C, transA, transB)
        trans_a = o.node.kwargs.get("transA", 0)
        x, w = o.inputs[0], o.inputs[1]
        bias = o.inputs[2] if len(o.inputs) > 2 else None
        k = x.shape[0] if trans_a else x.shape[-1]
    else:
        k = x.shape[-1]
    out = o.output[0]
    fwd_mm = 2 * out.numel * k
    grads = int(x.requires_grad) + int(w is not None and w.requires_grad)
    bias_fwd = out.numel if bias is not None else 0
    bias_bwd = out.numel if bias is not None and bias.requires_grad else 0
    return _mm(fwd_mm, grads, bias_fwd, bias_bwd)


_GROUPED_MM = frozenset("grouped_mm grouped_mm_fallback _grouped_mm".split())


def _einsum_flops(o: _Operands) -> Dim:
    """2·(product of every index's size) per pairwise contraction, left to right, as torch.einsum
    runs it without opt_einsum (each pair a bmm, FlopCounterMode's count); 0 for one operand."""
    spec = o.node.args[0] if o.node.args and isinstance(o.node.args[0], str) else None
    if spec is None or len(o.inputs) < 2:
        return 0
    ins, _, out = spec.replace(" ", "").partition("->")
    terms = ins.split(",")
    if not out and "->" not in spec:  # implicit output: letters seen once, sorted
        out = "".join(sorted(c for c in set(ins) if c.isalpha() and ins.count(c) == 1))
    spare = iter("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
    width = max(len(t.shape) - len(term.replace("...", "")) for t, term in zip(o.inputs, terms))
    dots = "".join(next(spare) for _ in range(max(width, 0)))
    size: dict[str, Dim] = {}
    letters = []
    for t, term in zip(o.inputs, terms):
        n = len(t.shape) - len(term.replace("...", ""))
        term = term.replace("...", dots[len(dots) - n:] if n else "")
        letters.append(term)
        for c, d in zip(term, t.shape):
            if c not in size or size[c] == 1:
                size[c] = d
    out = out.replace("...", dots)
    total: Dim = 0
    left = letters[0]
    for k in range(1, len(letters)):
        right = letters[k]
        both = set(left) | set(right)
        total = total + 2 * _prod(size[c] for c in sorted(both))
        later = set(out).union(*letters[k + 1:]) if k + 1 < len(letters) else set(out)
        left = "".join(c for c in sorted(both) if c in later)
    return total


def _matmul(o: _Operands):
    if o.op == "einsum":  # every operand that needs a gradient gets one product as large
        fwd_mm = _einsum_flops(o)
        return _mm(fwd_mm, sum(int(t.requires_grad) for t in o.inputs) if fwd_mm else 0,
                   0 if fwd_mm else sum((t.numel for t in o.output), 0))
    if o.op in _GROUPED_MM:  # rows (S, K) by the expert weights (E, K, N) of their group
        x, w = o.inputs[0], o.inputs[1]
        fwd_mm = 2 * x.shape[0] * x.shape[-1] * w.shape[-1]
        return _mm(fwd_mm, int(x.requires_grad) + int(w.requires_grad))
    a, b = o.inputs[-2], o.inputs[-1]
    out = o.output[0]
    k = a.shape[-1] if a.shape else 1
    fwd_mm = 2 * out.numel * k
    extra = out.numel if o.op == "baddbmm" else 0
    if len(a.shape) == 1 or len(b.shape) == 1:
        # matrix-vector: the matrix operand's gradient is an outer product (one multiply per
        # element, not a matmul); only the vector's gradient is a matrix-vector product.
        mat, vec = (b, a) if len(a.shape) == 1 else (a, b)
        bwd_mm = fwd_mm if vec.requires_grad else 0
        outer = mat.numel if mat.requires_grad else 0
        return fwd_mm, bwd_mm + outer, fwd_mm, bwd_mm
    grads = int(a.requires_grad) + int(b.requires_grad)
    return _mm(fwd_mm, grads, extra, extra)


def _conv(o: _Operands):
    x = o.inputs[0]
    w = o.params[0] if o.params else o.inputs[1]
    bias = o.params[1] if len(o.params) > 1 else (o.inputs[2] if not o.params and len(o.inputs) > 2 else None)
    out = o.output[0]
    if o.kind == "conv_transpose":
        fwd_mm = 2 * x.numel * _prod(w.shape[1:])
    else:
        fwd_mm = 2 * out.numel * _prod(w.shape[1:])
    grads = int(x.requires_grad) + int(w.requires_grad)
    bias_fwd = out.numel if bias is not None else 0
    bias_bwd = out.numel if bias is not None and bias.requires_grad else 0
    return _mm(fwd_mm, grads, bias_fwd, bias_bwd)


def _attention(o: _Operands):
    q, k, v = o.inputs[0], o.inputs[1], o.inputs[2]
    length, e = q.shape[-2], q.shape[-1]
    s, ev = k.shape[-2], v.shape[-1]
    batch = q.numel / (length * e) if not isinstance(q.numel, int) else q.numel // (length * e)
    qk = 2 * batch * length * s * e
    av = 2 * batch * length * s * ev
    scores = batch * length * s
    bwd = qk * (int(q.requires_grad) + int(k.requires_grad)) \
        + av * (int(q.requires_grad or k.requires_grad) + int(v.requires_grad))
    other = 6 * scores  # scale, mask, softmax (5 per score)
    any_grad = q.requires_grad or k.requires_grad or v.requires_grad
    return qk + av + other, bwd + (other if any_grad else 0), qk + av, bwd


def _rnn(o: _Operands):
    """nn.LSTM/GRU/RNN: gate products per layer and direction, as the unrolled cells count."""
    x = o.inputs[0]
    gates = {"lstm": 4, "gru": 3}.get(o.op, 1)
    hidden, dirs, layers, batch_first, input_size = _rnn_config(o)
    if batch_first:
        batch, steps = x.shape[0], x.shape[1]
    else:
        steps, batch = x.shape[0], x.shape[1]
    fwd = bwd = 0
    x_grad = x.requires_grad
    for layer in range(layers):
        in_size = input_size if layer == 0 else hidden * dirs
        w_ih = 2 * batch * steps * gates * hidden * in_size
        w_hh = 2 * batch * steps * gates * hidden * hidden
        for _ in range(dirs):
            fwd = fwd + w_ih + w_hh
            # weight gradients, hidden-state gradients (h0 needs none: T-1 steps), input grads
            bwd = bwd + w_ih + w_hh + 2 * batch * (steps - 1) * gates * hidden * hidden
            if x_grad:
                bwd = bwd + w_ih
        x_grad = True
    cell = batch * steps * gates * hidden * dirs * layers * 3
    return fwd + cell, bwd + cell, fwd, bwd


def _rnn_config(o: _Operands) -> tuple:
    """(hidden, directions, layers, batch_first, input size) of nn.LSTM/GRU/RNN, of
    aten.lstm/gru (torch.export) and of ONNX LSTM/GRU/RNN."""
    m = o.module
    if m is not None:
        return (m.hidden_size, 2 if m.bidirectional else 1, m.num_layers, m.batch_first,
                m.input_size)
    if o.node.op == "call_function" and not hasattr(o.node.target, "__pipecc_onnx_op__"):
        # aten.lstm.input(x, hx, params, has_biases, num_layers, dropout, train, bidirectional,
        # batch_first); aten.gru.input(x, hx, params, ...) has the same tail
        args = o.node.args
        params = args[2]
        w_ih, w_hh = params[0].meta["pipecc.value"], params[1].meta["pipecc.value"]
        return (w_hh.shape[1], 2 if args[7] else 1, int(args[4]), bool(args[8]), w_ih.shape[1])
    w, r = o.inputs[1], o.inputs[2]  # ONNX: W [dirs, gates*H, I], R [dirs, gates*H, H]
    return r.shape[-1], w.shape[0], 1, bool(o.node.kwargs.get("layout", 0)), w.shape[-1]


def _mha(o: _Operands):
    """nn.MultiheadAttention: input/output projections plus the attention products."""
    m = o.module
    q, k = o.inputs[0], o.inputs[1]
    e = m.embed_dim
    if m.batch_first:
        b, length, s = q.shape[0], q.shape[1], k.shape[1]
    else:
        length, b, s = q.shape[0], q.shape[1], k.shape[0]
    proj = 2 * b * e * e * (length + 2 * s) + 2 * b * length * e * e
    attn = 2 * 2 * b * length * s * e
    any_grad = any(t.requires_grad for t in o.inputs[:3])
    bwd = proj * (2 if any_grad else 1) + attn * 2
    return proj + attn + 6 * b * m.num_heads * length * s, bwd, proj + attn, bwd


def _elementwise(o: _Operands):
    kind = o.kind
    per = _ACTIVATION_COST.get(o.op, _PER_ELEMENT.get(kind, 1))
    if kind in ("reduction", "pool", "loss"):
        n = _numel(o.inputs[0]) if o.inputs else _numel(o.output[0] if o.output else None)
    else:
        n = sum((t.numel for t in o.output), 0)
    fwd = per * n
    any_grad = any(t.requires_grad for t in o.inputs) or any(p.requires_grad for p in o.params)
    bwd = fwd * (2 if kind == "norm" else 1) if any_grad else 0
    if kind == "embedding":
        out = o.output[0]
        bwd = out.numel if any_grad else 0  # scatter-add of the output gradient
    return fwd, bwd, 0, 0


def _unknown(o: _Operands):
    n = sum((t.numel for t in o.output), 0)
    any_grad = any(t.requires_grad for t in o.inputs)
    return n, (n if any_grad else 0), 0, 0


def _weight_backward(o: _Operands, fwd_mm: Any, bwd: Any) -> tuple[Any, Any]:
    """(weight-gradient FLOPs, of which matmul-class) of the node's backward `bwd`: the
    products whose operand is a weight (module docstring); never more than `bwd`."""
    kind = o.kind
    if kind in ("linear", "conv", "conv_transpose"):
        if o.op == "addmm":
            bias, w = o.inputs[0], o.inputs[2]
        elif o.params:
            w, bias = o.params[0], (o.params[1] if len(o.params) > 1 else None)
        else:
            w = o.inputs[1] if len(o.inputs) > 1 else None
            bias = o.inputs[2] if len(o.inputs) > 2 else None
        mm = fwd_mm if o.is_weight(w) and w.requires_grad else 0
        extra = o.output[0].numel if o.is_weight(bias) and bias.requires_grad else 0
        return mm + extra, mm
    if kind == "matmul" and o.op in _GROUPED_MM:
        w = o.inputs[1]
        mm = fwd_mm if o.is_weight(w) and w.requires_grad else 0
        return mm, mm
    if kind == "matmul" and o.op == "einsum":
        n = sum(1 for t in o.inputs if o.is_weight(t) and t.requires_grad)
        return fwd_mm * n, fwd_mm * n
    if kind == "matmul":
        a, b = o.inputs[-2], o.inputs[-1]
        if len(a.shape) == 1 or len(b.shape) == 1:  # the matrix's gradient is an outer product
            mat, vec = (b, a) if len(a.shape) == 1 else (a, b)
            mm = fwd_mm if o.is_weight(vec) and vec.requires_grad else 0
            return mm + (mat.numel if o.is_weight(mat) and mat.requires_grad else 0), mm
        n = sum(1 for t in (a, b) if o.is_weight(t) and t.requires_grad)
        return fwd_mm * n, fwd_mm * n
    if kind == "rnn" and o.module is not None:  # the gate-weight products of every layer
        x = o.inputs[0]
        gates = {"lstm": 4, "gru": 3}.get(o.op, 1)
        hidden, dirs, layers, batch_first, input_size = _rnn_config(o)
        batch, steps = (x.shape[0], x.shape[1]) if batch_first else (x.shape[1], x.shape[0])
        w = 0
        for layer in range(layers):
            in_size = input_size if layer == 0 else hidden * dirs
            w = w + dirs * 2 * batch * steps * gates * hidden * (in_size + hidden)
        return w, w
    if kind == "mha" and o.module is not None:  # the four projections' weight gradients
        q, k = o.inputs[0], o.inputs[1]
        e = o.module.embed_dim
        b, length, s = ((q.shape[0], q.shape[1], k.shape[1]) if o.module.batch_first
                        else (q.shape[1], q.shape[0], k.shape[0]))
        proj = 2 * b * e * e * (length + 2 * s) + 2 * b * length * e * e
        return proj, proj
    if kind == "embedding":
        return (bwd, 0) if any(o.is_weight(t) for t in o.params + o.inputs) else (0, 0)
    if kind == "norm" and any(p.requires_grad for p in o.params):
        return 3 * sum((t.numel for t in o.output), 0), 0
    return 0, 0


_RULES: dict[str, Callable[[_Operands], tuple]] = {
    "linear": _linear, "matmul": _matmul, "conv": _conv, "conv_transpose": _conv,
    "attention": _attention, "rnn": _rnn, "mha": _mha,
}


def _operands(node: fx.Node, gm: fx.GraphModule, data: set[fx.Node] | None = None) -> _Operands:
    inputs = [t for a in node.all_input_nodes for t in tensors_in(a.meta.get(META_VALUE))]
    # keep argument order (all_input_nodes dedups; positional order matters for matmul)
    ordered = []
    weights: set[int] = set()
    for a in list(node.args) + list(node.kwargs.values()):
        for leaf in _flatten(a):
            if isinstance(leaf, fx.Node):
                got = list(tensors_in(leaf.meta.get(META_VALUE)))
                ordered.extend(got)
                if leaf.op == "get_attr" or (data is not None and leaf not in data):
                    weights.update(id(t) for t in got)
    inputs = ordered or inputs
    module = gm.get_submodule(node.target) if node.op == "call_module" else None
    params = [info for _, info in node.meta.get(META_PARAMS, [])] if module is not None else []
    if module is not None and not params:  # shared module already counted: shapes still matter
        params = [TensorInfo(tuple(p.shape), p.dtype, p.requires_grad)
                  for p in module.parameters(recurse=False)]
    output = list(tensors_in(node.meta.get(META_VALUE)))
    return _Operands(node.meta[META_OP], node.meta[META_KIND], inputs, params, output, module, node,
                     frozenset(weights))


def _flatten(a: Any):
    if isinstance(a, (list, tuple)):
        for x in a:
            yield from _flatten(x)
    elif isinstance(a, dict):
        for x in a.values():
            yield from _flatten(x)
    else:
        yield a


def _attention_memory(o: _Operands, stash: Any, bwd: Any, bwd_mm: Any, flash: bool) -> tuple[Any, Any, Any]:
    """(stash, backward FLOPs, backward matmul FLOPs) of a fused attention node (PAPERS-SPEC.md 2.6).

    Math path (default): besides its output, autograd keeps the softmax probabilities, one
    element per score, and with dropout its mask and output, 1.5 more (*Reducing Activation
    Recomputation in Large Transformer Models*, Korthikanti et al. 2022, section 4.1: 2as²b
    bytes of softmax output, as²b of mask and 2as²b of dropout output in fp16, the 5as/h term).
    Flash attention (Dao et al. 2022, *FlashAttention*, section 3.1) keeps only the output and
    the fp32 log-sum-exp per query row, and its backward recomputes QKᵀ and the softmax:
    one more QKᵀ product (matmul class) and 5 FLOPs per score."""
    if stash == 0:  # no gradient flows through it: nothing is kept either way
        return stash, bwd, bwd_mm
    q, k = o.inputs[0], o.inputs[1]
    length, e, s = q.shape[-2], q.shape[-1], k.shape[-2]
    rows = q.numel / e if not isinstance(q.numel, int) else q.numel // e  # batch x heads x length
    scores = rows * s
    if flash:
        qk = 2 * scores * e
        return stash + rows * 4, bwd + qk + 5 * scores, bwd_mm + qk
    dropout = o.node.kwargs.get("dropout_p", o.node.args[4] if len(o.node.args) > 4 else 0.0)
    per_score = 1.0 + (1.5 if isinstance(dropout, (int, float)) and dropout > 0 else 0.0)
    return stash + scores * q.itemsize * per_score, bwd, bwd_mm


def node_cost(node: fx.Node, gm: fx.GraphModule,
              data: set[fx.Node] | None = None, flash_attention: bool = False,
              low: set[fx.Node] | None = None, autocast_device: str = "cuda") -> tuple[NodeCost, bool]:
    """Cost of one node; the flag says whether the op was unknown to the table. `data`: the
    nodes computed from a graph input (`annotate` passes them); an operand outside it is a
    weight for the backward split (without it, only `get_attr` operands are).
    `flash_attention`: fused attention keeps no scores and recomputes them in backward
    (`_attention_memory`). `low`: under mixed precision, the nodes autocast computes in the low
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
    o = _operands(node, gm, data)
    unknown = kind == "unknown"
    try:
        if kind in _RULES:
            fwd, bwd, fwd_mm, bwd_mm = _RULES[kind](o)
        elif unknown:
            fwd, bwd, fwd_mm, bwd_mm = _unknown(o)
        else:
            fwd, bwd, fwd_mm, bwd_mm = _elementwise(o)
    except (IndexError, AttributeError, TypeError, ZeroDivisionError):
        fwd, bwd, fwd_mm, bwd_mm = _unknown(o)
        unknown = True
    try:
        bwd_w, bwd_w_mm = (0, 0) if unknown else _weight_backward(o, fwd_mm, bwd)
    except (IndexError, AttributeError, TypeError, ZeroDivisionError):
        bwd_w, bwd_w_mm = 0, 0  # NOTE: a shape the split cannot read: all input work
    is_view = is_view_node(node)
    in_bytes = sum((t.nbytes for t in o.inputs), 0) if low is None else \
        sum((mixed.held_bytes(a, low) for a in node.all_input_nodes), 0)
    moved = 0 if is_view else in_bytes + held + param_bytes
    stash = 0 if is_view or not any(t.requires_grad for t in tensors_in(value)) else held
    scores = None
    if kind == "attention" and not unknown:
        stash, bwd, bwd_mm = _attention_memory(o, stash, bwd, bwd_mm, flash_attention)
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
    attention nodes keep their scores (`_attention_memory`); the mode is kept in the graph so
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
