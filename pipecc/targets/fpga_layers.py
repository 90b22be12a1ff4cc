"""Which fx nodes an FPGA stage can hold, and as which dataflow processes (structure only).

The one definition shared by the planner (through `pipecc.targets.fpga_model`) and the FPGA backend
(`backends/fpga/lower.py` adds the numbers): a stage's nodes become

    unpack (stage input)  ─►  layers (BatchNorm folded into the conv/linear before it; views,
    flatten, dropout free; a tensor read twice gets a clone)  ─►  pack (stage output)

one `LayerSpec` per process of the generated top function. Imports nothing from backends/.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import sympy
import torch.fx as fx
import torch.nn as nn

from pipecc.errors import PipeccError
from pipecc.ir.graph import META_NAME, META_OP, META_VALUE, ScalarInfo, TensorInfo
from pipecc.ir.ops import node_op

SUPPORTED_KINDS = frozenset({"linear", "conv", "activation", "pool", "norm", "elementwise",
                             "shape", "input", "param"})
SCALAR_OPS = frozenset({"size", "dim", "getattr", "sym_size", "numel"})
ALIAS_OPS = frozenset("flatten view reshape dropout identity contiguous _unsafe_view "
                      "unsafe_view detach alias".split())



class UnsupportedOpError(PipeccError):
    """A node the FPGA backend cannot generate was placed on an FPGA (one-line message)."""

    def __init__(self, op: str, node: str, reason: str = "") -> None:
        self.op, self.node = op, node
        why = f" ({reason})" if reason else ""
        super().__init__(f"FPGA backend cannot generate op {op!r} at node {node!r}{why}; "
                         "keep this node off FPGA devices")


@dataclass
class LayerSpec:
    """One dataflow process of an FPGA stage. Tensor ids are fx node names."""

    kind: str                      # dense conv2d scale relu relu6 gelu maxpool2d avgpool2d
    name: str                      # adaptive_avgpool2d add concat clone unpack pack
    nodes: tuple[str, ...]         # fx nodes folded into this process
    inputs: tuple[str, ...]        # tensor ids read
    tensor: str                    # tensor id written ("" for pack)
    in_shapes: tuple[tuple[int, ...], ...]
    out_shape: tuple[int, ...]
    attrs: dict[str, Any] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)  # role -> gm attribute path

    @property
    def numel_in(self) -> int:
        return sum(math.prod(s) for s in self.in_shapes)

    @property
    def numel_out(self) -> int:
        return math.prod(self.out_shape)


class _No(Exception):
    """Internal: a node is not supported, with the reason."""


# ----------------------------------------------------------------------------- structure
_POS = {
    "linear": ("input", "weight", "bias"),
    "conv2d": ("input", "weight", "bias", "stride", "padding", "dilation", "groups"),
    "max_pool2d": ("input", "kernel_size", "stride", "padding", "dilation", "ceil_mode"),
    "avg_pool2d": ("input", "kernel_size", "stride", "padding", "ceil_mode",
                   "count_include_pad", "divisor_override"),
    "hardtanh": ("input", "min_val", "max_val"), "gelu": ("input", "approximate"),
    "add": ("input", "other", "alpha"), "iadd": ("input", "other"), "cat": ("tensors", "dim"),
    "concat": ("tensors", "dim"), "flatten": ("input", "start_dim", "end_dim"),
}


def _pair(v: Any) -> tuple[int, int]:
    return (int(v[0]), int(v[-1])) if isinstance(v, (tuple, list)) else (int(v), int(v))


def _args(node: fx.Node, op: str) -> dict[str, Any]:
    names = _POS.get(op, ("input",))
    out = {k: v for k, v in zip(names, node.args)}
    for k, v in node.kwargs.items():
        out["input" if k == "self" else k] = v
    return out


def _module_attrs(op: str, mod: nn.Module, path: str) -> tuple[str, dict, dict]:
    p = {n: f"{path}.{n}" for n, t in list(mod.named_parameters(recurse=False)) +
         list(mod.named_buffers(recurse=False)) if t is not None}
    if op == "linear":
        return "dense", {"bias": mod.bias is not None}, p
    if op == "conv2d":
        if mod.padding_mode != "zeros" or isinstance(mod.padding, str) and mod.padding != "valid":
            raise _No(f"padding {mod.padding!r} / mode {mod.padding_mode!r}")
        pad = (0, 0) if mod.padding == "valid" else _pair(mod.padding)
        if _pair(mod.dilation) != (1, 1):
            raise _No("dilation != 1")
        return "conv2d", {"stride": _pair(mod.stride), "pad": pad, "groups": mod.groups,
                          "kernel": _pair(mod.kernel_size), "bias": mod.bias is not None}, p
    if op == "batch_norm":
        if mod.running_mean is None:
            raise _No("BatchNorm without running statistics")
        return "bn", {"eps": float(mod.eps)}, p
    if op in ("max_pool2d", "avg_pool2d"):
        if mod.ceil_mode or (op == "avg_pool2d" and mod.divisor_override) or \
                (op == "max_pool2d" and (_pair(mod.dilation) != (1, 1) or mod.return_indices)):
            raise _No("ceil_mode / dilation / divisor_override / return_indices")
        a = {"kernel": _pair(mod.kernel_size), "stride": _pair(mod.stride or mod.kernel_size),
             "pad": _pair(mod.padding)}
        if op == "avg_pool2d":
            a["count_include_pad"] = bool(mod.count_include_pad)
        return op.replace("_pool", "pool"), a, {}
    if op == "gelu":
        return "gelu", {"approximate": mod.approximate}, {}
    if op == "hardtanh":
        return _hardtanh(mod.min_val, mod.max_val)
    return _simple(op)


def _hardtanh(lo: Any, hi: Any) -> tuple[str, dict, dict]:
    if (lo, hi) != (0.0, 6.0):
        raise _No("hardtanh other than relu6")
    return "relu6", {}, {}


def _simple(op: str) -> tuple[str, dict, dict]:
    table = {"relu": "relu", "relu_": "relu", "relu6": "relu6", "adaptive_avg_pool2d":
             "adaptive_avgpool2d", "add": "add", "iadd": "add", "cat": "concat",
             "concat": "concat"}
    if op in ALIAS_OPS:
        return "alias", {}, {}
    if op not in table:
        raise _No("no FPGA template for this op")
    return table[op], {}, {}


def describe(node: fx.Node, gm: fx.GraphModule) -> tuple[str, dict, dict, list[fx.Node]]:
    """(layer kind, attrs, param roles -> gm paths, tensor inputs) of a compute node."""
    op = str(node.meta.get(META_OP) or node_op(node, gm))
    if node.op == "call_module":
        kind, attrs, params = _module_attrs(op, gm.get_submodule(str(node.target)), str(node.target))
        tensors = [a for a in node.args if isinstance(a, fx.Node)][:1]
        return kind, attrs, params, tensors
    a = _args(node, op)
    params: dict[str, str] = {}
    for role in ("weight", "bias"):
        if isinstance(a.get(role), fx.Node):
            if a[role].op != "get_attr":
                raise _No(f"{role} is computed, not a parameter")
            params[role] = str(a[role].target)
    if op == "linear":
        return "dense", {"bias": "bias" in params}, params, [a["input"]]
    if op == "conv2d":
        if a.get("dilation", 1) not in (1, (1, 1), [1, 1]) or isinstance(a.get("padding"), str):
            raise _No("dilation / string padding")
        return "conv2d", {"stride": _pair(a.get("stride", 1)), "pad": _pair(a.get("padding", 0)),
                          "groups": int(a.get("groups", 1)), "bias": "bias" in params,
                          "kernel": None}, params, [a["input"]]
    if op in ("max_pool2d", "avg_pool2d"):
        if a.get("ceil_mode") or a.get("divisor_override") or a.get("dilation", 1) not in (1, (1, 1)):
            raise _No("ceil_mode / dilation / divisor_override")
        k = _pair(a["kernel_size"])
        attrs = {"kernel": k, "stride": _pair(a.get("stride") or k), "pad": _pair(a.get("padding", 0))}
        if op == "avg_pool2d":
            attrs["count_include_pad"] = bool(a.get("count_include_pad", True))
        return op.replace("_pool", "pool"), attrs, {}, [a["input"]]
    if op == "gelu":
        return "gelu", {"approximate": a.get("approximate", "none")}, {}, [a["input"]]
    if op == "hardtanh":
        return (*_hardtanh(a.get("min_val", -1.0), a.get("max_val", 1.0)), [a["input"]])
    if op in ("add", "iadd"):
        if not all(isinstance(a.get(k), fx.Node) for k in ("input", "other")) or a.get("alpha", 1) != 1:
            raise _No("add needs two tensors (no constants, alpha 1)")
        return "add", {}, {}, [a["input"], a["other"]]
    if op in ("cat", "concat"):
        ts = list(a["tensors"])
        return "concat", {"dim": int(a.get("dim", 0))}, {}, ts
    if op == "flatten" and node.op != "call_module" and int(a.get("start_dim", 0)) == 0:
        raise _No("flatten over the batch dimension")
    kind, attrs, _ = _simple(op)
    return kind, attrs, {}, [a.get("input", node.args[0] if node.args else None)]


def _host_scalar(node: fx.Node) -> bool:
    """`x.size(0)` and friends: shape arithmetic the generated code has already resolved."""
    return str(node.meta.get(META_OP)) in SCALAR_OPS and isinstance(node.meta.get(META_VALUE),
                                                                     ScalarInfo)


def supported(node: fx.Node) -> bool:
    """Can the FPGA backend generate this node? (planner: keep unsupported nodes off FPGAs).

    Precise, per node; `SUPPORTED_KINDS` is only the coarse kind filter (a `norm` node may be a
    BatchNorm, which is supported, or a LayerNorm, which is not).
    """
    if node.op in ("placeholder", "output", "get_attr") or _host_scalar(node):
        return True
    try:
        describe(node, node.graph.owning_module)
        return True
    except (_No, KeyError, TypeError, ValueError, AttributeError):
        return False


def _fetch(gm: fx.GraphModule, path: str) -> Any:
    obj: Any = gm
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _sample_shape(node: fx.Node, point: Mapping[Any, int] | None) -> tuple[int, ...]:
    value = node.meta.get(META_VALUE)
    if not isinstance(value, TensorInfo) or len(value.shape) < 2:
        raise _No("needs a tensor with a batch dimension")
    dims = []
    for d in value.shape[1:]:
        d = sympy.sympify(d).subs(point or {}) if isinstance(d, sympy.Basic) else d
        if isinstance(d, sympy.Basic) and not d.is_Integer:
            raise _No(f"symbolic per-sample dimension {d}")
        dims.append(int(d))
    return tuple(dims)


def _shape_attrs(kind: str, attrs: dict, ins: list[tuple[int, ...]], out: tuple[int, ...],
                 gm: fx.GraphModule, params: dict[str, str]) -> dict:
    a = dict(attrs)
    if kind == "dense":
        a.update(n_in=ins[0][-1], n_out=out[-1], n_vec=math.prod(out[:-1]))
    elif kind in ("conv2d", "maxpool2d", "avgpool2d", "adaptive_avgpool2d"):
        if len(ins[0]) != 3:
            raise _No("needs an NCHW input")
        a.update(in_c=ins[0][0], in_h=ins[0][1], in_w=ins[0][2], out_c=out[0], out_h=out[1],
                 out_w=out[2])
        if kind == "adaptive_avgpool2d":  # largest bin: [floor(i*n/m), ceil((i+1)*n/m))
            a.update({f"bin_{d}": max(-(-(i + 1) * a[f"in_{d}"] // a[f"out_{d}"]) -
                                      i * a[f"in_{d}"] // a[f"out_{d}"]
                                      for i in range(a[f"out_{d}"])) for d in "hw"})
        if kind == "conv2d" and not a.get("kernel"):
            a["kernel"] = tuple(int(x) for x in _fetch(gm, params["weight"]).shape[2:])
    elif kind == "scale":
        a.update(channels=ins[0][0], spatial=math.prod(ins[0][1:]))
    elif kind == "concat":
        if len(ins) != 2 or a["dim"] not in (0, -len(out)) and a["dim"] % (len(out) + 1) != 1:
            raise _No("concat of two tensors along the channel dimension only")
        a.update(n_a=math.prod(ins[0]), n_b=math.prod(ins[1]))
    elif kind == "add" and ins[0] != ins[1]:
        raise _No("add with broadcasting")
    a.setdefault("n", math.prod(out))
    return a


def plan_layers(gm: fx.GraphModule, nodes: Sequence[fx.Node] | None = None,
                point: Mapping[Any, int] | None = None) -> list[LayerSpec]:
    """The dataflow processes an FPGA stage made of `nodes` (default: all of `gm`) becomes.

    Raises UnsupportedOpError naming the first node the backend cannot generate. Tensors
    read from outside `nodes` become `unpack` processes, tensors used outside become `pack`
    processes; a tensor read twice gets a `clone`; a BatchNorm right after a conv/linear
    whose only user it is folds into that layer; views, flatten and dropout are free.
    """
    chosen = [n for n in (gm.graph.nodes if nodes is None else nodes)
              if n.op not in ("placeholder", "output", "get_attr")]
    inside = {n.name for n in chosen}
    alias: dict[str, str] = {}
    layers: list[LayerSpec] = []
    producer: dict[str, LayerSpec] = {}

    def tid(n: Any, user: fx.Node) -> str:
        if not isinstance(n, fx.Node):
            raise UnsupportedOpError(str(user.meta.get(META_OP, user.target)),
                                     str(user.meta.get(META_NAME, user.name)), "non-tensor input")
        name = alias.get(n.name, n.name)
        if name not in producer:  # produced outside the stage: a stage input
            spec = LayerSpec("unpack", "input", (), (), name, (), _sample_shape(n, point))
            spec.attrs["n"] = spec.numel_out
            layers.insert(sum(1 for s in layers if s.kind == "unpack"), spec)
            producer[name] = spec
        return name

    for node in chosen:
        op, human = str(node.meta.get(META_OP, node.target)), str(node.meta.get(META_NAME, node.name))
        if _host_scalar(node):
            continue
        try:
            kind, attrs, params, ins = describe(node, gm)
            ids = [tid(n, node) for n in ins]
            in_shapes = [_sample_shape(n, point) for n in ins]
            out = _sample_shape(node, point)
            if kind == "alias":
                if math.prod(out) != math.prod(in_shapes[0]):
                    raise _No("reshape across the batch dimension")
                alias[node.name] = ids[0]
                continue
            src = ins[0]
            prev = producer.get(ids[0])
            if kind == "bn" and prev is not None and prev.kind in ("dense", "conv2d") and \
                    prev.tensor == src.name and len(src.users) == 1 and "bn_eps" not in prev.attrs:
                prev.nodes += (node.name,)
                prev.params.update({f"bn_{k}": v for k, v in params.items()})
                prev.attrs["bn_eps"] = attrs["eps"]
                del producer[prev.tensor]
                prev.tensor, prev.out_shape = node.name, out
                producer[node.name] = prev
                continue
            kind = "scale" if kind == "bn" else kind
            attrs = _shape_attrs(kind, attrs, in_shapes, out, gm, params)
        except _No as exc:
            raise UnsupportedOpError(op, human, str(exc)) from None
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise UnsupportedOpError(op, human, f"unexpected arguments: {exc}") from None
        spec = LayerSpec(kind, human, (node.name,), tuple(ids), node.name, tuple(in_shapes),
                         out, attrs, params)
        layers.append(spec)
        producer[node.name] = spec

    if nodes is None:
        out_node = next(n for n in gm.graph.nodes if n.op == "output")
        users = _flat_nodes(out_node.args)
    else:
        users = [n for n in chosen if not _host_scalar(n) and
                 any(u.name not in inside for u in n.users)]
    for n in users:
        t = tid(n, n)
        layers.append(LayerSpec("pack", "output", (), (t,), "", (producer[t].out_shape,),
                                producer[t].out_shape, {"n": math.prod(producer[t].out_shape)}))
    reads: dict[str, int] = {}
    for s in layers:
        for t in s.inputs:
            reads[t] = reads.get(t, 0) + 1
    for t, k in reads.items():
        if k > 1:
            at = layers.index(producer[t]) + 1
            shape = producer[t].out_shape
            layers.insert(at, LayerSpec("clone", f"clone {producer[t].name}", (), (t,), t,
                                        (shape,), shape, {"n": math.prod(shape), "copies": k}))
    return layers


def _flat_nodes(args: Any) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg(args, out.append)
    return out
