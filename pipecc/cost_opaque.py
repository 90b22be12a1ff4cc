"""Costs of opaque calls, measured by running them: what a library function kept as one node runs.

A function the capture keeps as one `call_function` node without looking inside (a library's
`torch.fx.wrap`ped function such as torchvision's `stochastic_depth` or Swin's
`shifted_window_attention`, a wrapped helper of the model file) has no formula in the cost
table, and a guess from its output size misses its work: Swin's attention, two thirds of the
model's matmul FLOPs, would look like an elementwise op. So such a call is costed by what it
runs (`is_opaque` says which calls; torch functions and operators keep their table rules):

  * it is called on fake tensors (`FakeTensorMode`: shapes and dtypes, no memory, no FLOPs) of
    its operands' shapes, under `torch.utils.flop_counter.FlopCounterMode`, which counts the
    matmul-class work of the aten ops it runs (the reference the cost model follows); the other
    aten ops are counted by the table's conventions (`_ElementCounter`: a pointwise op one FLOP
    per output element, a reduction one per input element, softmax and norms five, views,
    copies and factories none);
  * backward (when an operand or the output needs a gradient): `torch.autograd.grad` of the
    outputs, under the same counters, once for every operand that needs a gradient and once
    for the data operands only; the difference is the weight-gradient part (a *weight* is an
    operand computed from parameters alone, as in `pipecc.cost`);
  * stash: the bytes autograd saves inside the call (`saved_tensors_hooks`), less its inputs,
    plus its output (the cost model's convention: a node stashes what it produces);
  * symbolic: FLOPs are polynomials in the graph's symbols (B, ...), so the call is measured at
    three values of each symbol (the example's and the next two), interpolated (degree two per
    symbol: attention is quadratic in a sequence length) and checked at a fourth value. A cost
    that fails the check (or a graph without symbols) is the example point's number, a
    constant, and a note says so.

A call that cannot run on fake tensors (its work depends on tensor values) keeps the guess and
its warning, with the reason. Identical calls (same function, operand shapes and constants: the
blocks of a model) are measured once.
"""

from __future__ import annotations

import builtins
import itertools
import math
import operator
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from pipecc.ir.graph import META_NAME, META_VALUE, AnnotatedGraph, ScalarInfo, TensorInfo

_CACHE = "pipecc.opaque_costs"  # graph.gm.meta key: measured calls, by function and operands
FIELDS = ("forward_flops", "forward_flops_matmul", "backward_flops", "backward_flops_matmul",
          "backward_weight_flops", "backward_weight_flops_matmul", "stash_bytes")
_NOT_OPAQUE = ("torch", "builtins", "operator", "math", "_operator", "pipecc.frontend.onnx_ops")
_REDUCTIONS = frozenset({"sum", "mean", "amax", "amin", "max", "min", "var", "std", "prod", "norm",
                         "linalg_vector_norm", "logsumexp", "var_mean", "std_mean", "cumsum", "argmax",
                         "argmin", "all", "any"})
# copies and fills are tagged pointwise but move bytes only (the cost model: copies cost no
# FLOPs); whether a reshape copies depends on the sizes (B = 1 is often a view)
_COPIES = frozenset({"clone", "copy", "copy_", "_to_copy", "_unsafe_view", "fill", "fill_", "zero_",
                     "zeros_like", "ones_like", "empty_like", "full_like", "new_zeros", "new_ones",
                     "new_empty", "new_full", "lift_fresh", "lift_fresh_copy", "detach", "alias"})
_FIVE = frozenset({"_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data",
                   "native_layer_norm", "native_layer_norm_backward", "native_group_norm",
                   "native_group_norm_backward", "native_batch_norm", "native_batch_norm_backward",
                   "_native_batch_norm_legit", "_native_batch_norm_legit_no_training"})


def is_opaque(node: fx.Node) -> bool:
    """A call of a Python function that is neither torch's nor an operator nor an ONNX op."""
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return False
    if target in (getattr, builtins.len) or getattr(operator, getattr(target, "__name__", ""), None) is target \
            or getattr(math, getattr(target, "__name__", ""), None) is target:
        return False
    module = getattr(target, "__module__", None) or ""
    return callable(target) and not any(module == m or module.startswith(m + ".") for m in _NOT_OPAQUE)


class _ElementCounter(TorchDispatchMode):
    """Non-matmul FLOPs of the aten ops run under it, by the cost table's conventions."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        packet = getattr(func, "overloadpacket", None)
        if packet in flop_registry or getattr(func, "is_view", False):
            return out
        name = func._schema.name.split("::")[-1]
        outs = [t.numel() for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        ins = [t.numel() for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if name in _FIVE:
            self.flops += 5 * max(outs + ins + [0])
        elif name in _REDUCTIONS:
            self.flops += max(ins + [0])
        elif torch.Tag.pointwise in func.tags and name not in _COPIES:
            self.flops += sum(outs)
        return out


class _Counters:
    """FlopCounterMode (matmul class) and `_ElementCounter` (the rest), entered together."""

    def __enter__(self) -> "_Counters":
        self.mm, self.other = FlopCounterMode(display=False), _ElementCounter()
        self.mm.__enter__()
        self.other.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.other.__exit__(*exc)
        self.mm.__exit__(*exc)

    def totals(self) -> tuple[int, int]:
        """(all FLOPs, matmul-class FLOPs)."""
        mm = int(self.mm.get_total_flops())
        return mm + self.other.flops, mm


def _run_once(node: fx.Node, point: dict, data: set[fx.Node]) -> dict[str, int]:
    """The call's costs at one point of the symbols (module docstring), on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    leaves: list[tuple[torch.Tensor, bool]] = []   # (fake operand, is a weight)

    def fake(info: TensorInfo, weight: bool) -> torch.Tensor:
        shape = [int(sympy.sympify(d).subs(point)) if not isinstance(d, int) else d for d in info.shape]
        t = torch.zeros(shape, dtype=info.dtype)
        if info.requires_grad and (t.is_floating_point() or t.is_complex()):
            t.requires_grad_(True)
            leaves.append((t, weight))
        return t

    def build(value: Any, weight: bool) -> Any:
        if isinstance(value, TensorInfo):
            return fake(value, weight)
        if isinstance(value, ScalarInfo):
            return value.value
        if isinstance(value, (tuple, list)):
            return type(value)(build(v, weight) for v in value)
        return value

    def operand(n: fx.Node) -> Any:
        return build(n.meta.get(META_VALUE), n not in data)

    with mode, torch.enable_grad():
        args = fx.node.map_arg(node.args, operand)
        kwargs = fx.node.map_arg(node.kwargs, operand)
        inputs = {id(t) for t, _ in leaves} | {id(t) for t in torch.utils._pytree.tree_leaves((args, kwargs))
                                               if isinstance(t, torch.Tensor)}
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in inputs and id(t._base) not in inputs:  # a view of a weight is the weight
                saved[id(t)] = t.numel() * t.element_size()
            return t

        with _Counters() as c, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = node.target(*args, **kwargs)
        fwd, fwd_mm = c.totals()
        outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        out_ids = {id(t) for t in outs}
        grads = [t for t in outs if t.requires_grad]
        result = {"forward_flops": fwd, "forward_flops_matmul": fwd_mm, "backward_flops": 0,
                  "backward_flops_matmul": 0, "backward_weight_flops": 0, "backward_weight_flops_matmul": 0,
                  "stash_bytes": sum(b for i, b in saved.items() if i not in out_ids) if grads else 0}
        wrt_all = [t for t, _ in leaves]
        wrt_data = [t for t, weight in leaves if not weight]
        if not grads or not wrt_all:
            return result
        seeds = [torch.ones_like(t) for t in grads]
        with _Counters() as c:
            torch.autograd.grad(grads, wrt_all, seeds, allow_unused=True, retain_graph=bool(wrt_data))
        bwd, bwd_mm = c.totals()
        data_bwd = data_mm = 0
        if wrt_data:
            with _Counters() as c:
                torch.autograd.grad(grads, wrt_data, seeds, allow_unused=True)
            data_bwd, data_mm = c.totals()
        result.update(backward_flops=bwd, backward_flops_matmul=bwd_mm,
                      backward_weight_flops=max(bwd - data_bwd, 0),
                      backward_weight_flops_matmul=max(bwd_mm - data_mm, 0))
    return result


def _interpolate(samples: dict[tuple[int, ...], int], grids: list[list[int]], syms: list[sympy.Symbol]) -> Any:
    """The polynomial through `samples` on the grid (tensor-product Lagrange), expanded."""
    expr: Any = sympy.Integer(0)
    for point, value in samples.items():
        if not value:
            continue
        term: Any = sympy.Integer(value)
        for s, v, grid in zip(syms, point, grids):
            for w in grid:
                if w != v:
                    term = term * (s - w) / sympy.Integer(v - w)
        expr = expr + term
    expr = sympy.expand(expr)
    return int(expr) if expr.is_Integer else expr


class Measurer:
    """Measures the opaque calls of one graph (module docstring); `notes` says what is constant."""

    def __init__(self, graph: AnnotatedGraph, data: set[fx.Node]) -> None:
        self.graph, self.data = graph, data
        self.notes: list[str] = []
        self.failed: dict[str, str] = {}   # op name -> why it could not be measured
        # kept with the graph: annotate runs again after rewrites (split layers, attention mode)
        self._cache: dict[Any, Any] = graph.gm.meta.setdefault(_CACHE, {})

    def measure(self, node: fx.Node) -> dict[str, Any] | None:
        """{field: expression} for `node`, or None (why in `failed`)."""
        key = self._key(node)
        if key is not None and key in self._cache:
            result, failed, notes = self._cache[key]
        else:
            before = (dict(self.failed), len(self.notes))
            result = self._measure(node)
            failed = {k: v for k, v in self.failed.items() if k not in before[0]}
            notes = self.notes[before[1]:]
            if key is not None:
                self._cache[key] = (result, failed, notes)
        self.failed.update(failed)
        self.notes.extend(n for n in notes if n not in self.notes)
        return result

    def _key(self, node: fx.Node) -> Any:
        def sig(a: Any) -> Any:
            if isinstance(a, fx.Node):
                return ("node", repr(a.meta.get(META_VALUE)), a in self.data)
            if isinstance(a, (tuple, list)):
                return tuple(sig(x) for x in a)
            if isinstance(a, dict):
                return tuple((k, sig(v)) for k, v in a.items())
            return ("const", repr(a))
        try:
            return (id(node.target), sig(node.args), sig(node.kwargs))
        except Exception:  # noqa: BLE001  (an odd constant: measure without the cache)
            return None

    def _measure(self, node: fx.Node) -> dict[str, Any] | None:
        symbols = [s for s in self.graph.symbols.values() if s in self.graph.point]
        base = [int(self.graph.point[s]) for s in symbols]
        grids = [[b, b + 1, b + 2] for b in base]
        name = getattr(node.target, "__name__", str(node.target))
        try:
            samples = {p: _run_once(node, dict(zip(symbols, p)), self.data)
                       for p in itertools.product(*grids)} if symbols else {(): _run_once(node, {}, self.data)}
            check = _run_once(node, {s: b + 3 for s, b in zip(symbols, base)}, self.data) if symbols else None
        except Exception as exc:  # noqa: BLE001  (the user's function: any failure keeps the guess)
            text = str(exc).strip().splitlines()
            self.failed[name] = f"{type(exc).__name__}: {text[0][:120] if text else ''}".rstrip(": ")
            return None
        out: dict[str, Any] = {}
        constant = False
        for field in FIELDS:
            values = {p: r[field] for p, r in samples.items()}
            if not symbols:
                out[field] = values[()]
                continue
            expr = _interpolate(values, grids, symbols)
            at = expr if isinstance(expr, int) else expr.subs({s: b + 3 for s, b in zip(symbols, base)})
            if check is None or int(at) != check[field]:
                out[field] = values[tuple(base)]
                constant = True
            else:
                out[field] = expr
        if constant:
            self.notes.append(f"the measured cost of {node.meta.get(META_NAME, node.name)} ({name}, and of the "
                              "calls like it) is not a "
                              f"polynomial of degree two in {', '.join(map(str, symbols))}: it is kept at the "
                              "example sizes")
        return out


def measured_names(failed: dict[str, str]) -> str:
    """`f (why), g (why)` for the warning about calls that could not be measured."""
    return ", ".join(f"{op} ({why})" for op, why in sorted(failed.items()))


__all__ = ["FIELDS", "Measurer", "is_opaque", "measured_names"]
