"""In-place ops on the values a stage receives: which inputs a stage writes, and when that is refused.

A stage's received tensor is a leaf of autograd in the distributed runtime (it arrived over
the wire and requires grad), and autograd forbids modifying a leaf that requires grad in place
(`x.relu_()` -> "a leaf Variable that requires grad is being used in an in-place operation").
So a stage works on a copy of exactly the inputs it may write in place: the generated stage.py
starts with `x = x.clone()` for them (`codegen`), and the drop-in module clones the same inputs
(`compile.pipelined_module`). The clone rebinds the input's own variable, so every later use in
the stage, and a relay of that value to later stages, sees the written values, as in the model.
Under activation recomputation the clone is inside the checkpointed function, so the re-run
starts from the unmodified input, as it must.

What counts as a write (conservative, from the stage's fx graph): a method or function whose
name ends in `_` and is not a dunder (`add_`, `torch.relu_`), Python's in-place operators and
`setitem` (`x += 1` on a tensor, `x[i] = v`), an `out=` argument, `inplace=True` (a keyword or
bound from a functional's signature) and a module whose `inplace` attribute is true (unless the
caller says it is written out of place: codegen lowers `nn.ReLU(inplace=True)` to `F.relu`).
A write reaches an input through any chain of ops that may return a view or the input itself
(`view`, `x[...]`, `transpose`, `contiguous`, `to`, `nn.Identity`, ...): only ops known to
return a new tensor (arithmetic, matmul, activations, reductions, modules with weights, ...)
stop the chain. ATen ops (graphs captured by torch.export) say both in their schema
(`Tensor(a!) self` is written, a return without alias annotation is new). Cloning an input
that is not written only costs memory; missing one is a crash.

Refused (`check_in_place`): a stage that writes a received value in place while another value
it receives shares that value's memory in the model (`v = h.view(...)`, both crossing the cut).
In one process the write would show through the other; across processes they are two tensors,
and the pipeline would compute something else than the model.
"""

from __future__ import annotations

import inspect
from typing import Callable, Sequence

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from pipecc.errors import PipeccError
from pipecc.ir.graph import META_NAME, META_VALUE, AnnotatedGraph, TensorInfo

# Python's in-place operators, by `operator` function name and by Tensor method name
_IN_PLACE_OPERATORS = {"setitem", "iadd", "isub", "imul", "imatmul", "itruediv", "ifloordiv", "imod",
                       "ipow", "ilshift", "irshift", "iand", "ior", "ixor"}
_IN_PLACE_OPERATORS |= {f"__{name}__" for name in _IN_PLACE_OPERATORS}

# NOTE: ops that always return a new tensor (never a view of, or the very object of, an input).
# Anything else may alias its inputs: a write to its output is taken as a write to them.
_FRESH = {
    # arithmetic and comparison (operator functions and Tensor methods)
    "add", "sub", "mul", "div", "true_divide", "floor_divide", "truediv", "floordiv", "mod",
    "remainder", "pow", "neg", "matmul", "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "xor",
    "invert", "abs", "rsub", "minimum", "maximum", "clamp", "clip", "sign", "lerp", "where",
    # linear algebra and layers
    "mm", "bmm", "addmm", "baddbmm", "linear", "bilinear", "conv1d", "conv2d", "conv3d",
    "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "embedding", "layer_norm",
    "group_norm", "batch_norm", "rms_norm", "scaled_dot_product_attention", "outer",
    # elementwise functions and activations
    "exp", "log", "sqrt", "rsqrt", "sin", "cos", "erf", "tanh", "sigmoid", "relu", "relu6", "gelu",
    "silu", "mish", "softplus", "elu", "leaky_relu", "hardswish", "hardsigmoid", "softmax",
    "log_softmax",
    # reductions, copies and constructions
    "sum", "mean", "var", "std", "amax", "amin", "norm", "cumsum", "argmax", "argmin", "clone",
    "cat", "concat", "stack", "repeat", "tile", "roll", "flip", "tril", "triu", "gather",
    "index_select", "masked_fill", "zeros_like", "ones_like", "empty_like", "full_like",
    "rand_like", "randn_like", "new_zeros", "new_ones", "new_empty", "new_full", "pad",
    "interpolate", "one_hot",
}


def op_name(node: fx.Node) -> str:
    """The method name of a call_method, the `__name__` of a call_function's target."""
    if node.op == "call_method":
        return str(node.target)
    return str(getattr(node.target, "__name__", "")) if node.op == "call_function" else ""


def is_in_place_name(name: str) -> bool:
    """`add_`, `relu_`, `iadd`, `__setitem__`; not `__init__`-style dunders."""
    return (name.endswith("_") and not name.startswith("__")) or name in _IN_PLACE_OPERATORS


def written(node: fx.Node, module: nn.Module | None = None,
            writes_module: Callable[[nn.Module], bool] | None = None) -> list[fx.Node]:
    """The nodes whose tensors `node` writes in place (`module`: the target of a call_module;
    `writes_module(module)`: whether that module writes its input, default its `inplace`)."""
    first = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    out: list[fx.Node] = [n for n in pytree.tree_leaves(node.kwargs.get("out"))
                          if isinstance(n, fx.Node)]
    if isinstance(node.target, torch._ops.OpOverload):  # an ATen op (torch.export): its schema says
        return out + _schema_writes(node)
    if first is None:
        return out
    if node.op in ("call_method", "call_function"):
        if is_in_place_name(op_name(node)) or _inplace_argument(node):
            out.append(first)
    elif node.op == "call_module" and module is not None:
        writes = writes_module or (lambda m: getattr(m, "inplace", False) is True)
        if writes(module):
            out.append(first)
    return out


def _schema_writes(node: fx.Node) -> list[fx.Node]:
    """The arguments an ATen op's schema marks as written (`Tensor(a!) self`, `out`)."""
    found = []
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = node.kwargs.get(arg.name) if arg.kwarg_only or i >= len(node.args) else node.args[i]
        found += [n for n in pytree.tree_leaves(value) if isinstance(n, fx.Node)]
    return found


def _inplace_argument(node: fx.Node) -> bool:
    """`F.relu(x, inplace=True)`, also passed positionally (`F.leaky_relu(x, 0.2, True)`)."""
    if node.kwargs.get("inplace") is True:
        return True
    if node.op != "call_function" or not callable(node.target):
        return False
    try:
        bound = inspect.signature(node.target).bind(*node.args, **node.kwargs)
    except (TypeError, ValueError):  # builtins without a signature, or a call it cannot bind
        return False
    return bound.arguments.get("inplace") is True


def _module_of(gm: fx.GraphModule, node: fx.Node) -> nn.Module | None:
    return gm.get_submodule(str(node.target)) if node.op == "call_module" else None


def _returns_new(node: fx.Node, module: nn.Module | None) -> bool:
    """True when `node`'s value is certainly not (a view of) one of its inputs."""
    if node.op in ("placeholder", "get_attr"):
        return True
    if node.op == "call_module":
        if module is None or getattr(module, "inplace", False) is True:
            return False
        aliasing = (nn.Identity, nn.Flatten, nn.Unflatten, nn.modules.dropout._DropoutNd)
        return not isinstance(module, aliasing)
    if isinstance(node.target, torch._ops.OpOverload):  # no return aliases an input
        return all(r.alias_info is None for r in node.target._schema.returns)
    return op_name(node) in _FRESH and "out" not in node.kwargs and not _inplace_argument(node)


def alias_roots(gm: fx.GraphModule) -> dict[fx.Node, frozenset[fx.Node]]:
    """node -> the nodes whose fresh tensors its value may share memory with (itself if fresh)."""
    roots: dict[fx.Node, frozenset[fx.Node]] = {}
    for node in gm.graph.nodes:
        if _returns_new(node, _module_of(gm, node)):
            roots[node] = frozenset({node})
        else:
            roots[node] = frozenset().union(*(roots[n] for n in node.all_input_nodes))
    return roots


def written_inputs(gm: fx.GraphModule,
                   writes_module: Callable[[nn.Module], bool] | None = None) -> list[int]:
    """Positions of `gm`'s placeholders holding a tensor that some node may write in place."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    writers = _writers(gm, writes_module)
    return [i for i, p in enumerate(placeholders) if p in writers]


def _writers(gm: fx.GraphModule, writes_module: Callable[[nn.Module], bool] | None = None,
             ) -> dict[fx.Node, fx.Node]:
    """Tensor placeholder -> the first node that may write it in place."""
    roots = alias_roots(gm)
    found: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        for target in written(node, _module_of(gm, node), writes_module):
            for root in roots[target]:
                if root.op == "placeholder" and _may_be_tensor(root):
                    found.setdefault(root, node)
    return found


def _may_be_tensor(node: fx.Node) -> bool:
    value = node.meta.get(META_VALUE)
    return value is None or isinstance(value, TensorInfo)


def check_in_place(graph: AnnotatedGraph, stages: Sequence) -> None:
    """Refuse a stage that writes a received value in place while another value it receives
    shares that value's memory in the model (see the module docstring)."""
    roots = alias_roots(graph.gm)
    by_name = {n.name: n for n in graph.gm.graph.nodes}
    for stage in stages:
        placeholders = [n for n in stage.gm.graph.nodes if n.op == "placeholder"]
        ports = [by_name.get(p.name) for p in stage.receives]
        for placeholder, writer in _writers(stage.gm).items():
            mine = ports[placeholders.index(placeholder)]
            for other in ports:
                if other is None or mine is None or other is mine \
                        or not isinstance(other.meta.get(META_VALUE), TensorInfo):
                    continue
                if roots[mine] & roots[other]:
                    raise PipeccError(
                        f"stage {stage.index} writes {_name(mine)} in place ({_name(writer)}), but "
                        f"{_name(other)}, which it also receives, shares memory with it in the model; "
                        f"across stages they are two tensors and {_name(other)} would miss the write: "
                        f"put {_name(writer)} in the stage that computes {_name(mine)} (move the "
                        "cut), or write it out of place")


def _name(node: fx.Node) -> str:
    return repr(str(node.meta.get(META_NAME, node.name)))


class ClonesInputs(torch.nn.Module):
    """A stage module that works on copies of the inputs it writes in place (`inplace`), as
    its stage.py does: the received tensors are left as they came (under recomputation the
    re-run must start from them)."""

    def __init__(self, inner: torch.nn.Module, positions: Sequence[int]) -> None:
        super().__init__()
        self.inner = inner
        self.positions = frozenset(positions)

    def forward(self, *args: object) -> tuple:
        # NOTE: the stage runs in this wrapper's mode; a caller may set `.training` on the
        # wrapper alone (PipelinedModule does, for a model compiled in eval mode)
        self.inner.training = self.training
        return self.inner(*[a.clone() if i in self.positions and isinstance(a, torch.Tensor) else a
                            for i, a in enumerate(args)])
