"""Discrete-event simulation of a pipeline schedule under given stage costs.

Input: a ``pipecc.ir.schedule.Schedule`` (validated here first) and ``StageCosts`` (seconds
and bytes per stage and microbatch). Output: a ``Timeline`` with one ``Event`` per
action, the makespan, the bubble fraction, busy time and peak memory per rank.

Model:
- Each rank executes its actions in order, one compute (F/B/I/W) at a time. A zero-bubble
  schedule's I costs ``backward_input_s`` and its W ``backward_weight_s`` (each half of
  ``backward_s`` when not given); its I, like a B, produces the gradient stage s-1 needs.
- F of (s, mb) needs the output of F(s-1, mb): local if stage s-1 is on the same rank,
  otherwise delivered by a transfer. B of (s, mb) needs F(s, mb) and the gradient of
  B(s+1, mb), likewise local or transferred.
- A SEND starts a transfer on the directed link (src rank, dst rank) as soon as the rank
  reaches it and the link is free (one transfer at a time per direction, FIFO); the data
  is at the receiver when the transfer ends. With ``overlap_comm=True`` (default,
  NCCL-style async) the sender goes on at once; with ``False`` the sender is occupied
  until the transfer ends. A RECV blocks its rank until the data has arrived. This is
  the runtime's machine (``pipecc.runtime.wire``: ``isend``, one process group per
  direction, receives that wait); the partitioner's bottleneck is this simulator's
  steady-state time per micro-batch under 1F1B (``passes.partition``, checked by
  tests/test_comm_model.py): a transfer hides behind other micro-batches' compute, but not
  behind the round trip of its own micro-batch.
- Memory on a rank: static bytes of its stages plus the activations stashed from the
  start of each F until the end of its B (or W), or, when larger, what its optimizer step
  holds for a moment after the last backward (``step_bytes``, `passes.step_memory`). Forward-only schedules hold an activation only
  during its F. Compute on a rank is sequential, so walking the row in order gives the
  exact peak over time. A stage that recomputes its activations (activation checkpointing)
  stashes only its inputs from F to B (`activation_bytes`) and, during each B, also holds
  that micro-batch's re-created internal activations (`recompute_bytes`). An F (a B or I)
  also holds, while it runs, what it makes and drops before it ends (`forward_work_bytes`,
  `backward_work_bytes`: the forward's transient outputs, the backward's gradients). A SEND_B's
  input gradient (`input_grad_bytes`) is held until the receive after which the runtime drops it
  (``Schedule.send_release``, as `runtime.wire`) or the step ends (a stage's last sends stay).
- Unequal micro-batch sizes (UMPIPE, ``Schedule.microbatch_sizes``): cost rows are ragged,
  one entry per chunk of the stage (``forward_s[s]`` has ``len(sizes[s])`` entries), except
  ``send_backward_s[s]`` (s > 0), which has one entry per chunk of stage s-1: a gradient
  message carries an upstream chunk (``pipecc.ir.schedule``). F(s, k) waits for every chunk
  of s-1 overlapping its samples; B(s, k) for the gradient of its own chunk, which stage s+1
  sends once every chunk overlapping it has run its backward. Under GPipe row order this is
  the end-time recurrence of ``techniques.umpipe.search`` (tests/test_umpipe_plan.py checks both agree).
- BPipe (``Schedule.partner``, ``StageCosts.stash_transfer_s[evictor][mb]``): SEND_S and
  SEND_R occupy the pair's directed link like any send; RECV_S blocks the acceptor until the
  stash arrived; RECV_R is a prefetch (the evictor goes on, its B waits for the data). Peak
  memory then comes from a sweep over the event timeline (``_peak_memory_timeline``: a stash
  grows over its F, both ends hold a stash while it moves), not from the row walk.
- PP x DP (``StageCosts.allreduce_s``, per rank, optional): a rank whose stage runs on a
  replica group all-reduces its gradients once per iteration, launched during its last
  backward and overlapped with it (the runtime's post-accumulate-grad hooks); the rank
  ends at start(last B) + max(that B's seconds, allreduce_s). The all-reduce is no event
  and not busy time: an exposed all-reduce counts as bubble.

- Bi-Partition (``techniques.bipartition.search``, PAPERS-SPEC §3): forward and backward cut at
  different units, but worker order is the same in both directions, so forward stage s and
  backward stage s stay on one rank and the schedule and stage->rank map do not change;
  only the costs do: ``forward_s[s]`` is the FP range's, ``backward_s[s]`` the BP range's,
  the send times carry the misplaced segments' stashes, ``static_bytes`` the replicas, and
  ``tail_s[rank]`` (optional) is what a rank still sends after its last action (the replica
  refresh after the optimizer step): the iteration ends at the latest rank end + its tail.

Complexity: O(R * A) for R ranks and A actions in the worst case, O(A) in practice.
Pure Python; no torch.
"""

from __future__ import annotations

import bisect
import itertools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pipecc.ir.schedule.actions import Action, ActionKind, Schedule
from pipecc.ir.schedule.validate import validate
from pipecc.ir.schedule.progress import advance

__all__ = ["Event", "StageCosts", "Timeline", "simulate"]


@dataclass
class StageCosts:
    """Costs per (virtual) stage and microbatch: ``x[stage][microbatch]``.

    ``send_forward_s[s]`` is the transfer time of stage s's activation to stage s+1 and
    ``send_backward_s[s]`` that of stage s's input gradient to stage s-1; both are only
    used when the neighbour sits on another rank (0 for the last / first stage).
    ``backward_input_s`` and ``backward_weight_s`` are the two parts of a split backward
    (zero-bubble I and W actions); ``None`` means half of ``backward_s`` each (only
    zero-bubble schedules read them).
    """

    forward_s: list[list[float]]
    backward_s: list[list[float]]
    send_forward_s: list[list[float]]
    send_backward_s: list[list[float]]
    activation_bytes: list[list[float]]
    static_bytes: list[float]
    # [stage] bytes a recomputed stage re-creates during each B (its internal activations of
    # one micro-batch); [] or 0: the stage does not recompute
    recompute_bytes: list[float] = field(default_factory=list)
    backward_input_s: list[list[float]] | None = None
    backward_weight_s: list[list[float]] | None = None
    # I and W each cost this many times their share of B (1.0: the paper's split; the planner
    # passes pipecc.ir.schedule.SPLIT_BACKWARD_COST, what the runtime's split measured)
    split_cost: float = 1.0

    def split_backward_s(self, stage: int, microbatch: int) -> tuple[float, float]:
        """(I, W) seconds of a split backward of ``stage`` on ``microbatch``."""
        b = self.backward_s[stage][microbatch]
        i = self.backward_input_s[stage][microbatch] if self.backward_input_s is not None else None
        w = self.backward_weight_s[stage][microbatch] if self.backward_weight_s is not None else None
        k = self.split_cost
        if i is None and w is None:
            return k * b / 2, k * b / 2
        return k * (b - w if i is None else i), k * (b - i if w is None else w)
    # [rank] seconds of the rank's gradient all-reduce per iteration (replica groups); None: none
    allreduce_s: list[float] | None = None
    # [rank] seconds the rank still sends after its last action (Bi-Partition's replica
    # refresh after the optimizer step); None: none
    tail_s: list[float] | None = None
    # [rank] bytes the rank's optimizer step holds for a moment beyond static_bytes, after the
    # last backward (`passes.step_memory`); None: none
    step_bytes: list[float] | None = None
    # [stage] bytes alive only while its F (its B or I) runs, on top of what is stashed: the
    # forward's transient outputs (the last stage's model outputs before the loss), the
    # backward's gradient buffers (`Evaluator.simulate`); None: 0
    forward_work_bytes: list[float] | None = None
    backward_work_bytes: list[float] | None = None
    # [stage] bytes of the input gradient a SEND_B sends upstream, held from the send until a
    # later message from that peer proves it arrived (``Schedule.send_release``; None: 0)
    input_grad_bytes: list[float] | None = None
    # [stage] zero-bubble: bytes an I leaves for its W (the output gradients of the stage's
    # weight-bearing nodes, which W starts from: `pipecc.techniques.zero_bubble.runtime`), held from the end of
    # the I to the end of the W; None: 0
    weight_grad_bytes: list[float] | None = None
    # BPipe: [evictor stage][microbatch] seconds of one stash transfer (its activation_bytes)
    # on the pair's link, each way; None: 0 (only schedules with a partner read it)
    stash_transfer_s: list[list[float]] | None = None

    def work(self, kind: "ActionKind", stage: int) -> float:
        """Bytes the action holds only while it runs (`forward_work_bytes`, `backward_work_bytes`)."""
        table = self.forward_work_bytes if kind is ActionKind.F else \
            self.backward_work_bytes if kind in (ActionKind.B, ActionKind.I) else None
        return 0.0 if table is None else float(table[stage])

    def sent_gradient(self, kind: "ActionKind", stage: int) -> float:
        """Bytes a SEND_B of ``stage`` holds until its release (`input_grad_bytes`); 0 otherwise."""
        return 0.0 if kind is not ActionKind.SEND_B or self.input_grad_bytes is None else float(self.input_grad_bytes[stage])

    def pending_w(self, stage: int) -> float:
        """Bytes an I of ``stage`` leaves for its W (``weight_grad_bytes``; 0 without)."""
        return 0.0 if self.weight_grad_bytes is None else float(self.weight_grad_bytes[stage])

    def stash_s(self, evictor: int, microbatch: int) -> float:
        """Seconds of one transfer of ``evictor``'s stash of ``microbatch`` (0 without a table)."""
        return 0.0 if self.stash_transfer_s is None else self.stash_transfer_s[evictor][microbatch]

    @classmethod
    def per_stage(
        cls,
        num_microbatches: int,
        forward_s: Sequence[float],
        backward_s: Sequence[float],
        send_forward_s: Sequence[float] | None = None,
        send_backward_s: Sequence[float] | None = None,
        activation_bytes: Sequence[float] | None = None,
        static_bytes: Sequence[float] | None = None,
        recompute_bytes: Sequence[float] | None = None,
        backward_input_s: Sequence[float] | None = None,
        backward_weight_s: Sequence[float] | None = None,
        split_cost: float = 1.0,
    ) -> StageCosts:
        """Costs that are equal for every microbatch; omitted arrays are zero (the split
        backward's: half of ``backward_s`` each)."""
        n = len(forward_s)

        def rows(values: Sequence[float] | None) -> list[list[float]]:
            values = [0.0] * n if values is None else values
            if len(values) != n:
                raise ValueError(f"expected {n} per-stage values, got {len(values)}")
            return [[float(x)] * num_microbatches for x in values]

        return cls(
            rows(forward_s),
            rows(backward_s),
            rows(send_forward_s),
            rows(send_backward_s),
            rows(activation_bytes),
            [0.0] * n if static_bytes is None else [float(x) for x in static_bytes],
            [] if recompute_bytes is None else [float(x) for x in recompute_bytes],
            None if backward_input_s is None else rows(backward_input_s),
            None if backward_weight_s is None else rows(backward_weight_s),
            float(split_cost),
        )

    @classmethod
    def uniform(
        cls,
        num_stages: int,
        num_microbatches: int,
        forward_s: float,
        backward_s: float,
        send_s: float = 0.0,
        activation_bytes: float = 0.0,
        static_bytes: float = 0.0,
    ) -> StageCosts:
        """Equal stages; ``send_s`` each way between neighbours (0 past either end)."""
        last = num_stages - 1
        return cls.per_stage(
            num_microbatches,
            [forward_s] * num_stages,
            [backward_s] * num_stages,
            [send_s if s < last else 0.0 for s in range(num_stages)],
            [send_s if s > 0 else 0.0 for s in range(num_stages)],
            [activation_bytes] * num_stages,
            [static_bytes] * num_stages,
        )

    def check(self, num_stages: int, num_microbatches: int,
              chunks: Sequence[int] | None = None) -> None:
        """Raise ``ValueError`` unless every array is [num_stages][num_microbatches] (static:
        [num_stages]); with per-stage ``chunks`` (unequal sizes), ragged rows of ``chunks[s]``
        entries (``send_backward_s[s]``: ``chunks[s - 1]``, module docstring)."""
        for name in ("forward_s", "backward_s", "send_forward_s", "send_backward_s", "activation_bytes",
                     "backward_input_s", "backward_weight_s", "stash_transfer_s"):
            table = getattr(self, name)
            if table is None:
                continue
            if chunks is None:
                want = [num_microbatches] * num_stages
            elif name == "send_backward_s":
                want = [chunks[max(s - 1, 0)] for s in range(num_stages)]
            else:
                want = list(chunks)
            if len(table) != num_stages or [len(row) for row in table] != want:
                if chunks is None:
                    shape = (len(table), sorted({len(row) for row in table}))
                    raise ValueError(f"StageCosts.{name} must be [{num_stages}][{num_microbatches}], "
                                     f"got {shape}")
                raise ValueError(f"StageCosts.{name} must have rows of {want} entries (one per "
                                 f"chunk), got {[len(row) for row in table]}")
        if len(self.static_bytes) != num_stages:
            raise ValueError(f"StageCosts.static_bytes must have {num_stages} entries, got {len(self.static_bytes)}")
        if self.recompute_bytes and len(self.recompute_bytes) != num_stages:
            raise ValueError(f"StageCosts.recompute_bytes must have {num_stages} entries, got "
                             f"{len(self.recompute_bytes)}")


@dataclass(frozen=True)
class Event:
    """One executed action. For a SEND, [start, end) is the transfer on the link to
    ``peer``; for a RECV, the time the rank waited; for F/B/I/W, the compute."""

    rank: int
    kind: ActionKind
    stage: int
    microbatch: int
    start: float
    end: float
    peer: int | None = None

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def is_compute(self) -> bool:
        return self.kind.is_compute


@dataclass
class Timeline:
    """Result of ``simulate``. ``busy_s`` counts compute (F/B/I/W) only."""

    num_ranks: int
    events: list[Event]
    iteration_s: float
    busy_s: list[float]
    peak_memory_bytes: list[float]
    bubble_fraction: float = field(init=False)
    # [rank] when its gradient all-reduce ends (StageCosts.allreduce_s); [] without one
    allreduce_end_s: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        capacity = self.num_ranks * self.iteration_s
        self.bubble_fraction = 1.0 - sum(self.busy_s) / capacity if capacity > 0 else 0.0

    def compute_events(self, rank: int | None = None) -> list[Event]:
        """F/B/I/W events, optionally of one rank, in start order."""
        chosen = [e for e in self.events if e.is_compute and (rank is None or e.rank == rank)]
        return sorted(chosen, key=lambda e: (e.start, e.rank))

    def to_text(self, width: int = 72) -> str:
        """A small ASCII Gantt chart: one row per rank, ``F``/``B``/``I``/``W`` busy, ``.`` idle.

        Each column covers ``iteration_s / width`` seconds and shows what runs at its
        midpoint, so very short actions can disappear.
        """
        lines = [f"iteration {self.iteration_s:.6g} s, bubble {self.bubble_fraction:.1%}"]
        step = self.iteration_s / width if self.iteration_s > 0 else 0.0
        for r in range(self.num_ranks):
            cells = ["."] * width
            for e in self.compute_events(r):
                for c in range(width):
                    mid = (c + 0.5) * step
                    if e.start <= mid < e.end:
                        cells[c] = e.kind.value
            lines.append(f"rank {r} |{''.join(cells)}| busy {self.busy_s[r]:.6g} s, peak {self.peak_memory_bytes[r]:.6g} B")
        return "\n".join(lines)


_VALIDATED: dict[int, weakref.ref] = {}  # id -> the schedule validated under that id


def _validate_once(schedule: Schedule) -> None:
    """`validate(schedule)`, once per schedule object: a Schedule is frozen and the registry
    hands the planner the same object for the same fields (`schedule_for`'s cache)."""
    ref = _VALIDATED.get(id(schedule))
    if ref is not None and ref() is schedule:
        return
    validate(schedule)
    if len(_VALIDATED) > 4096:
        _VALIDATED.clear()
    _VALIDATED[id(schedule)] = weakref.ref(schedule)


# NOTE: the kinds' property tests as set lookups in the simulator's loop (the same sets as
# ActionKind.is_compute / is_send / is_recv; a test checks they agree)
_COMPUTE = frozenset(k for k in ActionKind if k.is_compute)
_SEND = frozenset(k for k in ActionKind if k.is_send)
_RECV = frozenset(k for k in ActionKind if k.is_recv)


def simulate(schedule: Schedule, costs: StageCosts, *, overlap_comm: bool = True,
             validated: bool = False) -> Timeline:
    """Simulate one iteration of ``schedule``; see the module docstring for the model.

    Raises ``ScheduleError`` for an invalid schedule and ``ValueError`` for costs of the
    wrong shape. ``validated``: the caller's schedule comes from ``schedule_for``, which
    validated it (the planner's, thousands of times per search): not checked again.
    """
    if not validated:
        _validate_once(schedule)
    chunks = ([len(row) for row in schedule.microbatch_sizes]
              if getattr(schedule, "microbatch_sizes", None) is not None else None)
    costs.check(schedule.num_stages, schedule.num_microbatches, chunks)
    owner = schedule.stage_to_rank
    partner = schedule.partner or (None,) * schedule.num_stages
    R = schedule.num_ranks
    if chunks is None:  # NOTE: equal splits: chunk k of every stage holds the same samples
        def forward_inputs(s: int, k: int) -> list[int]:
            return [k]
        gradient_inputs = forward_inputs
    else:
        forward_inputs, gradient_inputs = schedule.forward_inputs, schedule.gradient_inputs

    clock = [0.0] * R
    busy = [0.0] * R
    link_free: dict[tuple[int, int], float] = {}
    arrival: dict[tuple[str, int, int], float] = {}  # message key -> time data is at the receiver
    f_end: dict[tuple[int, int], float] = {}
    b_end: dict[tuple[int, int], float] = {}  # B or I: the input gradient is ready
    events: list[Event] = []

    def input_ready(a: Action, r: int) -> float:
        s, mb = a.stage, a.microbatch
        if a.kind is ActionKind.F:
            if s == 0:
                return 0.0
            if owner[s - 1] == r:
                return max(f_end[(s - 1, j)] for j in forward_inputs(s, mb))
            return max(arrival[("F", s, j)] for j in forward_inputs(s, mb))
        if a.kind is ActionKind.W:  # after its own I (validate: same rank, earlier)
            return b_end[(s, mb)]
        ready = f_end[(s, mb)]
        if ("R", s, mb) in arrival:  # BPipe: its evicted stash is back (RECV_R is a prefetch)
            ready = max(ready, arrival[("R", s, mb)])
        if s < schedule.num_stages - 1:
            if owner[s + 1] == r:
                ready = max([ready] + [b_end[(s + 1, j)] for j in gradient_inputs(s, mb)])
            else:  # the message of this chunk's gradient (sent once it is complete)
                ready = max(ready, arrival[("B", s, mb)])
        return ready

    def run(a: Action, r: int) -> None:
        s, mb, k = a.stage, a.microbatch, a.kind
        if k in _COMPUTE:
            start = max(clock[r], input_ready(a, r))
            if k is ActionKind.F:
                took = costs.forward_s[s][mb]
            elif k is ActionKind.B:
                took = costs.backward_s[s][mb]
            else:
                took = costs.split_backward_s(s, mb)[0 if k is ActionKind.I else 1]
            end = start + took
            if k is not ActionKind.W:
                (f_end if k is ActionKind.F else b_end)[(s, mb)] = end
            busy[r] += end - start
            events.append(Event(r, k, s, mb, start, end))
        elif k in _SEND:
            key = schedule.message(a)
            if k.is_stash:  # SEND_S to the acceptor, SEND_R back to the evictor
                dst = owner[partner[s]]
                took = costs.stash_s(key[1], mb)
            else:
                dst = owner[key[1]]
                took = (costs.send_forward_s if k is ActionKind.SEND_F else costs.send_backward_s)[s][mb]
            start = max(clock[r], link_free.get((r, dst), 0.0))
            end = start + took
            link_free[(r, dst)] = arrival[key] = end
            events.append(Event(r, k, s, mb, start, end, peer=dst))
            if overlap_comm:
                return  # the rank goes on; only the link is occupied
        else:
            key = schedule.message(a)
            start, end = clock[r], max(clock[r], arrival[key])
            if k.is_stash:
                src = owner[partner[s]]
            else:
                src = owner[key[1] - 1] if k is ActionKind.RECV_F else owner[key[1] + 1]
            events.append(Event(r, k, s, mb, start, end, peer=src))
            if k is ActionKind.RECV_R:
                return  # a prefetch: the rank goes on, B(s, mb) waits for the data (input_ready)
        clock[r] = max(clock[r], end)

    # validate() proved the rows finish; advance each until it waits on an unsent message.
    advance(schedule, lambda a: a.kind in _RECV and schedule.message(a) not in arrival, run)

    training = schedule.is_training
    if costs.step_bytes is not None and len(costs.step_bytes) != R:
        raise ValueError(f"StageCosts.step_bytes must have {R} entries (one per rank), got {len(costs.step_bytes)}")
    if schedule.partner is not None:
        peak = _peak_memory_timeline(schedule, costs, events)
    else:
        peak = [_peak_memory(schedule, costs, r, training) for r in range(R)]
    iteration = max((e.end for e in events), default=0.0)
    reduced = _allreduce_ends(events, costs.allreduce_s, R)
    tails = _tail_ends(events, costs.tail_s, R, reduced)
    return Timeline(R, events, max([iteration] + reduced + tails), busy, peak,
                    allreduce_end_s=reduced)


def _tail_ends(events: list[Event], tail_s: Sequence[float] | None, ranks: int,
               reduced: Sequence[float]) -> list[float]:
    """[rank] its end (last event, or its all-reduce) + tail_s[rank]; [] without tails."""
    if tail_s is None:
        return []
    if len(tail_s) != ranks:
        raise ValueError(f"StageCosts.tail_s must have {ranks} entries (one per rank), "
                         f"got {len(tail_s)}")
    end = [0.0] * ranks
    for e in events:
        end[e.rank] = max(end[e.rank], e.end)
    for r, t in enumerate(reduced):
        end[r] = max(end[r], t)
    return [end[r] + float(tail_s[r]) if tail_s[r] > 0 else end[r] for r in range(ranks)]


def _allreduce_ends(events: list[Event], allreduce_s: Sequence[float] | None, ranks: int) -> list[float]:
    """[rank] start(last B or W) + max(its seconds, allreduce_s[rank]); [] without all-reduces
    (the stage's weight gradients are final in that action, where the runtime starts reducing)."""
    if allreduce_s is None:
        return []
    if len(allreduce_s) != ranks:
        raise ValueError(f"StageCosts.allreduce_s must have {ranks} entries (one per rank), "
                         f"got {len(allreduce_s)}")
    last: dict[int, Event] = {}
    for e in events:
        if e.kind.frees_stash and (e.rank not in last or e.start >= last[e.rank].start):  # B, or W
            last[e.rank] = e
    return [last[r].start + max(last[r].duration, float(allreduce_s[r])) if r in last else 0.0
            for r in range(ranks)]


def _peak_memory(schedule: Schedule, costs: StageCosts, rank: int, training: bool) -> float:
    """Static bytes of the rank's stages plus the most activation bytes held at once
    (with a recomputed stage's re-created activations during its B)."""
    static = sum(costs.static_bytes[s] for s in schedule.stages_of(rank))
    held = peak = 0.0
    release = schedule.send_releases[rank] if training and costs.input_grad_bytes is not None else {}
    sent: dict[Action, float] = {}  # input gradients sent upstream and not yet released
    for a in schedule.actions[rank]:
        if a in release:
            held -= sum(sent.pop(x, 0.0) for x in release[a])
        if training and costs.sent_gradient(a.kind, a.stage):
            sent[a] = costs.sent_gradient(a.kind, a.stage)
            held += sent[a]
            peak = max(peak, held)  # after the last backward, every unreleased send at once
        if not a.kind.is_compute:  # NOTE: a message's index may be an upstream chunk's
            continue
        size = costs.activation_bytes[a.stage][a.microbatch]
        work = costs.work(a.kind, a.stage)  # held only while the action runs
        if a.kind is ActionKind.F:
            peak = max(peak, held + size + work)
            if training:
                held += size
        elif a.kind in (ActionKind.B, ActionKind.I):
            redo = costs.recompute_bytes[a.stage] if costs.recompute_bytes else 0.0
            peak = max(peak, held + redo + work)  # a recomputed stage re-creates its activations first
            if a.kind.frees_stash:
                held -= size
            else:  # I: W's starting gradients stay until the W
                held += costs.pending_w(a.stage)
                peak = max(peak, held)
        elif a.kind.frees_stash:
            held -= size + (costs.pending_w(a.stage) if a.kind is ActionKind.W else 0.0)
    step = costs.step_bytes[rank] if costs.step_bytes is not None and training else 0.0
    return static + max(peak, step)  # the optimizer step: no activation is stashed by then


def _peak_memory_timeline(schedule: Schedule, costs: StageCosts, events: list[Event]) -> list[float]:
    """Per rank, static bytes plus the most activation bytes held at once, from a sweep over
    the event timeline (PAPERS-SPEC.md 2.10 item 2; stash transfers are asynchronous, so the
    row order is not the time order). An F's stash grows linearly over the F (its layers' outputs
    appear one after the other) and is held until the end of its B (a recomputing stage also
    holds ``recompute_bytes`` during B). BPipe moves it: the evictor lets go when its SEND_S
    transfer ends and holds it again from the earlier of its RECV_R and the return transfer's
    start; the acceptor holds it from the earlier of its RECV_S and the outgoing transfer's start
    until its SEND_R transfer ends (both ends hold it while it moves). Memory is read just before
    and just after every event time, so a transfer that ends inside the next F costs that F's
    share so far. Without BPipe this equals the row walk (`_peak_memory`). Training schedules."""
    R = schedule.num_ranks
    steps: list[list[tuple[float, float]]] = [[] for _ in range(R)]
    ramps: list[list[tuple[float, float, float]]] = [[] for _ in range(R)]  # (start, end, bytes)
    sends = {schedule.message(Action(e.kind, e.stage, e.microbatch)): e for e in events
             if e.kind.is_send and e.kind.is_stash}
    release = dict(enumerate(schedule.send_releases)) if costs.input_grad_bytes is not None else {}
    for e in sorted(events, key=lambda ev: ev.start):
        if costs.sent_gradient(e.kind, e.stage):  # held from the send to its release (or the step's end)
            steps[e.rank].append((e.start, costs.sent_gradient(e.kind, e.stage)))
        for x in release.get(e.rank, {}).get(Action(e.kind, e.stage, e.microbatch), ()):
            steps[e.rank].append((e.end, -costs.sent_gradient(x.kind, x.stage)))
        if e.kind.is_compute:
            size = costs.activation_bytes[e.stage][e.microbatch]
            if e.kind is ActionKind.F:
                ramps[e.rank].append((e.start, e.end, size))
            elif e.kind.frees_stash:
                steps[e.rank].append((e.end, -size))
            extra = costs.work(e.kind, e.stage)  # held while it runs
            if e.kind in (ActionKind.B, ActionKind.I) and costs.recompute_bytes:
                extra += costs.recompute_bytes[e.stage]
            if extra:
                steps[e.rank] += [(e.start, extra), (e.end, -extra)]
            if e.kind in (ActionKind.I, ActionKind.W) and costs.pending_w(e.stage):  # I leaves W's gradients
                steps[e.rank].append((e.end, costs.pending_w(e.stage) * (1 if e.kind is ActionKind.I else -1)))
        if not e.kind.is_stash:
            continue
        key = schedule.message(Action(e.kind, e.stage, e.microbatch))
        stash = costs.activation_bytes[key[1]][e.microbatch]
        if e.kind in (ActionKind.SEND_S, ActionKind.SEND_R):
            steps[e.rank].append((e.end, -stash))
        else:  # RECV_S on the acceptor, RECV_R on the evictor
            steps[e.rank].append((min(e.start, sends[key].start), stash))
    peaks = []
    for r in range(R):
        times = sorted({t for t, _ in steps[r]} | {x for a, b, _ in ramps[r] for x in (a, b)})
        ordered = sorted(steps[r])
        peak, i, before = 0.0, 0, 0.0
        grown_at = _ramp_sums(ramps[r])
        for t in times:
            grown = grown_at(t)
            at = before
            while i < len(ordered) and ordered[i][0] <= t:
                at += ordered[i][1]
                i += 1
            peak = max(peak, before + grown, at + grown)
            before = at
        step = costs.step_bytes[r] if costs.step_bytes is not None else 0.0  # the optimizer step
        peaks.append(sum(costs.static_bytes[s] for s in schedule.stages_of(r)) + max(peak, step))
    return peaks


def _ramp_sums(ramps: list[tuple[float, float, float]]) -> Callable[[float], float]:
    """t -> Σ size · clamp((t - a) / (b - a), 0, 1) over `ramps` (a zero-length ramp: size once
    t ≥ a), summed left to right as Python's `sum` does. NOTE (issue 31): one rank's F events
    never overlap and come in time order, so at any t the ramps that have ended are a prefix
    and at most the next one is under way; every later term is 0.0, which leaves a float sum
    unchanged: the prefix's running sum plus that one term is the same float, found by
    bisection instead of a pass over every ramp. Ramps out of order: the pass over all."""
    def every(t: float) -> float:
        return sum(size * min(max((t - a) / (b - a), 0.0), 1.0) if b > a else (size if t >= a else 0.0)
                   for a, b, size in ramps)
    if any(b < a or b > a2 for (a, b, _), (a2, _b2, _s2) in zip(ramps, ramps[1:])) \
            or any(b < a for a, b, _ in ramps):
        return every
    ends = [b for _, b, _ in ramps]
    prefix = list(itertools.accumulate((size for _, _, size in ramps), initial=0))

    def ordered(t: float) -> float:
        j = bisect.bisect_right(ends, t)  # ramps 0..j-1 end at or before t: whole (b = t: 1.0)
        out = prefix[j]
        if j < len(ramps):
            a, b, size = ramps[j]
            if b > a:
                out = out + size * min(max((t - a) / (b - a), 0.0), 1.0)
            elif t >= a:  # NOTE: unreachable: t < b = a here
                out = out + size
        return out
    return ordered
