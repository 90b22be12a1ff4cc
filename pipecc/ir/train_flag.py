"""Constants that depend on the train/eval flag, kept symbolic in stage graphs.

torch.export (and torch.fx, for functional code such as `F.dropout(x, 0.1, self.training)`)
specialises a graph on the module's `training` flag: `aten.dropout.default(x, 0.1, True)`,
`aten.batch_norm.default(..., True, ...)`, `scaled_dot_product_attention(..., 0.1)` (HF's
`dropout_p=p if self.training else 0.0`). A stage cut from such a graph would run the captured
mode forever. The frontend captures the model in both modes (`pipecc.frontend.modes`) and, at
every node where the two graphs differ only in a constant argument, records both values under
`META_BY_MODE` on the node of the train-mode graph (the IR keeps the train-mode constants, so
analyses and costs see plain values).

When a stage graph is built, `follow` writes a `ByMode(train, eval)` marker into those argument
positions. Its `repr` is the Python expression that reads the module's flag (`self.training`,
`(0.1 if self.training else 0.0)`), which is what torch.fx's code generation writes for a
constant it does not know (so the in-process stage GraphModules follow `train()`/`eval()`) and
what the stage.py code generator writes (`ByMode.source`). An interpreter that runs a stage graph
node by node (`fx.Interpreter`) resolves the markers with `resolve`.

A model whose two captures differ in structure (a Python branch on `self.training` that runs
other ops), or whose other mode cannot be captured, keeps one mode: `META_ONE_MODE` on the
graph module's `meta` holds it, and `follow` puts a `torch._assert` at the top of every stage
so that running it in the other mode is an error that says so, never silently the wrong mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx

META_BY_MODE = "pipecc.by_mode"   # node.meta: {arg index or kwarg name: (train value, eval value)}
META_ONE_MODE = "pipecc.one_mode"  # gm.meta: (captured training flag, why) for one-mode graphs


@dataclass(frozen=True)
class ByMode:
    """A constant argument that is `train` in training mode and `eval` in eval mode."""

    train: Any
    eval: Any

    def source(self, render: Callable[[Any], str] = repr) -> str:
        """The expression reading `self.training` (`render` writes the two constants)."""
        if self.train is True and self.eval is False:
            return "self.training"
        if self.train is False and self.eval is True:
            return "(not self.training)"
        return f"({render(self.train)} if self.training else {render(self.eval)})"

    def __repr__(self) -> str:  # torch.fx writes unknown constants with repr()
        return self.source()

    def value(self, training: bool) -> Any:
        return self.train if training else self.eval


def resolve(value: Any, training: bool) -> Any:
    """`value` with every `ByMode` inside it (tuples, lists, dicts) replaced by its value."""
    if isinstance(value, ByMode):
        return value.value(training)
    if isinstance(value, (tuple, list)):
        return type(value)(resolve(v, training) for v in value)
    if isinstance(value, dict):
        return {k: resolve(v, training) for k, v in value.items()}
    return value


def follow(graph: fx.Graph, root: fx.GraphModule) -> None:
    """Make a stage graph cut from `root` follow the flag of the module that runs it (in place)."""
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue  # NOTE: a value received from an earlier stage keeps its producer's meta
        for where, (train, eval_) in (node.meta.get(META_BY_MODE) or {}).items():
            marker = ByMode(train, eval_)
            if isinstance(where, int):
                node.update_arg(where, marker)
            else:
                node.update_kwarg(where, marker)
    one = getattr(root, "meta", {}).get(META_ONE_MODE)
    if one is not None:
        training, why = one
        first = next((n for n in graph.nodes if n.op != "placeholder"), None)
        mode = "train" if training else "eval"
        message = (f"this stage was captured in {mode} mode only ({why}); run it in {mode} mode "
                   f"(call .{mode}()), or make forward take the same ops in both modes")
        with graph.inserting_before(first):
            graph.call_function(torch._assert, (ByMode(training, not training), message))
