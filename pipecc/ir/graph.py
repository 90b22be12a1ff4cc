"""pipecc's one IR: a `torch.fx.GraphModule` whose nodes carry pipecc annotations in `node.meta`.

Why an fx graph with meta rather than an IR of our own or onnx-ir:
  * it executes — every rewrite, every stage cut and every generated stage can be checked
    numerically against the original model simply by running it;
  * torch.fx already has the mechanisms the passes need (`Interpreter` for analyses,
    `split_module` for cutting, Python code generation for readable stage files);
  * ONNX files import into the same form: each ONNX op becomes a `call_function` to a small
    torch implementation (`pipecc.frontend.onnx_ops`) and initializers become parameters, so one cost
    model, one balance pass and one torch backend serve both frontends.

Annotations (written by analyses only; they never change the graph's structure):
  META_VALUE  the node's output: `TensorInfo`, a tuple of values, a `ScalarInfo`, or None
  META_OP     normalised op name (`linear`, `conv2d`, `add`, `onnx.Gemm` maps to `linear`...)
  META_KIND   op class used by the cost model (see `pipecc.ir.ops.KINDS`)
  META_NAME   unique human name (`layers.3.attn.proj`, `layers.3.attn.softmax`)
  META_COST   `pipecc.cost.NodeCost` (sympy expressions and their values at the example point)
  META_OUTPUT_CLASS  (output node, fx graphs) `module:qualname` of the dict subclass forward
              returns (a ModelOutput), which fx writes as a plain dict
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Union

import sympy
import torch
import torch.fx as fx

META_VALUE = "pipecc.value"
META_OP = "pipecc.op"
META_KIND = "pipecc.kind"
META_NAME = "pipecc.name"
META_COST = "pipecc.cost"
META_PARAMS = "pipecc.params"  # list of (qualified name, TensorInfo) owned by the node
META_OUTPUT_CLASS = "pipecc.output_class"

Dim = Union[int, sympy.Expr]


@dataclass(frozen=True)
class TensorInfo:
    """Shape (symbolic dims allowed), dtype and whether autograd tracks it."""

    shape: tuple[Dim, ...]
    dtype: torch.dtype
    requires_grad: bool = False

    @property
    def numel(self) -> Dim:
        n: Dim = 1
        for d in self.shape:
            n = n * d
        return n

    @property
    def itemsize(self) -> int:
        # NOTE: torch.dtype.itemsize is element_size() without allocating a tensor (the
        # cost model asked it for every node of every split trial: 6 % of a plan, issue 31)
        return self.dtype.itemsize

    @property
    def nbytes(self) -> Dim:
        return self.numel * self.itemsize

    def describe(self) -> str:
        dims = ", ".join(str(d) for d in self.shape)
        return f"{str(self.dtype).removeprefix('torch.')}[{dims}]"


@dataclass(frozen=True)
class ScalarInfo:
    """A non-tensor value (a size, a flag); `value` may be symbolic."""

    value: Any


Value = Union[TensorInfo, ScalarInfo, tuple, None]


def tensors_in(value: Value) -> Iterator[TensorInfo]:
    """The tensors inside a value, depth first."""
    if isinstance(value, TensorInfo):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from tensors_in(v)


def value_bytes(value: Value) -> Dim:
    total: Dim = 0
    for t in tensors_in(value):
        total = total + t.nbytes
    return total


@dataclass
class AnnotatedGraph:
    """A captured model: the fx graph plus what the frontends and analyses learned about it.

    `symbols` maps symbol names (`B`, and any user-marked ones such as `S`) to sympy symbols;
    `point` gives their values at the example the user asked about (e.g. B=2).
    """

    gm: fx.GraphModule
    symbols: dict[str, sympy.Symbol]
    point: dict[sympy.Symbol, int]
    source: str  # "fx", "export" or "onnx"
    model_name: str = "model"
    warnings: list[str] = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        return int(self.point.get(self.symbols.get("B"), 1)) if "B" in self.symbols else 1

    def compute_nodes(self) -> list[fx.Node]:
        """Nodes in topological (graph) order, without placeholders and the output node."""
        return [n for n in self.gm.graph.nodes if n.op not in ("placeholder", "output")]

    def by_name(self) -> dict[str, fx.Node]:
        return {n.meta[META_NAME]: n for n in self.gm.graph.nodes if META_NAME in n.meta}


BATCH_NORM_OPS = frozenset({"batch_norm", "native_batch_norm", "_native_batch_norm_legit",
                            "_native_batch_norm_legit_functional", "_batch_norm_with_update"})


def training_batchnorm_names(graph: AnnotatedGraph) -> list[str]:
    """Human names of the BatchNorm nodes that normalise with batch statistics (training mode,
    or no running statistics), in graph order: a split batch changes their statistics, and
    recomputing them updates running statistics twice."""
    names = []
    for node in graph.gm.graph.nodes:
        if node.meta.get(META_OP) not in BATCH_NORM_OPS or node.op not in ("call_module", "call_function"):
            continue
        if node.op == "call_function":  # F.batch_norm / aten.batch_norm: training is arg 5
            training = node.kwargs.get("training", node.args[5] if len(node.args) > 5 else None)
            if training is False:  # eval-mode statistics, fixed when traced
                continue
        names.append(str(node.meta.get(META_NAME, node.name)))
    return names


class IRError(AssertionError):
    """The IR broke an invariant: a bug in a pass, not a user error."""


def verify(graph: AnnotatedGraph, costed: bool = False) -> None:
    """Check the invariants every pass relies on; raise IRError naming the first violation.

    fx lint (def-before-use, targets exist), every node annotated with a value, op, kind and a
    unique human name, and — when `costed` — a cost on every node.
    """
    try:
        graph.gm.graph.lint()
    except Exception as exc:
        raise IRError(f"fx lint failed: {exc}") from exc
    names: set[str] = set()
    required = [META_VALUE, META_OP, META_KIND, META_NAME] + ([META_COST] if costed else [])
    for node in graph.gm.graph.nodes:
        if node.op == "output":
            continue
        for key in required:
            if key not in node.meta:
                raise IRError(f"node {node.name} ({node.op} {node.target}) lacks {key}")
        name = node.meta[META_NAME]
        if name in names:
            raise IRError(f"duplicate human name {name!r}")
        names.add(name)
