"""Rendering values and callables as Python source for generated stage files.

`constant` turns a node argument that is not a node (ints, tuples, slices, dtypes...) into an
expression; `callable_name` names a `call_function` target so that the generated file needs only
`import torch` (plus `math`/`operator` for the rare function from those modules, and
`pipecc.frontend.onnx_ops` for graphs imported from ONNX). Anything that cannot be named that way is a
`PipeccError`, never a guess.
"""

from __future__ import annotations

import builtins
import math
import operator
import re
from typing import Any, Callable

import torch
import torch.nn.functional as F

from pipecc.backends.torch.names import is_plain_identifier, literal
from pipecc.errors import PipeccError
from pipecc.ir.train_flag import ByMode

# operator functions that read better as Python operators: (template, needs parentheses)
BINARY = {operator.add: "+", operator.sub: "-", operator.mul: "*", operator.truediv: "/",
          operator.floordiv: "//", operator.mod: "%", operator.pow: "**", operator.matmul: "@",
          operator.and_: "&", operator.or_: "|", operator.xor: "^", operator.lshift: "<<",
          operator.rshift: ">>", operator.eq: "==", operator.ne: "!=", operator.lt: "<",
          operator.le: "<=", operator.gt: ">", operator.ge: ">="}
UNARY = {operator.neg: "-", operator.pos: "+", operator.invert: "~", operator.not_: "not "}

_ATOM = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*|[0-9][0-9.e]*")


def atom(expr: str) -> str:
    """`expr`, parenthesised unless it is a name, attribute chain or non-negative number."""
    return expr if _ATOM.fullmatch(expr) else f"({expr})"


def constant(value: Any, render_node: Callable[[Any], str]) -> str:
    """Source for a node argument; fx nodes inside containers go through `render_node`."""
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, int):
        return repr(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return repr(value)
        return f"float({literal(repr(value))})"
    if isinstance(value, complex):
        return f"complex({constant(value.real, render_node)}, {constant(value.imag, render_node)})"
    if isinstance(value, str):
        return literal(value)
    if value is Ellipsis:
        return "..."
    if isinstance(value, torch.Size):
        return f"torch.Size([{', '.join(constant(v, render_node) for v in value)}])"
    if isinstance(value, tuple):
        items = [constant(v, render_node) for v in value]
        return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"
    if isinstance(value, list):
        return f"[{', '.join(constant(v, render_node) for v in value)}]"
    if isinstance(value, dict):
        pairs = (f"{constant(k, render_node)}: {constant(v, render_node)}" for k, v in value.items())
        return "{" + ", ".join(pairs) + "}"
    if isinstance(value, slice):
        parts = (constant(v, render_node) for v in (value.start, value.stop, value.step))
        return f"slice({', '.join(parts)})"
    if isinstance(value, (torch.dtype, torch.memory_format, torch.layout)):
        return _torch_attribute(value)
    if isinstance(value, torch.device):
        return f"torch.device({literal(str(value))})"
    if isinstance(value, ByMode):  # a constant per train/eval mode: reads self.training
        return value.source(lambda v: constant(v, render_node))
    if hasattr(value, "op") and hasattr(value, "target"):  # an fx.Node (duck-typed, no import cycle)
        return render_node(value)
    raise PipeccError(f"stage code generation cannot write a constant of type {type(value).__name__}")


def subscript(index: Any, render_node: Callable[[Any], str]) -> str:
    """The text inside `x[...]`: slices as `a:b:c`, tuples without parentheses."""
    def one(v: Any) -> str:
        if isinstance(v, slice):
            parts = ["" if p is None else constant(p, render_node) for p in (v.start, v.stop, v.step)]
            text = f"{parts[0]}:{parts[1]}"
            return f"{text}:{parts[2]}" if parts[2] else text
        return constant(v, render_node)
    if isinstance(index, tuple):
        items = [one(v) for v in index]
        return f"{items[0]}," if len(items) == 1 else ", ".join(items) if items else "()"
    return one(index)


def _torch_attribute(value: Any) -> str:
    name = str(value).removeprefix("torch.")
    if not is_plain_identifier(name) or getattr(torch, name, None) is not value:
        raise PipeccError(f"stage code generation cannot name {value!r} as torch.<name>")
    return f"torch.{name}"


def callable_name(target: Any, imports: set[str]) -> str:
    """An expression naming `target`, adding any module it needs besides torch to `imports`."""
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return _op_name(target)
    name = getattr(target, "__name__", None)
    if is_plain_identifier(name):
        if getattr(F, name, None) is target:
            return f"F.{name}"
        if getattr(torch, name, None) is target:
            return f"torch.{name}"
        if getattr(builtins, name, None) is target:
            return name
        for module in (math, operator):
            if getattr(module, name, None) is target:
                imports.add(module.__name__)
                return f"{module.__name__}.{name}"
    qualified = _qualified(target)
    if qualified is not None:
        return qualified
    onnx = _onnx_name(target)
    if onnx is not None:
        imports.add("onnx_ops")
        return onnx
    raise PipeccError(f"stage code generation cannot name the function {name or target!r} "
                      f"(module {getattr(target, '__module__', None)!r}): only torch functions, "
                      "operators and builtins can appear in a stage file")


def _op_name(op: Any) -> str:
    """`torch.ops.<namespace>.<op>.<overload>` for an aten (or other) operator overload."""
    if isinstance(op, torch._ops.OpOverload):
        parts = [op.namespace, op._schema.name.split("::")[-1], op._overloadname]
    else:
        parts = [op._qualified_op_name.split("::")[0], op._qualified_op_name.split("::")[-1]]
    if not all(is_plain_identifier(p) for p in parts):
        raise PipeccError(f"stage code generation cannot name the operator {op!r}")
    expr = "torch.ops." + ".".join(parts)
    if _resolve(expr) is not op:
        raise PipeccError(f"stage code generation: {expr} is not the operator {op!r}")
    return expr


def _qualified(target: Any) -> str | None:
    """`torch.x.y` when fx's qualified name resolves from `torch` back to `target`."""
    try:
        from torch.fx.node import _get_qualified_name
        qualified = _get_qualified_name(target)
    except Exception:  # fx raises for lambdas and other unnamed callables
        return None
    parts = qualified.split(".")
    if parts[0] != "torch" or not all(is_plain_identifier(p) for p in parts):
        return None
    if qualified.startswith("torch.nn.functional."):
        qualified = "F." + qualified.removeprefix("torch.nn.functional.")
    return qualified if _resolve(qualified) is target else None


def _resolve(expr: str) -> Any:
    obj: Any = {"torch": torch, "F": F}[expr.split(".")[0]]
    for part in expr.split(".")[1:]:
        obj = getattr(obj, part, None)
    return obj


def _onnx_name(target: Any) -> str | None:
    """`onnx_ops.IMPLEMENTATIONS['Gemm']` for the torch implementation of an ONNX operator."""
    if getattr(target, "__module__", None) != "pipecc.frontend.onnx_ops":
        return None
    from pipecc.frontend import onnx_ops
    for op_type, fn in onnx_ops.IMPLEMENTATIONS.items():
        if fn is target:
            return f"onnx_ops.IMPLEMENTATIONS[{literal(op_type)}]"
    return None
