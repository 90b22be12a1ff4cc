"""The pass contract: what each step the driver runs reads, what it produces, and whether it
changes what it reads (onnx-ir's `PassBase.in_place` / `changes_input`, torch.fx's pass manager).

A step is one function over the driver's `State` (`pipecc.instruments`); its `Contract`, here,
says which parts of the state it reads and which it produces, in one vocabulary:

    file      the model file (.py or .onnx) and its arguments
    model     an in-memory model, its example inputs and, for a .py file, its spec
    graph     the annotated graph (`pipecc.ir.graph.AnnotatedGraph`)
    costs     the graph's cost annotations (`node.meta`'s META_COST and the modes they were made in)
    plan      the plan (`pipecc.ir.plan.Plan`) and the planner's candidate behind it
    cluster   the devices (`pipecc.targets.hardware.Cluster`)
    options   the planner's options (`passes.plan_options.PlanOptions`) or the compile target
    stages    the cut stages
    backends  the backends that check, write and build
    report    report.html and the data behind it
    folder    the compiled folder on disk
    module    the drop-in module

A step produces a part by putting a NEW value in the state; it never edits a value it read:
the Plan a plan pass is given is the same after it (`umpipe_plan.apply` and `bipartition_plan.apply`
copy it first), and a step that adds a decision line adds it to a copy. The one exception is an
annotation: `costs` and `recost` write cost annotations on the graph they read (`changes_input`),
as torch.fx analyses write `node.meta`; they change no node, edge or name. `Instruments` holds
every step to its contract under `debug` (which tests always set): a part it does not produce
keeps its value, and a plan it read and did not declare changing prints the same JSON after it.

`CONTRACTS` is the one table of the driver's own steps, in the order the driver runs them
(`pipecc.driver`'s module docstring); `implementation` names the function that does the work
("module:function"). A technique's planning step is declared where the technique lives: its
package's plan part holds a `TechniqueStep` (`STEP`), its contract with it, which the driver
runs after "split layers", in `pipecc.techniques.TECHNIQUES` order, when the options ask for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["Contract", "CONTRACTS", "PlanContext", "READABLE", "PRODUCIBLE", "TechniqueStep", "contract_of"]

READABLE = ("file", "model", "graph", "costs", "plan", "cluster", "options", "stages", "backends")
PRODUCIBLE = ("model", "graph", "costs", "plan", "stages", "report", "folder", "module")


@dataclass(frozen=True)
class Contract:
    name: str                         # the step's name: `NNN_<name>.txt` with --dump-ir
    reads: tuple[str, ...]            # of READABLE
    produces: tuple[str, ...]         # of PRODUCIBLE; () for a check (it passes or raises)
    implementation: str               # "module:function" that does the work
    changes_input: bool = False       # True only for an annotation of the graph it reads

    def __post_init__(self) -> None:
        bad = [r for r in self.reads if r not in READABLE] + [p for p in self.produces if p not in PRODUCIBLE]
        if bad:
            raise ValueError(f"pass {self.name!r}: unknown part(s) {bad} (module docstring)")
        if self.changes_input and set(self.produces) != {"costs"}:
            raise ValueError(f"pass {self.name!r}: only an annotation (produces costs) may change its input")


def _c(name: str, reads: str, produces: str, implementation: str, changes_input: bool = False) -> Contract:
    return Contract(name, tuple(reads.split()), tuple(produces.split()), implementation, changes_input)


CONTRACTS: dict[str, Contract] = {c.name: c for c in (
    # analyze
    _c("build", "file", "model", "pipecc.frontend.modelfile:load_model_file"),
    _c("import", "file", "graph", "pipecc.frontend.onnx_import:from_onnx"),
    _c("capture", "model", "graph", "pipecc.frontend.torch_capture:from_module"),
    _c("costs", "graph", "costs", "pipecc.cost:annotate", changes_input=True),
    # plan
    _c("recost", "graph costs cluster options", "costs", "pipecc.cost:recost_attention", changes_input=True),
    _c("balance", "graph costs cluster options", "plan", "pipecc.passes.plan_search:Planner"),
    _c("split layers", "graph costs plan cluster options", "graph plan", "pipecc.passes.split_search:search"),
    # compile
    _c("cut stages", "graph plan", "stages", "pipecc.backends.torch.stages:cut_stages"),
    _c("report", "graph plan", "report", "pipecc.report.html:render_report"),
    _c("check", "graph plan stages backends options", "", "pipecc.backends.base:Backend.check"),
    _c("write", "graph plan stages backends options", "folder", "pipecc.backends.torch.compile:write_output"),
    _c("module", "model graph plan stages backends options", "module", "pipecc.backends.base:Backend.module"),
)}


def contract_of(name: str) -> Contract:
    """The contract of step `name`; a KeyError names the step that declares none."""
    try:
        return CONTRACTS[name]
    except KeyError:
        raise KeyError(f"step {name!r} declares no contract: add it to pipecc.passes.contract.CONTRACTS") from None


@dataclass(frozen=True)
class PlanContext:
    """What a technique's planning step reads beside the driver's `State`."""
    planner: Any                       # `passes.plan_search.Planner`: the search "balance" ran
    graph: Any                         # the unsplit annotated graph it planned
    cluster: Any                       # `pipecc.targets.hardware.Cluster`
    options: Any                       # `passes.plan_options.PlanOptions`, resolved
    evaluator: Callable[[Any], Any]    # graph -> an `Evaluator` over it (a split graph has its own units)


@dataclass(frozen=True)
class TechniqueStep:
    """A technique's planning step (its package's ``plan.STEP``): `run(state, ctx)` when
    `wanted(options)`, with `label` as its progress line."""
    contract: Contract
    label: str
    wanted: Callable[[Any], bool]
    run: Callable[[Any, PlanContext], None]
