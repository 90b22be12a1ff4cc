"""Which nodes are splittable layers, in every form the frontends produce. Analysis only:
nothing here changes the graph. `recognise(graph, node)` returns a `Layer`, what
`split_layers.split_node` needs, or the reason the node cannot be split:

  fx     a call of an nn.Linear, nn.Conv2d (groups 1) or nn.Embedding module that owns its
         parameters;
  calls  (torch.export, fx functional code) linear, addmm, mm / matmul / `x @ w` whose right
         operand is a parameter or its 2-D transpose, conv2d and convolution (2-D, groups 1,
         not transposed), aten.embedding / F.embedding;
  ONNX   Gemm (transA=0, alpha=beta=1), MatMul over a parameter, Conv (2-D, group 1, the same
         pads at both ends, auto_pad NOTSET); a Gather declines (ONNX wraps negative ids).
A call's weight and bias must be parameters read by get_attr nodes that nothing else reads
(through transposes that only it reads) and registered under one name: a tied or reused
weight declines. (A module reading the same parameter is not looked for; the fx rule does not
look for get_attr readers of a module's parameters either.)

Which shards a call gets: a weight stored [out, in] (linear's, Gemm transB=1's, the transposed
right operand of mm / addmm / MatMul) and every conv or embedding weight gets a proxy parent:
an nn.Linear / nn.Conv2d / nn.Embedding made on the meta device, then given the very
Parameters the get_attr nodes read, which module shards slice exactly as they slice an fx
module. A weight stored [in, out] (x @ W over a raw parameter; optimised ONNX exports fold the
transpose into the initializer) cannot be sliced into a Linear's [out, in] weight: it gets no
parent, and `split_node` makes call shards.
"""
from __future__ import annotations

import collections
import contextlib
import inspect
import operator
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from pipecc.ir.graph import META_NAME, META_OP, META_PARAMS, META_VALUE, AnnotatedGraph, TensorInfo


@dataclass
class Layer:
    """What `split_node` needs to know about a node that computes one splittable layer."""

    kind: str                                   # "linear", "conv2d" or "embedding"
    x: fx.Node                                  # its input activation (ids for an embedding)
    extents: dict[int, tuple[int, str]]         # split dim -> (its length, what it is called)
    label: str                                  # messages and shards name it: 'fc', 'fc.linear'
    describe: str                               # "Linear 'fc'", "linear call 'fc.linear'"
    params: list[tuple[str, str, TensorInfo]] = field(default_factory=list)  # (role, name, info)
    parent: Callable[[], nn.Module] | None = None  # module shards slice it; None: call shards
    attr: str = ""                              # module shards: base of their attribute names
    dead: set[fx.Node] = field(default_factory=set)  # only the node reads them: erase after
    weight: fx.Node | None = None               # call shards: get_attr of the [in, out] weight
    bias: fx.Node | None = None                 # call shards: get_attr of the bias, if any

    def dims(self) -> tuple[int, ...]:
        """The dims it may be split along (length >= 2 only)."""
        return tuple(d for d, (n, _) in sorted(self.extents.items()) if n >= 2)


_ONLY = ("only calls of nn.Linear, nn.Conv2d and nn.Embedding modules, and linear, addmm, mm, "
         "matmul, Gemm, conv2d, convolution and embedding calls on parameters split")
_WHOLE_TABLE = "max_norm, scale_grad_by_freq and sparse embeddings depend on the whole table"
_NOT_TENSORS = "its input or output is not a single annotated tensor"


def recognise(graph: AnnotatedGraph, node: fx.Node) -> Layer | str:
    """The layer `node` computes, or why it cannot be split at all."""
    if node.op == "call_module":
        return _module_layer(graph, node)
    if node.op == "call_function":
        return _call_layer(graph, node)
    return f"it is a {node.op} node ({node.meta.get(META_OP)}); {_ONLY}"


def splittable(graph: AnnotatedGraph, node: fx.Node) -> tuple[int, ...]:
    """The dims `node` may be split along (length >= 2 only); () when it cannot be split."""
    layer = recognise(graph, node)
    return () if isinstance(layer, str) else layer.dims()


def extent(graph: AnnotatedGraph, node: fx.Node, dim: int = 0) -> int:
    """Length of `node`'s split dimension `dim` (out_features, in_features, out_channels, rows)."""
    layer = recognise(graph, node)
    if isinstance(layer, str) or dim not in layer.extents:
        raise ValueError(f"{node.meta.get(META_NAME)!r} has no split dimension {dim}")
    return layer.extents[dim][0]


def _module_layer(graph: AnnotatedGraph, node: fx.Node) -> Layer | str:
    module = graph.gm.get_submodule(str(node.target))
    kind = next((k for k, cls in (("linear", nn.Linear), ("conv2d", nn.Conv2d),
                                  ("embedding", nn.Embedding)) if isinstance(module, cls)), None)
    if kind is None:
        return f"it calls a {type(module).__name__}; only nn.Linear, nn.Conv2d and nn.Embedding split"
    if isinstance(module, nn.Conv2d) and module.groups != 1:
        return f"it is a grouped convolution (groups={module.groups})"
    if isinstance(module, nn.Embedding) and (module.max_norm is not None
                                             or module.scale_grad_by_freq or module.sparse):
        return _WHOLE_TABLE
    if len(node.meta.get(META_PARAMS, [])) != len(list(module.parameters())):
        return "it shares its parameters with another node (a reused or tied module) that owns them"
    if len(node.args) != 1 or node.kwargs or not _tensors(node, node.args[0]):
        return _NOT_TENSORS
    target = str(node.target)
    params = [("bias" if q.endswith(".bias") else "weight", q, info)
              for q, info in node.meta[META_PARAMS]]
    return Layer(kind, node.args[0], _extents(kind, module.weight.shape), target,
                 f"{type(module).__name__} {target!r}", params, lambda: module,
                 target.replace(".", "_"))


def _extents(kind: str, weight: Sequence[int]) -> dict[int, tuple[int, str]]:
    """Split dims of a layer whose weight is [out, in, ...] (an embedding's: [rows, width])."""
    if kind == "linear":
        return {0: (int(weight[0]), "out_features"), 1: (int(weight[1]), "in_features")}
    return {0: (int(weight[0]), "out_channels" if kind == "conv2d" else "num_embeddings")}


def _tensors(node: fx.Node, x: Any) -> bool:
    return isinstance(x, fx.Node) and isinstance(x.meta.get(META_VALUE), TensorInfo) \
        and isinstance(node.meta.get(META_VALUE), TensorInfo)


# ---- calls: torch.export's aten ops, fx functional calls, ONNX operators
# positional parameters of the Python functions fx records, and their defaults
_PYTHON_CALLS: dict[Any, tuple[tuple[str, ...], dict[str, Any]]] = {
    F.linear: (("input", "weight", "bias"), {"bias": None}),
    torch.addmm: (("input", "mat1", "mat2"), {"beta": 1, "alpha": 1}),
    torch.mm: (("input", "mat2"), {}),
    torch.matmul: (("input", "other"), {}),
    operator.matmul: (("input", "other"), {}),
    F.conv2d: (("input", "weight", "bias", "stride", "padding", "dilation", "groups"),
               {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}),
    F.embedding: (("input", "weight", "padding_idx", "max_norm", "norm_type",
                   "scale_grad_by_freq", "sparse"),
                  {"padding_idx": None, "max_norm": None, "scale_grad_by_freq": False,
                   "sparse": False}),
}
# pipecc.frontend.onnx_ops' parameter names -> the names torch uses
_ONNX_NAMES = {"gemm": {"a": "input", "b": "weight", "c": "bias"},
               "matmul": {"a": "input", "b": "other"},
               "convolution": {"x": "input", "w": "weight", "b": "bias"}}
_CALL_OPS = frozenset({"linear", "addmm", "mm", "matmul", "gemm", "conv2d", "convolution",
                       "embedding"})


def _arguments(node: fx.Node, gm: fx.GraphModule) -> dict[str, Any] | None:
    """The call's arguments by (torch) parameter name, defaults filled in; None if unknown."""
    target, op = node.target, node.meta.get(META_OP)
    if isinstance(target, torch._ops.OpOverload):
        try:
            pair = node.normalized_arguments(gm, normalize_to_only_use_kwargs=True)
        except (RuntimeError, TypeError, ValueError):
            return None
        return dict(pair.kwargs) if pair is not None else None
    if hasattr(target, "__pipecc_onnx_op__"):
        try:
            bound = inspect.signature(target).bind(*node.args, **node.kwargs)
        except TypeError:
            return None
        bound.apply_defaults()
        rename = _ONNX_NAMES.get(str(op), {})
        return {rename.get(k, k): v for k, v in bound.arguments.items()}
    if target not in _PYTHON_CALLS:
        return None
    names, defaults = _PYTHON_CALLS[target]
    if len(node.args) > len(names):
        return None
    return {**defaults, **dict(zip(names, node.args)), **node.kwargs}


def _call_layer(graph: AnnotatedGraph, node: fx.Node) -> Layer | str:
    op = str(node.meta.get(META_OP))
    if op not in _CALL_OPS:
        return f"it is a call of {op}; {_ONLY}"
    a = _arguments(node, graph.gm)
    if a is None:
        return f"its arguments are not those of a torch or ONNX {op}"
    if op == "linear":
        return _linear_call(graph, node, a["input"], a["weight"], a.get("bias"), transposed=True)
    if op == "gemm":
        if (a["transA"], a["alpha"], a["beta"]) != (0, 1, 1):
            return (f"it is an ONNX Gemm with transA={a['transA']}, alpha={a['alpha']}, "
                    f"beta={a['beta']}; only transA=0, alpha=beta=1 split")
        return _linear_call(graph, node, a["input"], a["weight"], a["bias"],
                            transposed=bool(a["transB"]))
    if op == "addmm":
        if (a.get("beta", 1), a.get("alpha", 1)) != (1, 1):
            return (f"it is an addmm with beta={a.get('beta')}, alpha={a.get('alpha')}; only "
                    "beta=alpha=1 split")
        return _linear_call(graph, node, a["mat1"], a["mat2"], a["input"], transposed=False)
    if op in ("mm", "matmul"):
        return _linear_call(graph, node, a["input"], a.get("other", a.get("mat2")), None,
                            transposed=False)
    if op == "embedding":
        return _embedding_call(graph, node, a)
    return _conv_call(graph, node, a)


def _fetch(gm: fx.GraphModule, node: fx.Node) -> Any:
    obj: Any = gm
    for part in str(node.target).split("."):
        obj = getattr(obj, part)
    return obj


def _is_transpose(node: fx.Node) -> bool:
    """w.t(), w.T, permute(w, [1, 0]), transpose(w, 0, 1), ONNX Transpose of a matrix w."""
    if node.op not in ("call_function", "call_method") or not node.args \
            or not isinstance(node.args[0], fx.Node):
        return False
    src = node.args[0].meta.get(META_VALUE)
    if not isinstance(src, TensorInfo) or len(src.shape) != 2:
        return False
    op, rest = node.meta.get(META_OP), list(node.args[1:])
    if node.target is getattr:
        return rest in (["T"], ["mT"])
    if op in ("t", "numpy_T"):
        return not rest and not node.kwargs
    if op == "permute":  # aten: (w, [1, 0]); method: w.permute(1, 0); ONNX: perm=[1, 0] or none
        if hasattr(node.target, "__pipecc_onnx_op__"):
            dims = node.kwargs.get("perm") or [1, 0]  # no perm: reverse the dims
        else:
            dims = node.kwargs.get("dims", rest[0] if len(rest) == 1 else rest)
        return isinstance(dims, (list, tuple)) and all(isinstance(d, int) for d in dims) \
            and [d % 2 for d in dims] == [1, 0]
    if op == "transpose":
        dims = rest or [node.kwargs.get("dim0"), node.kwargs.get("dim1")]
        return len(dims) == 2 and all(isinstance(d, int) for d in dims) \
            and sorted(d % 2 for d in dims) == [0, 1]
    return False


def _dying(node: fx.Node, x: fx.Node) -> set[fx.Node]:
    """The nodes only `node` reads, directly or through each other (its weight's get_attr and
    transposes; the zero bias torch.onnx computes for Conv(bias=False) from Shape(weight));
    `x`, which the shards read, never."""
    dying, frontier, changed = {node}, set(node.all_input_nodes), True
    while changed:
        changed = False
        for n in list(frontier - dying):
            if n is not x and n.op not in ("placeholder", "output") and n.users.keys() <= dying:
                dying.add(n)
                frontier |= set(n.all_input_nodes)
                changed = True
    return dying - {node}


_OWNERS: dict[int, collections.Counter] = {}  # id(gm) -> its parameters' name counts, inside `owners_cached`


@contextlib.contextmanager
def owners_cached(gm: fx.GraphModule):
    """Within the block, how many names each parameter of `gm` has is counted once, not once
    per `recognise` call (which walked every parameter of the model per layer: quadratic in
    the model's size). The caller promises not to change `gm`'s modules inside the block."""
    outer = id(gm) in _OWNERS
    if not outer:
        _OWNERS[id(gm)] = _owner_counts(gm)
    try:
        yield
    finally:
        if not outer:
            del _OWNERS[id(gm)]


def _owner_counts(gm: fx.GraphModule) -> collections.Counter:
    return collections.Counter(id(p) for _, p in gm.named_parameters(remove_duplicate=False))


def _parameter(graph: AnnotatedGraph, value: Any, what: str, dying: set[fx.Node],
               transposes: bool = True) -> tuple[fx.Node, list[fx.Node]] | str:
    """The get_attr node of the parameter that `value` reads (through 2-D transposes, when
    allowed: listed second), provided nothing but the node reads it; or why not."""
    via: list[fx.Node] = []
    while transposes and isinstance(value, fx.Node) and _is_transpose(value):
        via.append(value)
        value = value.args[0]
    if not isinstance(value, fx.Node) or value.op != "get_attr" \
            or not isinstance(_fetch(graph.gm, value), nn.Parameter):
        return f"its {what} is not a parameter (it is computed, a buffer or a constant)"
    owners = _OWNERS.get(id(graph.gm)) or _owner_counts(graph.gm)
    if not {value, *via} <= dying or owners[id(_fetch(graph.gm, value))] != 1 \
            or not value.meta.get(META_PARAMS):
        return f"its {what} is read by another node too (a reused or tied parameter)"
    return value, via


def _zeros(graph: AnnotatedGraph, value: Any) -> bool:
    """Is `value` a computed tensor of zeros: Expand / CastLike / Cast of an all-zero constant?
    (torch.onnx writes the bias of Conv(bias=False) so: Expand(CastLike(0, x), Shape(W)[:1]).)"""
    while isinstance(value, fx.Node) and value.op == "call_function" and value.args \
            and value.meta.get(META_OP) in ("expand", "type_as", "onnx_cast"):
        value = value.args[0]
    if not isinstance(value, fx.Node) or value.op != "get_attr":
        return False
    t = _fetch(graph.gm, value)
    return isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter) and not bool(t.any())


def _params(*nodes: fx.Node | None) -> list[tuple[str, str, TensorInfo]]:
    return [(role, qual, info) for role, n in zip(("weight", "bias"), nodes) if n is not None
            for qual, info in n.meta[META_PARAMS]]


def _call(graph: AnnotatedGraph, node: fx.Node, kind: str, x: fx.Node, extents: dict,
          parent: Callable[[], nn.Module] | None, weight: fx.Node, bias: fx.Node | None,
          dying: set[fx.Node]) -> Layer:
    """The layer a call computes; module shards slice `parent`, else call shards."""
    name = node.meta[META_NAME]
    other = {n for n in dying if n.op == "get_attr" and n not in (weight, bias)
             and isinstance(_fetch(graph.gm, n), nn.Parameter)}  # its bytes stay counted
    if parent is None:
        return Layer(kind, x, extents, name, f"{node.meta[META_OP]} call {name!r}",
                     dead=dying - other - {weight, bias}, weight=weight, bias=bias)
    return Layer(kind, x, extents, name, f"{node.meta[META_OP]} call {name!r}",
                 _params(weight, bias), parent, re.sub(r"\W", "_", name), dying - other)


def _bias(graph: AnnotatedGraph, bias: Any, length: int,
          dying: set[fx.Node]) -> fx.Node | None | str:
    """The get_attr node of a bias vector of `length` elements (None: no bias, or a computed
    one of zeros), or why not."""
    if bias is None or (_zeros(graph, bias) and isinstance(bias.meta.get(META_VALUE), TensorInfo)
                        and tuple(bias.meta[META_VALUE].shape) == (length,)):
        return None
    found = _parameter(graph, bias, "bias", dying, transposes=False)
    if isinstance(found, str):
        return found
    shape = tuple(_fetch(graph.gm, found[0]).shape)
    if shape != (length,):
        return f"its bias has shape {list(shape)}, not [{length}] (one value per output)"
    return found[0]


def _linear_call(graph: AnnotatedGraph, node: fx.Node, x: Any, operand: Any, bias: Any,
                 transposed: bool) -> Layer | str:
    """x·operandᵀ + bias (`transposed`: linear, Gemm transB=1) or x·operand + bias."""
    if not _tensors(node, x):
        return _NOT_TENSORS
    dying = _dying(node, x)
    found = _parameter(graph, operand, "weight", dying)
    if isinstance(found, str):
        return found
    w_node, via = found
    w = _fetch(graph.gm, w_node)
    if w.dim() != 2:
        return f"its weight has {w.dim()} dims, not 2"
    out_in = transposed != (len(via) % 2 == 1)  # is the parameter stored [out, in]?
    out, inn = (w.shape[0], w.shape[1]) if out_in else (w.shape[1], w.shape[0])
    b_node = _bias(graph, bias, out, dying)
    if isinstance(b_node, str):
        return b_node
    extents = {0: (int(out), "out_features"), 1: (int(inn), "in_features")}
    if out_in:
        def proxy() -> nn.Module:
            linear = nn.Linear(inn, out, bias=False, device="meta")
            linear.weight, linear.bias = w, _fetch(graph.gm, b_node) if b_node else None
            return linear
        return _call(graph, node, "linear", x, extents, proxy, w_node, b_node, dying)
    if via:
        return "its weight is the transpose of a parameter stored [in, out]: no slice of it"
    if bias is not None and b_node is None:
        return "its weight is stored [in, out] and its bias is computed"
    return _call(graph, node, "linear", x, extents, None, w_node, b_node, dying)


def _conv_call(graph: AnnotatedGraph, node: fx.Node, a: dict[str, Any]) -> Layer | str:
    if hasattr(node.target, "__pipecc_onnx_op__"):  # ONNX Conv
        pads = list(a["pads"] or [0] * 4)
        if a["group"] != 1:
            return f"it is a grouped convolution (group={a['group']})"
        if a["auto_pad"] not in ("NOTSET", "", None):
            return f"its padding is auto_pad={a['auto_pad']}; only explicit pads split"
        if len(pads) == 4 and pads[:2] != pads[2:]:
            return f"its pads {pads} are not the same at both ends"
        config = dict(stride=a["strides"] or 1, padding=pads[:2], dilation=a["dilations"] or 1)
    else:
        if a.get("transposed"):
            return "it is a transposed convolution"
        if a.get("groups", 1) != 1:
            return f"it is a grouped convolution (groups={a['groups']})"
        config = dict(stride=a["stride"], padding=a["padding"], dilation=a["dilation"])
    if not _tensors(node, a["input"]):
        return _NOT_TENSORS
    dying = _dying(node, a["input"])
    found = _parameter(graph, a["weight"], "weight", dying, transposes=False)
    if isinstance(found, str):
        return found
    w_node, w = found[0], _fetch(graph.gm, found[0])
    if w.dim() != 4:
        return f"it is a {w.dim() - 2}-D convolution; only 2-D convolutions split"
    b_node = _bias(graph, a["bias"], w.shape[0], dying)
    if isinstance(b_node, str):
        return b_node
    try:  # NOTE: validates the configuration now, not half-way through a rewrite
        nn.Conv2d(w.shape[1], w.shape[0], tuple(w.shape[2:]), **config, device="meta")
    except (TypeError, ValueError) as exc:
        return f"its configuration is not an nn.Conv2d's ({exc})"

    def proxy() -> nn.Module:
        conv = nn.Conv2d(w.shape[1], w.shape[0], tuple(w.shape[2:]), **config, bias=False,
                         device="meta")
        conv.weight, conv.bias = w, _fetch(graph.gm, b_node) if b_node else None
        return conv
    return _call(graph, node, "conv2d", a["input"], _extents("conv2d", w.shape), proxy, w_node,
                 b_node, dying)


def _embedding_call(graph: AnnotatedGraph, node: fx.Node, a: dict[str, Any]) -> Layer | str:
    aten = isinstance(node.target, torch._ops.OpOverload)
    ids = a["indices"] if aten else a["input"]
    pad = a.get("padding_idx")
    pad = None if aten and pad == -1 else pad  # aten's "no padding row"
    if a.get("max_norm") is not None or a.get("scale_grad_by_freq") or a.get("sparse"):
        return _WHOLE_TABLE
    if not _tensors(node, ids):
        return _NOT_TENSORS
    dying = _dying(node, ids)
    found = _parameter(graph, a["weight"], "table", dying, transposes=False)
    if isinstance(found, str):
        return found
    w_node, w = found[0], _fetch(graph.gm, found[0])
    if w.dim() != 2:
        return f"its table has {w.dim()} dims, not 2"

    def proxy() -> nn.Module:
        table = nn.Embedding(w.shape[0], w.shape[1], padding_idx=pad, device="meta")
        table.weight = w
        return table
    return _call(graph, node, "embedding", ids, _extents("embedding", w.shape), proxy, w_node,
                 None, dying)


__all__ = ["Layer", "recognise", "splittable", "extent"]
