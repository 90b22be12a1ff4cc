"""A technique's share of a rank's execution, behind one small protocol: the engine's handler
table beyond F, B and the messages.

Each technique package's runtime part (``pipecc.techniques.<name>.runtime``) defines
``handler(parts) -> Handler``; the engine (`pipecc.runtime.engine.PipelineRuntime`) builds one
per technique with a runtime part (`pipecc.techniques.parts("runtime")`, in `TECHNIQUES` order),
runs every action kind a handler claims (`kinds`) through its `run`, and calls every handler's
hooks around a step, in that order:

    reset(schedule, row, training)   before a step's row runs (the schedule: the one it runs)
    before(action)                   before each action of the row
    run(action, training)            an action of one of its `kinds`
    capture(stage, mb, module)       a context F runs in (None: none), e.g. saved-tensor hooks
    backward_done(stage, mb)         after B of (stage, mb)
    after(action, releases)          after each action; True when it keeps `releases` (the sends the
                                     action proves complete) to release itself, else the engine does
    leftover                         what it still holds after the row (a schedule's bug)
    finish_step(trace)               after the row, before the caller's optimizer step
    after_optimizer_step()           after the caller's optimizer step
    forget_groups()                  process groups destroyed: drop references to them

and the stage runners (`pipecc.runtime.stage_runner`, which find the handlers in their
`RankContext.handlers`) ask them, the first answer other than None counting (`first_answer`):

    forward_leaves(stage, mb, training)   F's input leaves of (stage, mb) when the technique
                                     supplies them (UMPIPE's re-sliced chunks), else None
    input_grads(stage, mb)           after B of (stage, mb): [(upstream chunk, its input
                                     gradients), ...] when the technique decides what is handed
                                     down (UMPIPE's completed chunks), else None

Every hook does nothing by default, so a handler writes only the ones it needs.

Before the rank's context and runners exist, the engine asks the runtime part's module-level
functions, each optional, in `TECHNIQUES` order (`setup`):

    check(schedule, modules, ports, replicas)   refuse what the rank cannot run (one-line
                                     PipeccError); before the process group is joined
    lowering(stage_ids, modules) -> dict        keyword arguments the technique adds to the
                                     rank's `pipecc.ir.schedule.lower` (Bi-Partition's
                                     `refresh_stages`)
    stage_runner(module) -> type | None         the `StageRunner` class that runs a stage
                                     module of the technique's (Bi-Partition's workers), else None

and, once the rank's runtime is built, `pipecc.runtime.distributed.DistributedPipeline`
(`pipecc.load`'s pipeline) asks:

    check_precision(precision, modules)         refuse mixed precision (`RunConfig.precision`,
                                     not None) on a rank whose stage modules cannot run under it
                                     (Bi-Partition's workers; one-line PipeccError)

The compiled-folder loader asks the runtime part, each optional (`pipecc.techniques.first_answer`: the first
answer other than None; `setup`: every part's); the folder's facts in pipecc.json
(``folder_sizes``, ``folder_balancing``) are the techniques' torch-free ``folder`` parts'
(`pipecc.runtime.folder.CompiledFolder.sizes_for`, `CompiledFolder.activation_balancing`):
    load_stage(folder, module, ports) -> module | None   the stage module of the technique's
                                     built around the generated `module` of a stage folder whose
                                     `ports` ask for it (Bi-Partition's workers:
                                     `pipecc.runtime.stagefile.load_stage`), else None
    one_process(modules)             before `pipecc.load` runs the loaded stage modules in one
                                     process (Bi-Partition: each replica becomes its owner's module)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from pipecc.ir.schedule.actions import Action, ActionKind, Schedule

__all__ = ["Handler", "RankParts", "captured", "first_answer", "setup"]


@dataclass(frozen=True)
class RankParts:
    """What a technique's handler is built from: the rank (its context: schedule, wire,
    mailbox, replicas, ...), its stage runners, and how the run talks (the per-wait timeout;
    NCCL or gloo)."""
    ctx: Any                          # `pipecc.runtime.context.RankContext` (not imported: it imports the parts)
    runner: Callable[[int], Any]      # stage -> its `StageRunner`
    runners: Sequence[Any]            # this rank's runners, in stage order
    timeout_s: float
    nccl: bool


class Handler:
    """The protocol (module docstring), with hooks that do nothing."""

    kinds: tuple[ActionKind, ...] = ()

    def run(self, action: Action, training: bool) -> None:
        raise NotImplementedError(f"{type(self).__name__} claims {action.kind.name} but runs nothing")

    def reset(self, schedule: Schedule, row: Sequence[Action], training: bool) -> None:
        pass

    def before(self, action: Action) -> None:
        pass

    def capture(self, stage: int, microbatch: int, module: Any) -> contextlib.AbstractContextManager | None:
        return None

    def backward_done(self, stage: int, microbatch: int) -> None:
        pass

    def after(self, action: Action, releases: list[Action]) -> bool:
        return False

    @property
    def leftover(self) -> list:
        return []

    def finish_step(self, trace: Any) -> None:
        pass

    def after_optimizer_step(self) -> None:
        pass

    def forget_groups(self) -> None:
        pass

    def forward_leaves(self, stage: int, microbatch: int, training: bool) -> list[Any] | None:
        return None

    def input_grads(self, stage: int, microbatch: int) -> list[tuple[int, list]] | None:
        return None


def first_answer(handlers: Sequence[Handler], hook: str, *args: Any) -> Any:
    """The first answer other than None of the handlers' `hook` on `args`, or None."""
    for handler in handlers:
        answer = getattr(handler, hook)(*args)
        if answer is not None:
            return answer
    return None


def setup(parts: Sequence[ModuleType], hook: str, *args: Any) -> list[Any]:
    """The answers of every runtime part that defines the module-level `hook`, in order."""
    return [getattr(part, hook)(*args) for part in parts if hasattr(part, hook)]



def captured(handlers: Sequence[Handler], stage: int, microbatch: int,
             module: Any) -> contextlib.AbstractContextManager | None:
    """The context F of (stage, microbatch) runs in: every handler's `capture`, nested (None: none)."""
    contexts = [c for h in handlers if (c := h.capture(stage, microbatch, module)) is not None]
    if len(contexts) <= 1:
        return contexts[0] if contexts else None
    stack = contextlib.ExitStack()

    @contextlib.contextmanager
    def nested() -> Any:
        with stack:
            for c in contexts:
                stack.enter_context(c)
            yield
    return nested()
