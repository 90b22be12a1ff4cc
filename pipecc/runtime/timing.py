"""Measured times of a run (``pipecc run --json``): each stage's forward and backward per
micro-batch, each rank's receive waits, the step time; next to the plan's predictions.

``ActionTimer`` is what the engine calls around every schedule action (``PipelineRuntime.timer``):
F and B are timed around their compute (on CUDA the stream is synchronised before and after,
so the time is the kernels', not their launch), RECV_F/RECV_B as time blocked waiting for the
peer. A zero-bubble schedule's I and W are timed alike and count together as the micro-batch's
backward (one ``backward_s`` sample when its W ends). Only actions inside a step the caller marked (``begin_step`` .. ``end_step``) after the
first ``warmup_steps`` count: start-up, allocator growth and ``--verify``'s comparison stay out
of the statistics (the verifier's own passes run outside any step).

At the end every rank's ``ActionTimer.summary()`` is gathered to one rank (``gather``, as JSON
over the run's process group) and ``run_document`` turns them, with ``plan.json`` read as plain JSON (the
runtime never imports the compiler), into the one document ``pipecc run --json`` prints::

    {"format": "pipecc-run", "version": 1, "schedule", "microbatches", "batch_size", "steps",
     "warmup_steps", "step_s": {"median", "all"}, "predicted_step_s", "memory_source", "samples_per_s",
     "stages": [{"index", "rank", "replica", "device", "forward_s", "backward_s", "forward_samples",
                 "backward_samples", "predicted_forward_s", "predicted_backward_s", "comm_wait_s", "host_s",
                 "peak_memory_bytes", "peak_memory_at", "static_memory_bytes", "predicted_peak_memory_bytes"}],
     "plan": {"model", "model_sha256", "model_args", "batch_size", "microbatches", "schedule",
              "devices": [name], "sha256", "stages": [{"index", "device", "nodes", "backward_nodes",
              "forward_s", "backward_s", "fixed_forward_s", "fixed_backward_s", "host_forward_s",
              "host_backward_s", "step_s"}],
              "profile", "calibration"} | null}

``plan`` (``plan_identity``) identifies the plan that ran, for ``pipecc plan/compile --calibrate
RUN.json`` (``pipecc.targets.calibrated``): the model (name, the file's sha256 and the model
arguments ``pipecc.json`` recorded), the plan's devices in plan order, plan.json's sha256, each
stage's nodes with its predicted times and their fixed parts (0.0 where plan.json has none) and
the cost model's basis (``options.profile``: the profile file's name, null for the roofline) and
the calibration factors the plan was made with (``options.calibration``, null when none); null
where the folder has no ``plan.json``.

One row per stage and rank: with replicated stages (PP x DP, ``pipecc.techniques.replicas.runtime``) every
replica of a stage has its row, ``rank`` the process's global rank, ``device`` the plan's device
of that rank and ``replica`` its index in the stage's group (0 in every row of a plain pipeline).

Memory (``--memory``, ``pipecc.runtime.memory``, which describes the four fields): the rank's
meter is told of every step (``begin_step``/``end_step``) and of every action (``during``: the
one a CPU peak is reached in); without ``--memory`` ``memory_source`` and the measured fields are
null and ``predicted_peak_memory_bytes`` is still plan.json's.

Statistics are medians (robust to the odd descheduled action on a shared machine). The step
time of step i is the longest of the ranks' own wall times of step i (from ``zero_grad`` to
``optimizer.step`` on each rank, no barrier: coupled by their messages, every rank's iteration
takes the pipeline's period in steady state). ``comm_wait_s`` is the median over timed steps of
the rank's total receive wait in the step; a rank holding several stages (interleaved) reports
the same figure for each of them. ``host_s`` is, per micro-batch, what is left of the rank's
median step time after its timed forward/backward actions and its receive waits: the host work
no stage timer covers (posting sends, the engine's loop, the optimizer step and zero_grad),
spread over the rank's micro-batches (the same figure in each row of a rank). It is where a
step measures longer than its stages and waits add up to. With activation balancing (BPipe,
``pipecc.techniques.bpipe.runtime_stash``) every row also has ``stash_evictions`` and ``stash_evicted_bytes``, per timed step: how many
micro-batches' saved activations the stage sent to its partner, and their bytes. A forward-only
run reports backward 0.0 with 0 samples.
Predictions are the plan's, per micro-batch of the compiled micro-batch count, less the host
part a calibrated plan holds (``host_forward_s``/``host_backward_s``: no stage timer covers it)
(a run with
another ``--microbatches`` splits the batch differently than the plan assumed); null where the
folder has no ``plan.json``. With unequal micro-batches (``pipecc.json``'s ``microbatch_sizes``)
a stage's chunks differ in size, so its medians mix sizes, and ``microbatches`` is the most
chunks of any stage.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipecc.ir.schedule.actions import Action, ActionKind
from pipecc.ir.schedule.registry import SPLIT_BACKWARD_COST, ZERO_BUBBLE
from pipecc.runtime import wire

__all__ = ["ActionTimer", "gather", "plan_identity", "read_plan", "run_document"]

FORMAT, VERSION = "pipecc-run", 1


class ActionTimer:
    """One rank's timings; the engine calls ``run`` for every action (see the module docstring)."""

    def __init__(self, rank: int, device: torch.device, warmup_steps: int = 1, replica: int = 0):
        self.rank, self.device, self.warmup_steps, self.replica = rank, device, warmup_steps, replica
        self.forward: dict[int, list[float]] = {}  # stage -> seconds per micro-batch, timed steps
        self.backward: dict[int, list[float]] = {}
        self.step_s: list[float] = []  # this rank's wall time of each timed step
        self.recv_wait_s: list[float] = []  # this rank's total receive wait in each timed step
        self.steps_done = 0  # steps ended, warm-up included
        self._counting = False  # inside a timed step
        self._wait = 0.0
        self._input_s: dict[tuple[int, int], float] = {}  # zero-bubble I times awaiting their W
        self.evicted: dict[int, list[int]] = {}  # BPipe: stage -> bytes of each eviction, timed steps
        self.memory: Any = None  # --memory: a pipecc.runtime.memory meter, told of every timed step

    def begin_step(self) -> None:
        self._counting = self.steps_done >= self.warmup_steps
        self._wait = 0.0
        if self.memory is not None:
            self.memory.begin_step(self._counting)

    def end_step(self, wall_s: float) -> None:
        """End the step begun last; ``wall_s`` is its wall time as the caller measured it."""
        if self._counting:
            self.step_s.append(wall_s)
            self.recv_wait_s.append(self._wait)
        if self.memory is not None:
            self.memory.end_step()
        self._counting = False
        self.steps_done += 1

    def run(self, action: Action, execute: Callable[[], None]) -> None:
        """``execute()`` the action, timing it when it is a compute or a receive of a timed step."""
        if self.memory is not None:  # the action a new peak happens in (pipecc.runtime.memory)
            execute = self.memory.during(action, execute)
        kind = action.kind
        if not self._counting or not (kind.is_compute or kind.is_recv):
            execute()
            return
        compute = kind.is_compute
        if compute:
            self._sync()
        start = time.perf_counter()
        execute()
        if compute:
            self._sync()
        elapsed = time.perf_counter() - start
        if kind is ActionKind.F:
            self.forward.setdefault(action.stage, []).append(elapsed)
        elif kind is ActionKind.B:
            self.backward.setdefault(action.stage, []).append(elapsed)
        elif kind is ActionKind.I:  # NOTE: its W completes the sample (I + W = one backward)
            self._input_s[(action.stage, action.microbatch)] = elapsed
        elif kind is ActionKind.W:
            before = self._input_s.pop((action.stage, action.microbatch), 0.0)
            self.backward.setdefault(action.stage, []).append(before + elapsed)
        else:
            self._wait += elapsed

    def note_eviction(self, stage: int, nbytes: int) -> None:
        """BPipe: the engine evicted ``nbytes`` of ``stage``'s saved activations (SEND_S)."""
        if self._counting:
            self.evicted.setdefault(stage, []).append(nbytes)

    def _sync(self) -> None:
        # NOTE: CUDA kernels run asynchronously; without a sync the time would be their launch
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def summary(self, stage_ids: Sequence[int]) -> dict[str, Any]:
        """Plain data (to gather): this rank, its stages' samples, its step and wait times."""
        return {"rank": self.rank, "replica": self.replica, "stages": list(stage_ids),
                "forward": [self.forward.get(s, []) for s in stage_ids],
                "backward": [self.backward.get(s, []) for s in stage_ids],
                "step_s": self.step_s, "recv_wait_s": self.recv_wait_s,
                "evicted": [self.evicted.get(s, []) for s in stage_ids],
                "memory": self.memory.summary() if self.memory is not None else None,
                "warmup": min(self.warmup_steps, self.steps_done)}


def gather(summary: dict[str, Any], dst: int, device: torch.device) -> list[dict[str, Any]] | None:
    """Every rank's ``summary`` on rank ``dst`` (None elsewhere); collective over the run's
    process group when there is one, else just this one.

    NOTE: as JSON in uint8 tensors, not ``gather_object``: like the wire's object ports, a peer's
    message is never unpickled. All-gathers (lengths, then padded payloads) work on gloo and NCCL.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [summary]
    world = dist.get_world_size()
    data = torch.frombuffer(bytearray(json.dumps(summary).encode()), dtype=torch.uint8).to(device)
    length = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    lengths = [torch.zeros_like(length) for _ in range(world)]
    wire.all_gather(lengths, length)
    longest = max(int(n.item()) for n in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:data.numel()] = data
    payloads = [torch.zeros_like(padded) for _ in range(world)]
    wire.all_gather(payloads, padded)
    if dist.get_rank() != dst:
        return None
    return [json.loads(bytes(p[:int(n.item())].cpu().tolist()).decode()) for p, n in zip(payloads, lengths)]


def read_plan(out: Path) -> dict[str, Any]:
    """``OUT/plan.json`` as plain JSON ({} when missing or unreadable: predictions are then null;
    ``pipecc.runtime.folder.plan_json``, which ``CompiledFolder.plan`` reads it with)."""
    from pipecc.runtime.folder import plan_json
    return plan_json(Path(out))


def plan_identity(out: Path, plan: dict[str, Any]) -> dict[str, Any] | None:
    """The run document's ``plan``: what identifies the plan that ran (module docstring); None
    without a plan. Reads ``OUT/pipecc.json`` for the model file's sha256 and arguments."""
    if not plan:
        return None
    from pipecc.runtime.folder import CompiledFolder
    # the folder's facts (micro-batches: pipecc.json's, which plan.json repeats); {} when unreadable
    folder = CompiledFolder.peek(out) or CompiledFolder(Path(out), {})
    marker, digest = folder.marker, folder.plan_sha256
    stages = []
    for st in plan.get("stages") or []:
        if not isinstance(st, dict):
            continue
        stages.append({"index": st.get("index"), "device": st.get("device"),
                       "nodes": list(st.get("nodes") or []), "backward_nodes": list(st.get("backward_nodes") or []),
                       "forward_s": _number(st.get("forward_s")), "backward_s": _number(st.get("backward_s")),
                       "fixed_forward_s": _number(st.get("fixed_forward_s")) or 0.0,
                       "fixed_backward_s": _number(st.get("fixed_backward_s")) or 0.0,
                       "host_forward_s": _number(st.get("host_forward_s")) or 0.0,
                       "host_backward_s": _number(st.get("host_backward_s")) or 0.0,
                       "step_s": _number(st.get("step_s")) or 0.0})
    devices = [str(d.get("name", "")) if isinstance(d, dict) else "" for d in plan.get("devices") or []]
    options = plan.get("options") if isinstance(plan.get("options"), dict) else {}
    return {"model": marker.get("model", plan.get("model")), "model_sha256": marker.get("model_sha256"),
            "model_args": marker.get("model_args", plan.get("model_args", {})),
            "batch_size": plan.get("batch_size"), "microbatches": folder.microbatches,
            "schedule": plan.get("schedule"), "devices": devices, "sha256": digest, "stages": stages,
            "profile": options.get("profile"), "calibration": options.get("calibration")}


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _integer(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _rank_peak(plan_stages: dict[Any, dict[str, Any]], stage_ids: Sequence[int]) -> int | None:
    """The plan's peak memory of what one rank holds: plan.json's ``peak_memory_bytes`` summed over
    the rank's stages (one stage: its own; interleaved: each stage's share of the device); None
    where the plan has none."""
    peaks = [_integer(plan_stages.get(s, {}).get("peak_memory_bytes")) for s in stage_ids]
    return None if not peaks or any(p is None for p in peaks) else sum(peaks)  # type: ignore[misc]


def _less(value: float | None, part: Any) -> float | None:
    """`value` less a plan's host part (``host_forward_s``/``host_backward_s``, 0 where absent)."""
    return None if value is None else value - (_number(part) or 0.0)


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def _host_s(summary: dict[str, Any], wait: float, timed: int) -> float:
    """Per micro-batch, the rank's step time outside its stages' timed actions and its receive
    waits (module docstring: ``host_s``); 0.0 without timed steps."""
    if not summary["step_s"]:
        return 0.0
    count = sum(len(f) for f in summary["forward"]) / timed  # micro-batches per step, all its stages
    busy = sum(_median(f) * len(f) + _median(b) * len(b)
               for f, b in zip(summary["forward"], summary["backward"])) / timed
    return max(0.0, _median(summary["step_s"]) - wait - busy) / count if count > 0 else 0.0


def run_document(summaries: Sequence[dict[str, Any]], plan: dict[str, Any], schedule: str, microbatches: int,
                 batch_size: int, stash: bool = False, identity: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``pipecc run --json`` document from every rank's ``summary`` and the plan;
    ``identity`` is its ``plan`` (``plan_identity``)."""
    steps = min((len(s["step_s"]) for s in summaries), default=0)
    step_s = [max(s["step_s"][i] for s in summaries) for i in range(steps)]
    median = _median(step_s)
    plan_stages = {st.get("index"): st for st in plan.get("stages") or [] if isinstance(st, dict)}
    split = SPLIT_BACKWARD_COST if schedule in ZERO_BUBBLE else 1.0  # I + W, as the planner prices them
    devices = plan.get("devices") or []
    stages = []
    for summary in summaries:
        wait = _median(summary["recv_wait_s"])
        evicted = summary.get("evicted") or [[] for _ in summary["stages"]]
        timed = max(len(summary["step_s"]), 1)
        host = _host_s(summary, wait, timed)
        memory = summary.get("memory") or {}
        for s, forward, backward, moved in zip(summary["stages"], summary["forward"], summary["backward"], evicted):
            planned = plan_stages.get(s, {})
            replica = int(summary.get("replica", 0))
            group = planned.get("replica_devices") or []
            index = group[replica] if isinstance(group, list) and replica < len(group) else planned.get("device")
            device = devices[index] if isinstance(index, int) and 0 <= index < len(devices) else {}
            row = {
                "index": s, "rank": summary["rank"], "replica": replica,
                "device": str(device.get("name", "")) if isinstance(device, dict) else "",
                "forward_s": _median(forward), "backward_s": _median(backward),
                "forward_samples": len(forward), "backward_samples": len(backward),
                # NOTE: the timers do not cover the host part the plan holds (host_*_s)
                "predicted_forward_s": _less(_number(planned.get("forward_s")), planned.get("host_forward_s")),
                "predicted_backward_s": _scaled(_less(_number(planned.get("backward_s")),
                                                      planned.get("host_backward_s")), split),
                "comm_wait_s": wait, "host_s": host,
                # pipecc.runtime.memory: the rank's measured peak (null without --memory) and the plan's
                "peak_memory_bytes": memory.get("peak_bytes"), "peak_memory_at": memory.get("peak_at"),
                "static_memory_bytes": memory.get("static_bytes"),
                "predicted_peak_memory_bytes": _rank_peak(plan_stages, summary["stages"])}
            if stash:  # BPipe
                row.update(stash_evictions=len(moved) / timed, stash_evicted_bytes=sum(moved) / timed)
            stages.append(row)
    stages.sort(key=lambda st: (st["index"], st["replica"]))
    return {"format": FORMAT, "version": VERSION, "schedule": schedule, "microbatches": microbatches,
            "batch_size": batch_size, "steps": steps, "warmup_steps": max(s["warmup"] for s in summaries),
            "step_s": {"median": median, "all": step_s},
            "predicted_step_s": _number(plan.get("predicted_iteration_s")),
            "memory_source": next((s["memory"].get("source") for s in summaries if s.get("memory")), None),
            "samples_per_s": batch_size / median if median > 0 else 0.0,
            "stages": stages, "plan": identity}
