"""The checks compile and the drop-in run on a plan and its graph before any code is written:
each technique's rule on the backends' capabilities and the rules that need the graph
(`check_techniques`), what the backends execute (`capabilities_of`), whether training changes
anything (`trainable`), whether a split batch changes BatchNorm's statistics (`batchnorm_note`:
a warning, or with `strict_batchnorm` a refusal) or mixes samples (`separable`). Each refusal
is one PipeccError line naming the problem and the fix."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from pipecc import techniques
from pipecc.errors import PipeccError
from pipecc.ir.graph import META_PARAMS, AnnotatedGraph, training_batchnorm_names
from pipecc.ir.plan import Plan
from pipecc.techniques import capabilities as caps

if TYPE_CHECKING:
    from pipecc.backends.base import Backend

__all__ = ["batchnorm_message", "batchnorm_note", "batchnorm_warning", "capabilities_of", "check_techniques",
           "graph_requires", "separable", "strict_batchnorm_message", "trainable"]

PLANNER_PARTS = ("search", "plan")  # the layers of a technique's part that holds its `graph_requires`


def batchnorm_note(graph: AnnotatedGraph, plan: Plan, *, current_mode: bool = False,
                   replicas: int = 1) -> str | None:
    """Why the pipeline's BatchNorm outputs can differ from the model's, or None.

    NOTE: a training pipeline runs each micro-batch (and each of `replicas` its slice, as DDP
    without SyncBatchNorm) through BatchNorm on its own: in training mode (always, without running
    statistics) it normalises with that piece's mean and variance and updates its running statistics
    once per piece: GPipe's behaviour. With one piece they are the model's. Eval mode with running
    statistics is unaffected, as is ONNX BatchNormalization (inference-only). `pipecc run` trains in
    training mode; the drop-in runs modules in their current mode (`current_mode`: eval-mode ones do not count).
    """
    if plan.microbatches * replicas <= 1 or plan.schedule == "inference" or graph.source == "onnx":
        return None
    names = training_batchnorm_names(graph)
    names = [n for n in names if batch_statistics_now(graph, n)] if current_mode else names
    if not names:
        return None
    more = f" and {len(names) - 1} more" if len(names) > 1 else ""
    parts = (f"each of the {replicas} replicas' slices of " if replicas > 1 else "") + (
        f"each of the {plan.microbatches} micro-batches" if plan.microbatches > 1 else "the batch")
    return f"BatchNorm ({names[0]}{more}) in training mode normalises {parts} with its own statistics"


def batch_statistics_now(graph: AnnotatedGraph, name: str) -> bool:
    """Whether BatchNorm node `name` normalises with batch statistics in its module's current
    mode (a traced function call's flag was fixed when it was captured: it does)."""
    node = graph.by_name()[name]
    if node.op != "call_module":
        return True
    module = graph.gm.get_submodule(str(node.target))
    return bool(module.training or getattr(module, "running_mean", None) is None)


def check_techniques(graph: AnnotatedGraph, plan: Plan, capabilities: caps.Capabilities) -> None:
    """A PipeccError (one line) for a plan a technique's rule refuses on these capabilities
    (`pipecc.techniques.requires`: BPipe, UMPIPE, Bi-Partition, recomputation, replica
    groups, zero-bubble; `pipecc plan` never makes one, an edited plan.json can), then the
    rules that need the graph (`graph_requires`: BatchNorm in a recomputed stage or a Bi-Partition
    segment, tied weights across pieces) and the replicas' slices of the batch. (The one-process drop-in
    module runs Bi-Partition's forward ranges as stages and lets autograd run every backward in
    place: the same numbers, no messages to ship.)"""
    # NOTE: the replica groups are every plan's structure (a group of one without the technique,
    # for which `replica_problem` says None), as in the runtime that asks it again with `-m N`
    from pipecc.techniques.replicas.rows import replica_problem
    why = techniques.requires(plan, capabilities) or graph_requires(graph, plan)
    if why is None and isinstance(plan.replicas, int):
        why = replica_problem(plan.batch_size, plan.microbatches, plan.replicas)
        why = why and why.replace("use --microbatches", "plan with --microbatches")
    if why is not None:
        raise PipeccError(why)


def graph_requires(graph: AnnotatedGraph, plan: Plan) -> str | None:
    """The first reason of the rules that need the graph, or None: for each technique `plan` uses,
    in `TECHNIQUES` order, its planner part's optional `graph_requires(graph, plan)` (a `search`
    or `plan` part: beside the search, which asks it too)."""
    # NOTE: Bi-Partition's (before recomputation's in TECHNIQUES) and recomputation's never both
    # answer: Bi-Partition's `requires`, asked first, refuses a plan that also recomputes
    holders = {part.__name__.rpartition(".")[0]: part for layer in PLANNER_PARTS
               for part in techniques.parts(layer) if hasattr(part, "graph_requires")}
    for technique in techniques.TECHNIQUES:
        part = holders.get(technique.__name__)
        if part is not None and technique.uses(plan):
            why = part.graph_requires(graph, plan)
            if why is not None:
                return why
    return None


def capabilities_of(backends: Sequence[Backend], in_process: bool = False) -> caps.Capabilities:
    """What every one of `backends` executes (their compiled folders', or with `in_process`
    their drop-in modules')."""
    run = frozenset(caps.ALL)
    for b in backends:
        run &= b.module_capabilities if in_process else b.capabilities
    return caps.DROP_IN if in_process and run == caps.IN_PROCESS else (
        caps.COMPILED if run == caps.COMPILED_FOLDER else caps.Capabilities(runtime=run))


def trainable(graph: AnnotatedGraph) -> bool:
    """Whether training changes anything: a parameter that requires a gradient."""
    return any(info.requires_grad for node in graph.gm.graph.nodes
               for _, info in node.meta.get(META_PARAMS, []))


def batchnorm_warning(graph: AnnotatedGraph, plan: Plan, strict: bool, *,
                       current_mode: bool = False, replicas: int = 1) -> str | None:
    """The BatchNorm warning, or None; with `strict` a PipeccError instead of the warning."""
    note = batchnorm_note(graph, plan, current_mode=current_mode, replicas=replicas)
    if note is None:
        return None
    if strict:
        raise PipeccError(strict_batchnorm_message(note, replicas))
    return batchnorm_message(note, replicas)


def separable(graph: AnnotatedGraph, plan: Plan, replicas: int) -> None:
    """Refuse (one line naming the node) a plan that splits the batch of a model whose nodes
    mix samples (`pipecc.passes.batchdim`); the finding is kept for the compiled folder
    (`pipecc.json`'s `batch_mixing`: `pipecc run -m N` asks it again)."""
    from pipecc.passes import batchdim
    from pipecc.runtime.loss_kinds import split_words
    found = batchdim.find_mixing(graph, training=plan.schedule != "inference")
    graph.gm.meta[batchdim.META_MIXING] = found
    split = split_words(plan.microbatches, replicas)
    if found is not None and split:
        raise PipeccError(found.message(split))


def strict_batchnorm_message(note: str, replicas: int = 1) -> str:
    return (f"strict_batchnorm: {note}, so its outputs would differ from the model's; use "
            f"microbatches=1{' and --replicas 1' if replicas > 1 else ''} (or eval mode)")


def batchnorm_message(note: str, replicas: int = 1) -> str:
    fix = "microbatches=1 and --replicas 1 give" if replicas > 1 else "microbatches=1 gives"
    return (f"{note} (as {'DDP without SyncBatchNorm and GPipe do' if replicas > 1 else 'GPipe does'}), so outputs and "
            f"running statistics differ from the unpipelined model's; {fix} equal outputs (with dropout "
            "too: more micro-batches draw its masks per micro-batch); strict_batchnorm refuses instead")
