"""The per-op formulas of the cost model: for one node, its FLOPs forward and backward (and of
them the matmul class), the weight-gradient part of its backward, and a fused attention node's
stash. Each rule reads the node's `Operands` (its tensors' shapes, dtypes and which take a
gradient) and returns sympy expressions or numbers; `pipecc.cost.node_cost` adds the bytes and
writes the annotation. The conventions the formulas follow are `pipecc.cost`'s docstring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch.fx as fx

from pipecc.cost_saved import flatten_args
from pipecc.ir.graph import META_KIND, META_OP, META_PARAMS, META_VALUE, Dim, TensorInfo, tensors_in

# FLOPs per output element of non-matmul work (forward). Sources: the usual counting
# conventions of fvcore/ptflops (1 per elementwise op; norms ~5: mean, var, normalise, scale,
# shift; softmax ~5: max, sub, exp, sum, div; GELU's tanh approximation ~8).
_PER_ELEMENT = {"norm": 5, "softmax": 5, "activation": 1, "elementwise": 1, "reduction": 1,
                "pool": 1, "loss": 5, "embedding": 0, "shape": 0, "param": 0, "input": 0}
_ACTIVATION_COST = {"gelu": 8, "silu": 4, "sigmoid": 4, "tanh": 4, "mish": 6, "softplus": 4,
                    "elu": 3, "hardswish": 3, "hardsigmoid": 2, "erf": 4}


@dataclass
class Operands:
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
def _linear(o: Operands):
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


def _einsum_flops(o: Operands) -> Dim:
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


def _matmul(o: Operands):
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


def _conv(o: Operands):
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


def _attention(o: Operands):
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


def _rnn(o: Operands):
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


def _rnn_config(o: Operands) -> tuple:
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


def _mha(o: Operands):
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


def _elementwise(o: Operands):
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


def _unknown(o: Operands):
    n = sum((t.numel for t in o.output), 0)
    any_grad = any(t.requires_grad for t in o.inputs)
    return n, (n if any_grad else 0), 0, 0


def weight_backward(o: Operands, fwd_mm: Any, bwd: Any) -> tuple[Any, Any]:
    """(weight-gradient FLOPs, of which matmul-class) of the node's backward `bwd`: the
    products whose operand is a weight (`pipecc.cost`'s docstring); never more than `bwd`."""
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


_RULES: dict[str, Callable[[Operands], tuple]] = {
    "linear": _linear, "matmul": _matmul, "conv": _conv, "conv_transpose": _conv,
    "attention": _attention, "rnn": _rnn, "mha": _mha,
}


def flops(o: Operands) -> tuple[Any, Any, Any, Any, bool]:
    """(forward, backward, forward matmul, backward matmul) FLOPs of the node, and whether its op
    is unknown to the table (no rule, or a shape its rule cannot read: `_unknown`'s guess)."""
    unknown = o.kind == "unknown"
    try:
        if o.kind in _RULES:
            fwd, bwd, fwd_mm, bwd_mm = _RULES[o.kind](o)
        elif unknown:
            fwd, bwd, fwd_mm, bwd_mm = _unknown(o)
        else:
            fwd, bwd, fwd_mm, bwd_mm = _elementwise(o)
    except (IndexError, AttributeError, TypeError, ZeroDivisionError):
        fwd, bwd, fwd_mm, bwd_mm = _unknown(o)
        unknown = True
    return fwd, bwd, fwd_mm, bwd_mm, unknown


def operands(node: fx.Node, gm: fx.GraphModule, data: set[fx.Node] | None = None) -> Operands:
    inputs = [t for a in node.all_input_nodes for t in tensors_in(a.meta.get(META_VALUE))]
    # keep argument order (all_input_nodes dedups; positional order matters for matmul)
    ordered = []
    weights: set[int] = set()
    for a in list(node.args) + list(node.kwargs.values()):
        for leaf in flatten_args(a):
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
    return Operands(node.meta[META_OP], node.meta[META_KIND], inputs, params, output, module, node,
                     frozenset(weights))


def attention_memory(o: Operands, stash: Any, bwd: Any, bwd_mm: Any, flash: bool) -> tuple[Any, Any, Any]:
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
