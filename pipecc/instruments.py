"""How the driver runs a step: `State` (what the steps read and write), `Step` (a named function
over it with its contract, `pipecc.passes.contract`) and `Instruments`, which runs every step
through one function, `run_step`, the same way:

    progress line (consecutive steps with one label share one) ─► the step ─► its time ─►
    with `debug`: the IR verifier and the step's contract ─► with `dump_ir=DIR`: DIR/NNN_<step>.txt

The verifier (`pipecc.ir.verify`) checks the graph and, once there is one, the plan against it.
The contract check holds the step to what it declares: a part of the state it does not produce
keeps its value, and a plan it read (unless it declares `changes_input`) prints the same JSON after
it, a graph it read keeps its nodes (an annotation may change only their costs). A dump is the
graph's text with each node's name, kind, value and cost, then the plan JSON once there is a plan
and the stages' ports once cut.
"""

from __future__ import annotations

import itertools
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from torch import nn

from pipecc import progress
from pipecc.errors import UsageError
from pipecc.frontend.modelfile import ModelSpec
from pipecc.ir.graph import META_COST, META_KIND, META_NAME, META_VALUE, AnnotatedGraph, IRError, TensorInfo
from pipecc.ir.plan import Plan
from pipecc.ir.verify import verify, verify_plan
from pipecc.passes.contract import Contract, contract_of
from pipecc.report.formatting import count

if TYPE_CHECKING:
    from pipecc.backends.base import Backend

__all__ = ["State", "Step", "Instruments", "run_step", "verify_state", "ir_text"]


@dataclass
class State:
    """One compilation as far as it has got: what the steps read and write."""

    model: nn.Module | None = None         # an in-memory model and its example inputs
    inputs: tuple = ()
    spec: ModelSpec | None = None          # a .py model file's
    graph: AnnotatedGraph | None = None
    costed: bool = False                   # every node carries META_COST
    plan: Plan | None = None
    candidate: Any = None                  # the planner's choice the split search starts from
    stages: list[Any] | None = None        # cut stages (pipecc.backends.torch.Stage)
    backends: list[Backend] = field(default_factory=list)
    extra_files: dict[str, str] = field(default_factory=dict)
    module: nn.Module | None = None


# the State fields each part of the contract's vocabulary names (what a step may replace)
FIELDS = {"model": ("model", "inputs", "spec"), "graph": ("graph",), "costs": ("costed",),
          "plan": ("plan", "candidate"), "stages": ("stages",), "report": ("extra_files",),
          "module": ("module",), "backends": ("backends",), "folder": ()}


@dataclass(frozen=True)
class Step:
    name: str                              # `NNN_<name>.txt` with dump_ir; the timing's key
    run: Callable[[State], None]
    label: str | None = None               # its progress line (None: none of its own)
    contract: Contract | None = None       # None: the registered one of `name`

    def __post_init__(self) -> None:
        if self.contract is None:
            object.__setattr__(self, "contract", contract_of(self.name))


class Instruments:
    """Runs steps in order, each through `run_step` (module docstring)."""

    def __init__(self, debug: bool = False, dump_ir: str | Path | None = None) -> None:
        self.debug = debug
        self.dump_dir = _dump_folder(dump_ir) if dump_ir is not None else None
        self.timings: list[tuple[str, float]] = []

    def run(self, steps: Sequence[Step], state: State) -> State:
        for label, group in itertools.groupby(steps, key=lambda s: s.label):
            with progress.step(label) if label else nullcontext():
                for step in group:
                    run_step(step, state, self)
        return state

    def dump(self, name: str, state: State, seconds: float) -> Path:
        """`NNN_<name>.txt`, numbered on from the dumps already in the folder (so analyze,
        plan and compile, each with its own Instruments, number one sequence)."""
        assert self.dump_dir is not None
        done = [int(p.name[:3]) for p in self.dump_dir.glob("[0-9][0-9][0-9]_*.txt")]
        path = self.dump_dir / f"{max(done, default=-1) + 1:03d}_{name.replace(' ', '_')}.txt"
        path.write_text(f"# after step {name!r} ({seconds:.3f} s)\n{ir_text(state)}", encoding="utf-8")
        return path


def run_step(step: Step, state: State, instruments: Instruments) -> None:
    """Run one step: timed, then (with `debug`) verified and held to its contract, then dumped."""
    before = _snapshot(step, state) if instruments.debug else None
    start = time.perf_counter()
    step.run(state)
    seconds = time.perf_counter() - start
    instruments.timings.append((step.name, seconds))
    if before is not None:
        verify_state(state)
        _check_contract(step, state, before)
    if instruments.dump_dir is not None:
        instruments.dump(step.name, state, seconds)


def _nodes(graph: AnnotatedGraph) -> list[str]:
    return [node.format_node() for node in graph.gm.graph.nodes]


def _snapshot(step: Step, state: State) -> dict[str, Any]:
    contract = step.contract
    assert contract is not None
    out: dict[str, Any] = {"fields": {f: getattr(state, f) for fs in FIELDS.values() for f in fs}}
    if "plan" in contract.reads and state.plan is not None and not contract.changes_input:
        out["plan"] = (state.plan, state.plan.dumps())
    if "graph" in contract.reads and state.graph is not None:
        out["graph"] = (state.graph, _nodes(state.graph))
    return out


def _check_contract(step: Step, state: State, before: dict[str, Any]) -> None:
    """IRError naming what `step` did beyond its contract (module docstring)."""
    contract = step.contract
    assert contract is not None
    mine = {f for part in contract.produces for f in FIELDS[part]}
    for name, value in before["fields"].items():
        if name not in mine and getattr(state, name) is not value:
            raise IRError(f"step {step.name!r} replaced the state's {name}, which its contract does not produce")
    if "plan" in before:
        plan, text = before["plan"]
        if plan.dumps() != text:
            raise IRError(f"step {step.name!r} changed the plan it read in place (its contract: a new plan)")
    if "graph" in before:
        graph, nodes = before["graph"]
        if _nodes(graph) != nodes:
            raise IRError(f"step {step.name!r} changed the nodes of the graph it read in place "
                          "(its contract: a new graph)")


def _dump_folder(dump_ir: str | Path) -> Path:
    """`--dump-ir DIR`, created now (before any step runs), or one line saying why it cannot be."""
    folder = Path(dump_ir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK):
            raise PermissionError("not writable")
    except OSError as exc:
        why = "it is a file" if folder.is_file() else (exc.strerror or str(exc)).lower()
        raise UsageError(f"--dump-ir {dump_ir}: cannot write dumps there ({why}); give a folder "
                         "pipecc can create or write") from None
    return folder


def verify_state(state: State) -> None:
    """The verifiers on what the steps have made so far (IRError names the first violation)."""
    if state.graph is None:
        return
    verify(state.graph, costed=state.costed)
    if state.plan is not None:
        verify_plan(state.graph, state.plan, state.stages)


def ir_text(state: State) -> str:
    """The readable form `dump_ir` writes: the graph, the plan JSON, the stages' ports."""
    g = state.graph
    if g is None:
        return "(no graph yet)\n"
    point = ", ".join(f"{k}={g.point.get(s, '?')}" for k, s in g.symbols.items())
    lines = [f"graph {g.model_name} (from {g.source}; {point})"]
    for node in g.gm.graph.nodes:
        meta = [str(node.meta.get(key)) for key in (META_NAME, META_KIND) if key in node.meta]
        value = node.meta.get(META_VALUE)
        if isinstance(value, TensorInfo):
            meta.append(value.describe())
        if META_COST in node.meta:
            meta.append(f"fwd {node.meta[META_COST].forward_flops} FLOPs")
        lines.append(f"{node.format_node()}" + (f"  # {', '.join(meta)}" if meta else ""))
    if state.plan is not None:
        lines += ["", "plan:", state.plan.dumps()]
    for stage in state.stages or []:
        recv = ", ".join(p.producer for p in stage.receives)
        send = ", ".join(p.producer for p in stage.sends)
        lines.append(f"stage {stage.index}: receives [{recv}] sends [{send}] "
                     f"({count(len(stage.nodes), 'node')})")
    return "\n".join(lines) + "\n"
