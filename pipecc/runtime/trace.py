"""The measured timeline of a run (``pipecc run OUT --trace trace.json``): every schedule action
each rank executed, as it ran, written as one Chrome/Perfetto trace.

``TraceRecorder`` is what the engine calls around every action when tracing
(``PipelineRuntime.timer``; it passes each action on to ``--json``'s ``ActionTimer`` when both are
asked for). Off, the engine's one ``timer is None`` branch per action is the whole cost. On, each
action of a step (``begin_step`` .. ``end_step``, every step of the run, the warm-up ones
included and marked) is one event: its start and end from ``time.perf_counter_ns``; on CUDA the
stream is synchronised around F, B, I and W (as ``--json`` does), so a compute event is its
kernels' time. What each kind's event measures:

    F B I W                 the compute (I and W: a zero-bubble schedule's split backward)
    RECV_F RECV_B RECV_*    the time blocked in the receive ("recv wait"): posting, waiting, unpacking
    SEND_F SEND_B SEND_*    posting the send (the wire's sends are asynchronous; bytes in args)
    REDUCE                  completing the replicas' gradient all-reduce launch (PP x DP)
    all-reduce wait         the step's wait for its all-reduces, before the optimizer step
    optimizer               the optimizer step (and Bi-Partition's refresh) after the pipeline's step
    step i                  the step on its own track (args: step, warmup)

Clocks. After the process group exists every rank passes one barrier and reads
``perf_counter_ns`` (``align``). The merged trace puts every rank on one time axis:
when every rank ran on one host, perf_counter is that host's CLOCK_MONOTONIC, shared by its
processes, so the ranks' own readings are used as they are (exact; ``clock: "shared"``) and the
spread of the barrier readings is reported (``barrier_skew_us``, what barrier alignment would
have cost). On several hosts each rank's clock starts at its barrier reading (``clock:
"barrier"``): the error is the barrier's exit skew, about one message latency.

At the end (``write``) every rank's events are gathered to global rank 0 over the run's process
group (``timing.gather``: JSON, never pickle), which writes the trace atomically (a temporary
file beside it, then a rename): a run that fails leaves no trace file. The document::

    {"traceEvents": [{"name", "cat", "ph": "X", "ts" (µs), "dur" (µs), "pid": global rank,
                      "tid": stage | 1000 (comm) | 1001 (steps),
                      "args": {"action", "stage", "microbatch", "step", "bytes"}} ..., metadata "M"],
     "displayTimeUnit": "ms",
     "otherData": {"format": "pipecc-trace", "version": 1, "schedule", "num_ranks" (pipeline ranks),
                   "replicas", "num_stages", "microbatches", "steps", "warmup_steps", "clock",
                   "barrier_skew_us", "ranks": [{"rank", "pipeline_rank", "replica", "stages", "host"}]}}

``pipecc inspect OUT --trace trace.json`` (``pipecc.report.measured``) reads it back.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipecc.runtime.launch_checks import check_trace_path  # noqa: F401  (torch-free: the launcher checks it)
from pipecc.ir.schedule.actions import Action, ActionKind

__all__ = ["COMM_TID", "FORMAT", "STEP_TID", "TraceRecorder", "check_trace_path", "chrome_trace"]

FORMAT, VERSION = "pipecc-trace", 1
COMM_TID, STEP_TID = 1000, 1001  # the tracks besides the stages' own
# NOTE: sets, not ActionKind's properties: run() is on every action's path (bench/bench_trace.py)
_COMPUTE = frozenset(k for k in ActionKind if k.is_compute)
_SENDS = frozenset((ActionKind.SEND_F, ActionKind.SEND_B))
_RECVS = frozenset((ActionKind.RECV_F, ActionKind.RECV_B))


class TraceRecorder:
    """One rank's events; ``ctx`` is its ``RankContext`` (``pipecc.runtime.context``, the runtime's
    ``ctx``: the message bytes in its mailbox, the device and the ranks), ``inner`` an
    ``ActionTimer`` every action also runs through (``--json``), or None."""

    def __init__(self, ctx: Any, warmup_steps: int, inner: Any = None):
        self.ctx, self.warmup_steps, self.inner = ctx, warmup_steps, inner
        self.events: list[tuple[Action, int, int, int, int | None]] = []  # (action, step, start, end, bytes)
        self.spans: list[tuple[str, str, int, int, int, dict[str, Any]]] = []  # (name, cat, tid, start, end, args)
        self._cuda = ctx.device.type == "cuda"
        self.step = -1
        self._on = False  # inside a step
        self._step_start = 0
        self._bytes: int | None = None  # BPipe's eviction bytes, noted during its SEND_S
        self.origin_ns = time.perf_counter_ns()
        self.host = socket.gethostname()

    def align(self) -> None:
        """The common origin: one barrier over the run's process group, then this rank's reading
        (collective: every rank calls it once, before the first step)."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
        self.origin_ns = time.perf_counter_ns()

    # -- what the engine and the training loop call ------------------------------------------

    def begin_step(self) -> None:
        if self.inner is not None:
            self.inner.begin_step()
        self.step += 1
        self._on = True
        self._step_start = time.perf_counter_ns()

    def end_step(self, wall_s: float) -> None:
        if self.inner is not None:
            self.inner.end_step(wall_s)
        self._on = False
        self.spans.append((f"step {self.step}", "step", STEP_TID, self._step_start, time.perf_counter_ns(),
                           {"step": self.step, "warmup": self.step < self.warmup_steps}))

    def run(self, action: Action, execute: Callable[[], None]) -> None:
        """``execute()`` the action (through ``inner`` when set), recording it inside a step."""
        if not self._on:
            self._execute(action, execute)
            return
        kind = action.kind
        nbytes = self._outbox_bytes(action) if kind in _SENDS else None
        sync = self._cuda and kind in _COMPUTE
        if sync:
            self._sync()
        self._bytes = None
        start = time.perf_counter_ns()
        if self.inner is None:
            execute()
        else:
            self.inner.run(action, execute)
        if sync:
            self._sync()
        end = time.perf_counter_ns()
        if kind in _RECVS:
            nbytes = self._inbox_bytes(action)
        elif self._bytes is not None:
            nbytes = self._bytes
        self.events.append((action, self.step, start, end, nbytes))

    def span(self, name: str, cat: str, execute: Callable[[], Any]) -> Any:
        """Run ``execute()`` (work outside the schedule's actions: the all-reduce wait, the
        optimizer step) as an event on the comm track when inside a step."""
        if not self._on:
            return execute()
        start = time.perf_counter_ns()
        result = execute()
        self.spans.append((name, cat, COMM_TID, start, time.perf_counter_ns(), {"step": self.step}))
        return result

    def note_eviction(self, stage: int, nbytes: int) -> None:
        """BPipe: the bytes of the SEND_S running now (and ``--json``'s count)."""
        if self.inner is not None:
            self.inner.note_eviction(stage, nbytes)
        self._bytes = nbytes

    def summary(self, stage_ids: Any) -> dict[str, Any]:
        return self.inner.summary(stage_ids)

    # -- the end of the run ---------------------------------------------------------------------

    def payload(self) -> dict[str, Any]:
        """This rank's events as plain data (to gather)."""
        ctx = self.ctx
        return {"rank": ctx.global_rank, "pipeline_rank": ctx.rank, "replica": ctx.replicas.index,
                "stages": list(ctx.stage_ids), "host": self.host, "origin_ns": self.origin_ns,
                "events": sorted([[*_event(*e)] for e in self.events] + [list(e) for e in self.spans],
                                 key=lambda e: e[3])}  # by start: each track in time order

    def write(self, path: Path, schedule: str) -> None:
        """Gather every rank's events to global rank 0, which writes the Chrome trace to ``path``
        atomically (collective: every rank calls it)."""
        from pipecc.runtime.timing import gather  # NOTE: gather's JSON over the process group
        ctx = self.ctx
        payloads = gather(self.payload(), 0, ctx.device)
        if payloads is None:
            return
        meta = {"schedule": schedule, "num_ranks": ctx.world, "replicas": ctx.replicas.count,
                "num_stages": ctx.schedule.num_stages, "microbatches": ctx.m, "steps": self.step + 1,
                "warmup_steps": min(self.warmup_steps, self.step + 1)}
        text = json.dumps(chrome_trace(payloads, meta))
        from pipecc.runtime import outfile  # checked with the run's inputs and --force before it started
        outfile.write(path, text, "--trace", force=True)

    def _execute(self, action: Action, execute: Callable[[], None]) -> None:
        if self.inner is None:
            execute()
        else:
            self.inner.run(action, execute)

    def _outbox_bytes(self, a: Action) -> int | None:
        values = self.ctx.mailbox.outbox.get(("F" if a.kind is ActionKind.SEND_F else "B", a.stage, a.microbatch))
        return _nbytes(values)

    def _inbox_bytes(self, a: Action) -> int | None:
        values = self.ctx.mailbox.inbox.get(("F" if a.kind is ActionKind.RECV_F else "B", a.stage, a.microbatch))
        return _nbytes(values)

    def _sync(self) -> None:
        # NOTE: CUDA kernels run asynchronously; without a sync the event would be their launch
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)


def _event(action: Action, step: int, start: int, end: int, nbytes: int | None) -> tuple:
    """An action's record as (name, cat, tid, start, end, args)."""
    kind = action.kind
    compute = kind in _COMPUTE
    cat = "compute" if compute else "recv wait" if kind.is_recv else "send" if kind.is_send else (
        "all-reduce" if kind is ActionKind.REDUCE else "comm")
    args: dict[str, Any] = {"action": kind.value, "stage": action.stage, "microbatch": action.microbatch,
                            "step": step}
    if nbytes is not None:
        args["bytes"] = nbytes
    name = kind.value if action.microbatch < 0 else f"{kind.value} mb {action.microbatch}"
    return name, cat, action.stage if compute else COMM_TID, start, end, args


def _nbytes(values: Any) -> int | None:
    if values is None:
        return None
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


def chrome_trace(payloads: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """The Chrome trace of every rank's ``payload`` (see the module docstring for the clocks)."""
    shared = len({p["host"] for p in payloads}) == 1
    origins = [p["origin_ns"] for p in payloads]
    zero = min(origins)
    events: list[dict[str, Any]] = []
    for p in sorted(payloads, key=lambda p: p["rank"]):
        base = zero if shared else p["origin_ns"]
        pid = p["rank"]
        label = f"rank {pid}" + (f" (pipeline rank {p['pipeline_rank']}, replica {p['replica']})"
                                 if meta.get("replicas", 1) > 1 else "")
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": label}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        for tid, name in [*((s, f"stage {s}") for s in p["stages"]), (COMM_TID, "comm"), (STEP_TID, "steps")]:
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
        for name, cat, tid, start, end, args in p["events"]:
            events.append({"name": name, "cat": cat, "ph": "X", "ts": (start - base) / 1e3,
                           "dur": (end - start) / 1e3, "pid": pid, "tid": tid, "args": args})
    other = {"format": FORMAT, "version": VERSION, **meta, "clock": "shared" if shared else "barrier",
             "barrier_skew_us": (max(origins) - zero) / 1e3 if shared else None,
             "ranks": [{"rank": p["rank"], "pipeline_rank": p["pipeline_rank"], "replica": p["replica"],
                        "stages": p["stages"], "host": p["host"]} for p in sorted(payloads, key=lambda p: p["rank"])]}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}
