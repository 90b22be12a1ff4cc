"""What autograd saves for a node's backward: the stash rules of the cost model.

A node's `stash_bytes` is what one micro-batch makes it hold from its forward to its backward.
Autograd does not keep every output: each op's backward formula names the tensors it needs
(torch's `tools/autograd/derivatives.yaml`), and a tensor several backwards need is one storage.
So the stash is counted per storage, in two steps:

  * per node, a rule (`saves`): whether its backward keeps its own output, which of its operands
    it keeps, and the buffers of its own it keeps (`extra`: a LayerNorm's mean and rstd, a max
    pool's indices, a dropout mask, a matmul's contiguous copy of a strided operand);
  * per graph (`apply`): every kept tensor is traced through views and in-place ops to the node
    whose storage it is (`root`), and that node is charged its output once, however many
    backwards keep it; a node nobody keeps is charged only its `extra`.

The rules, from derivatives.yaml (checked against `torch.autograd.graph.saved_tensors_hooks` on
the zoo and holdout-style models, tests/test_cost_saved.py):

  * linear, conv, conv-transpose, addmm: the input when the weight takes a gradient (and a
    computed weight when the input does); the parameters are not activations;
  * matmul class: each operand when the other takes a gradient; a batched operand whose layout
    is not contiguous (after a permute or a slice, `_layout`) is kept as the contiguous copy
    matmul makes of it (its bytes, `extra`), not as its base;
  * relu, sigmoid, tanh, exp, sqrt, rsqrt, reciprocal, softmax, log-softmax: their output;
    gelu, silu, the other activations, log, pow by a number, abs, clamp: their input;
    mul: each operand when the other takes a gradient; div: the divisor (and the dividend when
    the divisor takes a gradient); add, sub, neg, casts, copies, cat, sums, means: nothing;
    where and masked_fill: their mask; gather/index-select/index: the indices;
  * layer/group norm: input plus mean and rstd (float32, one per normalised row); batch norm:
    input plus the batch mean and inverse std (float32, one per channel);
  * max pooling: input plus its int64 indices; average pooling: input; adaptive average pooling
    to 1x1 (a mean): nothing; embedding: the indices;
  * dropout with p > 0: its mask, in the input's dtype (the CPU's x * noise; CUDA's fused kernel
    keeps 1 byte an element: the larger is charged); its output is a new storage, kept if a
    consumer keeps it;
  * fused attention: q, k, v and its output, plus the scores (math path) or the log-sum-exp
    (flash attention), `pipecc.cost_formulas.attention_memory`;
  * views (`pipecc.ir.ops.VIEW_OPS`, shape ops that copy nothing) and in-place ops: nothing of
    their own; they alias their input's storage;
  * recurrent layers: their gates and states per step, as measured on torch's CPU kernels
    (`_RNN_KEPT`), plus the conservative charge below;
  * anything else (unknown ops, nn.MultiheadAttention, losses inside the
    model, a library call kept as one node) keeps the conservative charge: its output and every
    operand computed from the inputs, plus what a measured library call saves inside it.

Where the received input or the stage's outputs are held by the runtime rather than autograd
(a stage keeps its input leaves and its outputs until its backward), the planner counts them
itself (`passes.partition`'s X[a]; docs/memory.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch.fx as fx

from pipecc.ir.graph import META_KIND, META_OP, META_VALUE, Dim, TensorInfo, tensors_in
from pipecc.ir.ops import VIEW_OPS

META_SAVES = "pipecc.saves"  # node.meta key: its Saves (written by pipecc.cost.node_cost)
META_KEPT = "pipecc.kept"    # node.meta key: True when a backward keeps its output's storage (`apply`)

F32, I64 = 4, 8  # bytes of a norm statistic (float32) and of an index (int64)

_OUTPUT = frozenset("relu relu_ sigmoid tanh exp sqrt rsqrt reciprocal softmax _softmax log_softmax "
                    "_log_softmax logsoftmax".split())
_INPUT = frozenset("gelu silu elu leaky_relu leakyrelu hardtanh relu6 hardswish hardsigmoid mish "
                   "softplus selu celu glu erf log abs sin cos clip clamp".split())
_NOTHING = frozenset("add sub neg rsub iadd isub sum mean reducesum reducemean cumsum tril triu trilu "
                     "type_as to float half bfloat16 double long int bool onnx_cast castlike clone "
                     "contiguous copy alias detach cat concat stack repeat tile pad constant_pad_nd roll "
                     "flip slice_scatter zeros_like ones_like full_like rand_like randn_like new_zeros "
                     "new_ones fill_ eq ne lt le gt ge and_ or_ not_ invert logical_not bitwise_not sign "
                     "floor ceil round isnan argmax argmin all any count_nonzero floordiv expand "
                     "expand_as arange zeros ones full empty new_empty new_full".split())
_MASKS = {"where": 0, "masked_fill": 1, "masked_select": 1}           # op -> operand kept
_INDICES = {"index_select": 2, "gather": 2, "scatter": 2, "take_along_dim": 1, "index": 1,
            "embedding": 0, "gather_rows": 0}
_MAX_POOLS = frozenset("max_pool1d max_pool2d max_pool3d adaptive_max_pool2d max_pool2d_with_indices "
                       "maxpool globalmaxpool".split())
_AVG_POOLS = frozenset("avg_pool1d avg_pool2d avg_pool3d averagepool".split())
_ROW_NORMS = frozenset("layer_norm native_layer_norm layernormalization".split())
_BATCH_NORMS = frozenset("batch_norm batchnormalization".split())
_GROUP_NORMS = frozenset("group_norm groupnormalization".split())
# shape ops that copy their bytes (the others are views: no FLOPs, no bytes of their own)
BYTES_ONLY_SHAPE_OPS = frozenset({"cat", "concat", "stack", "repeat", "tile", "contiguous",
                                  "pad", "constant_pad_nd", "roll", "flip", "index_select",
                                  "gather", "index", "scatter", "index_put", "masked_select",
                                  "take_along_dim"})
_CREATIONS = frozenset("arange zeros ones full empty new_empty new_full tensor scalar_tensor lift_fresh_copy "
                       "onnx_constant zeros_like ones_like full_like rand_like randn_like new_zeros new_ones".split())
_TRANSPOSES = frozenset("transpose t permute".split())
_RESHAPES = frozenset("view reshape flatten unflatten squeeze unsqueeze _unsafe_view unsafe_view "
                      "contiguous_view identity detach alias".split())


@dataclass(frozen=True)
class Saves:
    """A node's rule: its output kept (`own`), operands kept (`keeps`: the fx nodes, traced to
    their storage by `apply`), `extra` bytes of its own buffers (sympy or int), and `held`, the
    bytes its output holds when kept (`pipecc.cost_precision.held_bytes` under autocast)."""

    own: bool
    keeps: tuple[fx.Node, ...]
    extra: Any
    held: Any


def operands(node: fx.Node) -> list[tuple[fx.Node, TensorInfo]]:
    """The node's tensor operands in argument order, each with the fx node producing it."""
    out = []
    for a in flatten_args(list(node.args) + list(node.kwargs.values())):
        if isinstance(a, fx.Node):
            out.extend((a, t) for t in tensors_in(a.meta.get(META_VALUE)))
    return out


def flatten_args(a: Any) -> Iterator[Any]:
    """The leaves of a node's (nested list, tuple or dict) arguments."""
    if isinstance(a, (list, tuple)):
        for x in a:
            yield from flatten_args(x)
    elif isinstance(a, dict):
        for x in a.values():
            yield from flatten_args(x)
    else:
        yield a


def _arg(node: fx.Node, i: int, name: str, default: Any = None) -> Any:
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[i] if len(node.args) > i else default


def _grad(t: TensorInfo | None) -> bool:
    return t is not None and t.requires_grad


def _numel(value: Any) -> Dim:
    total: Dim = 0
    for t in tensors_in(value):
        total = total + t.numel
    return total


def dropout_p(node: fx.Node, module: Any) -> float:
    """A dropout node's drop probability when it drops in training (0.0: a no-op, a view)."""
    if module is not None:
        return float(getattr(module, "p", 0.0)) if getattr(module, "training", True) else 0.0
    if node.op == "call_method":
        return 0.0
    p, training = _arg(node, 1, "p", 0.5), _arg(node, 2, "training", True)
    return float(p) if isinstance(p, (int, float)) and training is True else 0.0


def is_view_node(node: fx.Node) -> bool:
    """A view or reshape: no FLOPs, no bytes of its own (`pipecc.cost`'s docstring)."""
    op, kind = node.meta.get(META_OP, ""), node.meta.get(META_KIND, "")
    return op in VIEW_OPS or (kind == "shape" and op not in BYTES_ONLY_SHAPE_OPS)


def aliases(node: fx.Node, module: Any) -> bool:
    """True when the node's output is a view of (or the same storage as) its first operand."""
    op = node.meta.get(META_OP, "")
    if op == "dropout":
        return dropout_p(node, module) == 0.0
    if op in _CREATIONS or not operands(node):
        return False
    if is_view_node(node):
        return True
    inplace = op.endswith("_") or op in ("iadd", "isub", "imul") or node.kwargs.get("inplace") is True \
        or bool(getattr(module, "inplace", False))
    return inplace and bool(operands(node))


def saves(node: fx.Node, module: Any, params: list[TensorInfo], weights: set[fx.Node], held: Any,
          attention_extra: Any = None) -> Saves:
    """The node's rule (module docstring). `weights`: operand nodes computed from parameters
    alone (not activations); `attention_extra`: a fused attention node's scores or log-sum-exp
    bytes (`pipecc.cost_formulas.attention_memory`); `held`: its output's bytes when kept."""
    op, kind = node.meta.get(META_OP, ""), node.meta.get(META_KIND, "unknown")
    value = node.meta.get(META_VALUE)
    ops = operands(node)
    none = Saves(False, (), 0, held)
    if not any(t.requires_grad for t in tensors_in(value)):
        return none  # no backward runs through it: nothing is kept
    acts = [(n, t) for n, t in ops if n not in weights]

    def keep(*idx: int, own: bool = False, extra: Any = 0) -> Saves:
        return Saves(own, tuple(ops[i][0] for i in idx if i < len(ops) and ops[i][0] not in weights),
                     extra, held)

    if op == "dropout":
        p = dropout_p(node, module)
        # NOTE: torch's fused kernel (CUDA) keeps a 1-byte mask; elsewhere dropout is x * noise and
        # keeps the noise in x's dtype (aten/src/ATen/native/Dropout.cpp): the larger is charged
        noise = sum((t.nbytes for t in tensors_in(value)), 0)
        return Saves(False, (), noise if p > 0 else 0, held)
    if aliases(node, module):
        return Saves(op in _OUTPUT, (), 0, held)  # an in-place relu keeps its (aliased) output
    if kind in ("linear", "conv", "conv_transpose"):
        at = (1, 2) if op == "addmm" else (0, 1)
        if len(ops) <= at[0] or not params and len(ops) <= at[1]:
            return _conservative(acts, held)
        x_node, x = ops[at[0]]
        w_node, w = (None, params[0]) if params and op != "addmm" else ops[at[1]]
        kept = ([x_node] if w.requires_grad and x_node not in weights else []) + \
            ([w_node] if w_node is not None and w_node not in weights and x.requires_grad else [])
        return Saves(False, tuple(kept), 0, held)
    if kind == "matmul" and op in ("matmul", "mm", "bmm", "baddbmm"):
        return _matmul(ops[-2:], weights, held)
    if kind == "attention" and attention_extra is not None:
        return Saves(True, tuple(n for n, _ in acts), attention_extra, held)
    if kind == "rnn" and module is not None and ops:
        return _rnn(module, op, ops[0][1], acts, held)
    if kind == "embedding":
        return keep(_INDICES[op]) if op in _INDICES else _conservative(acts, held)
    if kind == "norm":
        return _norm(node, op, ops, acts, module, held)
    if kind == "pool":
        return _pool(op, ops, acts, value, held)
    if op in _OUTPUT:
        return Saves(True, (), 0, held)
    if op in _INPUT or (op == "pow" and len(ops) == 1):
        return keep(0)
    if op in _NOTHING:
        return none
    if op in ("mul", "imul", "scaled_mul") and len(ops) <= 2:
        return Saves(False, tuple(n for (n, _), (_, other) in zip(ops, reversed(ops))
                                  if len(ops) == 2 and n not in weights and other.requires_grad), 0, held)
    if op in ("truediv", "div") and len(ops) == 2:
        (a, ta), (b, tb) = ops
        kept = ([b] if ta.requires_grad else []) + ([a, b] if tb.requires_grad else [])
        return Saves(False, tuple(dict.fromkeys(n for n in kept if n not in weights)), 0, held)
    if op in ("truediv", "div") and len(ops) == 1 and node.args and node.args[0] is ops[0][0]:
        return none  # divided by a number
    if op in _MASKS:
        return keep(_MASKS[op])
    if op in _INDICES:
        return keep(_INDICES[op])
    return _conservative(acts, held)


def _conservative(acts: list[tuple[fx.Node, TensorInfo]], held: Any) -> Saves:
    """An op without a rule: its output and every activation operand."""
    return Saves(True, tuple(dict.fromkeys(n for n, _ in acts)), 0, held)


def _matmul(pair: list[tuple[fx.Node, TensorInfo]], weights: set[fx.Node], held: Any) -> Saves:
    """Each operand when the other takes a gradient; a batched operand whose layout matmul must
    copy (`_layout` "x", or any but contiguous when folded against a matrix) as that copy."""
    if len(pair) != 2:
        return Saves(True, tuple(n for n, _ in pair if n not in weights), 0, held)
    (a, ta), (b, tb) = pair
    kept: list[fx.Node] = []
    extra: Any = 0
    batched = len(ta.shape) > 2 or len(tb.shape) > 2
    for (n, t), other in (((a, ta), tb), ((b, tb), ta)):
        if not other.requires_grad or n in weights:
            continue
        layout = _layout(n)
        folded = len(ta.shape) > 2 and len(tb.shape) <= 2 and n is a  # reshaped to a matrix
        if batched and len(t.shape) > 1 and (layout == "x" or folded and layout != "c"):
            extra = extra + t.nbytes
        else:
            kept.append(n)
    return Saves(False, tuple(kept), extra, held)


def _layout(node: fx.Node, depth: int = 0) -> str:
    """"c": contiguous; "t": contiguous with its last two dims swapped; "x": another stride
    pattern (a permute, a slice, an expand). Read from the view ops that made it."""
    op = node.meta.get(META_OP, "")
    src = next((a for a, _ in operands(node)), None) if node.op != "call_module" or node.args else None
    if src is None or depth > 64:
        return "c"
    value = node.meta.get(META_VALUE)
    nd = len(value.shape) if isinstance(value, TensorInfo) else 0
    if op in _TRANSPOSES:
        dims = [d for d in node.args[1:] if isinstance(d, int)] if op != "t" else [nd - 2, nd - 1]
        if op == "permute":
            perm = list(node.args[1]) if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) \
                else dims
            swapped = list(range(nd - 2)) + [nd - 1, nd - 2]
            if [p % nd for p in perm] == list(range(nd)):
                return _layout(src, depth + 1)
            if [p % nd for p in perm] != swapped:
                return "x"
        elif len(dims) == 2 and sorted(d % nd for d in dims) != [nd - 2, nd - 1]:
            return "x"
        inner = _layout(src, depth + 1)
        return {"c": "t", "t": "c"}.get(inner, "x")
    if op in _RESHAPES:
        inner = _layout(src, depth + 1)
        return "c" if inner == "c" or op == "reshape" else "x"  # a reshape of a strided tensor copies
    if op in ("getitem", "split", "chunk", "narrow", "select", "slice", "unbind", "split_with_sizes",
              "expand", "expand_as", "movedim"):
        if op == "getitem" and not isinstance(src.meta.get(META_VALUE), TensorInfo):
            return _layout(src, depth + 1)  # an element of a tuple (a split's piece)
        return "x"
    return "c"


# bytes autograd keeps per layer, direction, step and hidden unit, in elements of the input's dtype:
# measured with saved_tensors_hooks on torch 2.14's CPU kernels (nn.LSTM 16-17.75, nn.GRU 7,
# nn.RNN 1-1.06 over sequence, batch, input and hidden sizes; gates, cell states and workspace)
_RNN_KEPT = {"lstm": 18, "gru": 7, "rnn_tanh": 2, "rnn_relu": 2}


def _rnn(module: Any, op: str, x: TensorInfo, acts: list, held: Any) -> Saves:
    """A recurrent layer: its gates and states per step (`_RNN_KEPT`, rounded up), plus the
    conservative charge of its output and operands."""
    base = _conservative(acts, held)
    steps_batch = x.numel / x.shape[-1] if not isinstance(x.numel, int) else x.numel // x.shape[-1]
    dirs = 2 if getattr(module, "bidirectional", False) else 1
    per = _RNN_KEPT.get(op, 18) * module.hidden_size * dirs * module.num_layers * x.itemsize
    return Saves(base.own, base.keeps, steps_batch * per, held)


def _norm(node: fx.Node, op: str, ops: list, acts: list, module: Any, held: Any) -> Saves:
    x = ops[0][1] if ops else None
    if x is None or ops[0] not in acts:
        return _conservative(acts, held)
    if op in _ROW_NORMS:
        shape = getattr(module, "normalized_shape", None) if module is not None else _arg(node, 1, "normalized_shape")
        width = 1
        for d in (shape if isinstance(shape, (list, tuple)) else [x.shape[-1]]):
            width = width * d
        rows = x.numel / width if not isinstance(x.numel, int) or not isinstance(width, int) else x.numel // width
        return Saves(False, (ops[0][0],), 2 * rows * F32, held)
    if op in _BATCH_NORMS and len(x.shape) >= 2:
        return Saves(False, (ops[0][0],), 2 * x.shape[1] * F32, held)
    if op in _GROUP_NORMS and len(x.shape) >= 2:
        groups = getattr(module, "num_groups", None) if module is not None else _arg(node, 1, "num_groups")
        if isinstance(groups, int):
            return Saves(False, (ops[0][0],), 2 * x.shape[0] * groups * F32, held)
    return _conservative(acts, held)


def _pool(op: str, ops: list, acts: list, value: Any, held: Any) -> Saves:
    if not ops or ops[0] not in acts:
        return _conservative(acts, held)
    if op in _MAX_POOLS:
        return Saves(False, (ops[0][0],), _numel(value) * I64, held)
    if op in _AVG_POOLS:
        return Saves(False, (ops[0][0],), 0, held)
    if op.startswith("adaptive_avg_pool") or op == "globalaveragepool":
        out = value if isinstance(value, TensorInfo) else None
        if op == "globalaveragepool" or out is not None and all(d == 1 for d in out.shape[2:]):
            return Saves(False, (), 0, held)  # to 1x1: a mean, whose backward keeps nothing
        return Saves(False, (ops[0][0],), 0, held)
    return _conservative(acts, held)


def alias_map(gm: fx.GraphModule) -> dict[fx.Node, bool]:
    """`aliases` for every computing node of the graph module (what `root` and `kept_roots` read)."""
    return {n: aliases(n, gm.get_submodule(n.target) if n.op == "call_module" else None)
            for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")}


def root(node: fx.Node, alias: dict[fx.Node, bool]) -> fx.Node:
    """The node whose storage `node`'s output is (through views and in-place ops)."""
    seen = 0
    while alias.get(node) and seen < 10_000:
        src = next((a for a, _ in operands(node)), None)
        if src is None:
            break
        node, seen = src, seen + 1
    return node


def kept_roots(nodes: list[fx.Node], alias: dict[fx.Node, bool]) -> set[fx.Node]:
    """The nodes whose output storage some backward keeps (module docstring, `apply`)."""
    kept: set[fx.Node] = set()
    for node in nodes:
        rule: Saves | None = node.meta.get(META_SAVES)
        if rule is None:
            continue
        if rule.own:
            kept.add(root(node, alias))
        for n in rule.keeps:
            kept.add(root(n, alias))
    return kept


__all__ = ["BYTES_ONLY_SHAPE_OPS", "META_KEPT", "META_SAVES", "Saves", "alias_map", "aliases", "flatten_args",
           "dropout_p", "is_view_node", "kept_roots", "operands", "root", "saves"]
