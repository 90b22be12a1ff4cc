"""Rendering values and callables as Python source for generated stage files.

`constant` turns a node argument that is not a node (ints, tuples, slices, dtypes...) into an
expression; `callable_name` names a `call_function` target so that the generated file needs only
`import torch` (plus `math`/`operator` for the rare function from those modules, and
`pipecc.frontend.onnx_ops` for graphs imported from ONNX). Anything that cannot be named that way is a
`PipeccError`, never a guess.

Functions of other modules (`FunctionImports`): a library function that a graph calls as one
node, typically one the library marks with `torch.fx.wrap` (torchvision's `stochastic_depth`,
Swin's `_get_relative_position_bias`), is imported by its module path, as torch.fx's own code
does: `from torchvision.ops.stochastic_depth import stochastic_depth as stochastic_depth_fn`
(a `from` import reads the module itself, so a package attribute of the same name cannot shadow
it). The rule for the user's own model file (which pipecc imports by path under a name of its
own): the stage imports the function from the model file the compiled folder records,
`pipecc.runtime.modelfuncs.model_function(__file__, "helper")`, which imports that file only
when its sha256 is the one `pipecc.json` holds (`pipecc.runtime.trust`), as `pipecc run` does;
the folder then needs the model file to load, and an edited model file is refused with "compile
again". A function no import can reach (a lambda, a function defined inside another function,
one of a script run as `__main__`) is a one-line `PipeccError` naming it and the fix: define it
at the top level of an importable module or of the model file.
"""

from __future__ import annotations

import builtins
import importlib
import math
import operator
import re
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from pipecc.backends.torch.names import is_plain_identifier, literal
from pipecc.errors import PipeccError
from pipecc.frontend.modelfile import MODULE_PREFIX
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


def callable_name(target: Any, imports: set[str], functions: "FunctionImports | None" = None) -> str:
    """An expression naming `target`, adding any module it needs besides torch to `imports`;
    a function of another module is imported through `functions` (module docstring)."""
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
    if functions is not None:
        return functions.name(target)
    raise PipeccError(f"stage code generation cannot name the function {name or target!r} "
                      f"(module {getattr(target, '__module__', None)!r}): only torch functions, "
                      "operators and builtins can appear in a stage file")


MODEL_FILE_MODULE = MODULE_PREFIX  # the prefix of the name pipecc imports a model file under
MODEL_FUNCTIONS = "pipecc.runtime.modelfuncs"  # where a stage finds its model file's functions


class FunctionImports:
    """The functions of other modules a stage file calls, each imported once under an alias
    (module docstring). `fresh(hint)` reserves a module-level name no local will take."""

    def __init__(self, fresh: Callable[[str], str]) -> None:
        self._fresh = fresh
        self._alias: dict[int, str] = {}
        self.lines: list[str] = []   # `from M import f as alias` / `alias = model_function(...)`
        self.model_file = False      # whether a line imports from the model file

    def name(self, target: Any) -> str:
        """The expression naming `target` in the stage file (its import added once)."""
        if id(target) in self._alias:
            return self._alias[id(target)]
        module, qualname = importable(target)
        first, _, rest = qualname.partition(".")
        alias = self._fresh(f"{first.strip('_') or 'fn'}_fn")
        if module.startswith(MODEL_FILE_MODULE):
            self.model_file = True
            self.lines.append(f"{alias} = model_function(__file__, {literal(qualname)})"
                              f"  # {first} of the model file")
            expr = alias
        else:
            self.lines.append(f"from {module} import {first} as {alias}")
            expr = f"{alias}.{rest}" if rest else alias
        self._alias[id(target)] = expr
        return expr

    def header(self) -> list[str]:
        """The import lines, after the torch imports of the stage file."""
        lead = [f"from {MODEL_FUNCTIONS} import model_function  # functions of the hashed model file"] \
            if self.model_file else []
        return lead + self.lines


def _where(module: Any) -> str:
    """`the model file m.py` for the module pipecc imported a model file as, else the module."""
    if isinstance(module, str) and module.startswith(MODEL_FILE_MODULE):
        file = getattr(sys.modules.get(module), "__file__", None)
        return f"the model file {Path(file).name}" if file else "the model file"
    return str(module)


def importable(target: Any) -> tuple[str, str]:
    """(module, qualified name) by which `target` can be imported again, or a one-line
    PipeccError naming the function and the fix."""
    name = getattr(target, "__name__", None) or repr(target)
    module = getattr(target, "__module__", None)
    qualname = getattr(target, "__qualname__", None) or name
    fix = ("a stage file imports the functions it calls: define it (with def) at the top level "
           "of an importable module or of the model file")
    where = _where(module)
    why = None
    if not isinstance(module, str) or not module:
        why = "it belongs to no module"
    elif name == "<lambda>":
        bound = next((k for k, v in vars(sys.modules.get(module, builtins)).items() if v is target), None)
        name = bound or name
        why = f"a lambda in {where}"
    elif "<locals>" in qualname:
        why = f"defined inside {qualname.split('.<locals>')[0]}() in {where}"
    elif module == "__main__":
        why = "defined in the script being run (__main__), which another process cannot import"
    elif not all(is_plain_identifier(p) for p in module.split(".") + qualname.split(".")):
        why = f"{module}.{qualname} is not an import path"
    if why is None:
        try:
            obj: Any = importlib.import_module(module)
            for part in qualname.split("."):
                obj = getattr(obj, part)
        except Exception:  # noqa: BLE001  (any failure means: not importable)
            obj = None
        if obj is not target:
            why = f"{module}.{qualname} does not name it"
    if why is not None:
        raise PipeccError(f"stage code generation cannot name the function {name!r} ({why}); {fix}")
    return module, qualname


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
