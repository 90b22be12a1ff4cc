"""The schedule IR's data: actions, their kinds, and ``Schedule``, one action list per rank.

A schedule says, for every rank, the ordered list of actions it executes in one training
(or inference) iteration. An action is ``Action(kind, stage, microbatch)``; ``stage`` is
always the *local* (virtual) stage doing the work, as in torch.distributed.pipelining:

    F        forward of ``stage`` on ``microbatch``
    B        backward (input and weight gradients together)
    I        backward for the stage's input only (zero-bubble: the gradient it sends back)
    W        backward for the stage's weights only (zero-bubble: after its I, any time later)
    SEND_F   ``stage`` sends its activation to ``stage + 1``
    RECV_F   ``stage`` receives its input activation from ``stage - 1``
    SEND_B   ``stage`` sends the gradient of its input to ``stage - 1``
    RECV_B   ``stage`` receives the gradient of its output from ``stage + 1``
    SEND_S   BPipe: evictor ``stage`` sends its stash of ``microbatch`` to its partner
    RECV_S   BPipe: acceptor ``stage`` receives its partner's stash of ``microbatch``
    SEND_R   BPipe: acceptor ``stage`` sends that stash back
    RECV_R   BPipe: evictor ``stage`` receives it back (before its B of ``microbatch``)
    REDUCE   replica groups: all-reduce ``stage``'s parameter gradients over its replicas, right
             after the stage's last gradient action (``microbatch`` is that action's); the
             runtime starts it during that action (per-parameter hooks) and completes it here
    REFRESH  Bi-Partition: ``stage`` reads its segment replicas' weights for the last time this
             iteration (``microbatch``: its last F); their refresh from the owners, sent after
             the optimizer step, is received into them from here on

REDUCE and REFRESH are the schedule's collectives: they move no activation or gradient of a
micro-batch and take part in no message matching; a schedule has at most one of each per stage
(``pipecc.ir.schedule.transforms.gradient_reduce``/``weight_refresh`` insert them,
``without_collectives`` removes them for the simulator, which charges them as costs).

A training schedule runs, for every (stage, microbatch), either one B or an I and a later W
(Qi et al., *Zero Bubble Pipeline Parallelism*, ICLR 2024: splitting B lets the gradient go
upstream after I and moves W into what would be bubbles).

Unequal micro-batches (UMPIPE, PAPERS-SPEC.md section 1): ``Schedule.microbatch_sizes`` may
give each stage its own list of chunk sizes (positive, in sample order, every list summing to
the batch); ``None`` means the equal split. Then an action's ``microbatch`` is a chunk index of
its stage, except that every message on the boundary between stages ``s`` and ``s+1`` carries
one chunk of the *upstream* stage ``s`` in both directions: ``sSEND_Fj``/``s+1RECV_Fj`` move the
activation of stage ``s``'s chunk ``j``, and ``s+1SEND_Bj``/``sRECV_Bj`` the gradient of that
same chunk (sent once every chunk of ``s+1`` overlapping it has run its backward).

BPipe (activation balancing, PAPERS-SPEC.md 2.3-2.4): ``Schedule.partner`` pairs stage ``s``
with ``p-1-s`` (one stage per rank); the lower stage of a pair is the *evictor*, which moves
stashed activations to its *acceptor* and takes them back before their backward. A stash
message's key names the evictor (``Action.message(partner)``, ``Schedule.message``).

``str(schedule)`` is the canonical text form (``pipecc.ir.schedule.text``: ``format``/``parse``);
it lives here because the IR prints itself and the parser builds the IR, not the other way round.
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from pipecc.ir.schedule.chunks import check_size_lists, overlapping

__all__ = ["Action", "ActionKind", "Schedule"]


class ActionKind(str, Enum):
    """What an action does. The value is the text form."""

    F = "F"
    B = "B"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    I = "I"
    W = "W"
    SEND_S = "SEND_S"
    RECV_S = "RECV_S"
    SEND_R = "SEND_R"
    RECV_R = "RECV_R"
    REDUCE = "REDUCE"
    REFRESH = "REFRESH"

    @property
    def is_compute(self) -> bool:
        return self in (ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W)

    @property
    def is_backward(self) -> bool:
        """B, I or W: a training schedule's backward work."""
        return self in (ActionKind.B, ActionKind.I, ActionKind.W)

    @property
    def frees_stash(self) -> bool:
        """B or W: the last backward action of a (stage, microbatch), which frees its stash."""
        return self in (ActionKind.B, ActionKind.W)

    @property
    def is_send(self) -> bool:
        return self in (ActionKind.SEND_F, ActionKind.SEND_B, ActionKind.SEND_S, ActionKind.SEND_R)

    @property
    def is_recv(self) -> bool:
        return self in (ActionKind.RECV_F, ActionKind.RECV_B, ActionKind.RECV_S, ActionKind.RECV_R)

    @property
    def is_collective(self) -> bool:
        """REDUCE or REFRESH: a stage's once-per-iteration collective (no micro-batch message)."""
        return self in (ActionKind.REDUCE, ActionKind.REFRESH)

    @property
    def is_stash(self) -> bool:
        """SEND_S, RECV_S, SEND_R or RECV_R: a BPipe stash transfer between partners."""
        return self in (ActionKind.SEND_S, ActionKind.RECV_S, ActionKind.SEND_R, ActionKind.RECV_R)


@dataclass(frozen=True, order=True)
class Action:
    """One step of one rank: ``kind`` applied by ``stage`` to ``microbatch``."""

    kind: ActionKind
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    def message(self, partner: Sequence[int | None] | None = None) -> tuple[str, int, int] | None:
        """Key of the message a SEND produces or a RECV consumes, else ``None``.

        The key names the *receiving* stage, so ``0SEND_F3`` and ``1RECV_F3`` share
        ``("F", 1, 3)`` and ``1SEND_B3`` and ``0RECV_B3`` share ``("B", 0, 3)``.
        A BPipe stash message names the *evictor* stage: ``("S", s, j)`` for SEND_S by the
        evictor ``s`` and RECV_S by its acceptor, ``("R", s, j)`` for SEND_R by the acceptor and
        RECV_R by ``s``. The acceptor's actions need ``partner`` (``Schedule.partner``) to find
        the evictor; ``Schedule.message(a)`` passes it.
        """
        if self.kind in (ActionKind.SEND_S, ActionKind.RECV_R):
            return ("S" if self.kind is ActionKind.SEND_S else "R", self.stage, self.microbatch)
        if self.kind in (ActionKind.RECV_S, ActionKind.SEND_R):
            evictor = None if partner is None or self.stage >= len(partner) else partner[self.stage]
            if evictor is None:
                raise ValueError(f"{self}: stage {self.stage} has no BPipe partner (Schedule.partner)")
            return ("S" if self.kind is ActionKind.RECV_S else "R", evictor, self.microbatch)
        if self.kind is ActionKind.SEND_F:
            return ("F", self.stage + 1, self.microbatch)
        if self.kind is ActionKind.SEND_B:
            return ("B", self.stage - 1, self.microbatch)
        if self.kind is ActionKind.RECV_F:
            return ("F", self.stage, self.microbatch)
        if self.kind is ActionKind.RECV_B:
            return ("B", self.stage, self.microbatch)
        return None


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists plus the stage placement they assume.

    ``stage_to_rank[s]`` is the rank holding (virtual) stage ``s``; ``-1`` only in a
    parsed schedule that never mentions ``s`` (``validate`` rejects it).

    ``microbatch_sizes[s]`` lists stage ``s``'s chunk sizes when stages split the batch
    unequally (UMPIPE); ``None`` (the default) means every stage has ``num_microbatches`` equal
    chunks. With sizes, ``num_microbatches`` is the largest chunk count.
    """

    num_ranks: int
    num_stages: int
    num_microbatches: int
    stage_to_rank: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]
    microbatch_sizes: tuple[tuple[int, ...], ...] | None = None
    # BPipe (PAPERS-SPEC.md 2.3): per stage, the stage it exchanges stashed activations with
    # (symmetric; None: no partner); None: no BPipe. Of a pair, the lower stage is the evictor.
    partner: tuple[int | None, ...] | None = None

    def __post_init__(self) -> None:
        if self.partner is not None:
            pairs = tuple(None if x is None else int(x) for x in self.partner)
            if len(pairs) != self.num_stages:
                raise ValueError(f"partner has {len(pairs)} entries for {self.num_stages} stages")
            object.__setattr__(self, "partner", pairs)
        if len(self.actions) != self.num_ranks:
            raise ValueError(f"{len(self.actions)} action rows for {self.num_ranks} ranks")
        if len(self.stage_to_rank) != self.num_stages:
            raise ValueError(f"stage_to_rank has {len(self.stage_to_rank)} entries for {self.num_stages} stages")
        if self.microbatch_sizes is not None:
            sizes = tuple(tuple(int(b) for b in row) for row in self.microbatch_sizes)
            check_size_lists(sizes)
            if len(sizes) != self.num_stages:
                raise ValueError(f"microbatch_sizes has {len(sizes)} stage lists for {self.num_stages} stages")
            if self.num_microbatches != max(len(row) for row in sizes):
                raise ValueError(f"num_microbatches is {self.num_microbatches} but the longest size list "
                                 f"has {max(len(row) for row in sizes)} chunks")
            object.__setattr__(self, "microbatch_sizes", sizes)

    def message(self, a: Action) -> tuple[str, int, int] | None:
        """``a.message(self.partner)``: the key of the message ``a`` sends or receives."""
        return a.message(self.partner)

    @functools.cached_property
    def send_releases(self) -> tuple[dict[Action, list[Action]], ...]:
        """``send_release(r)`` of every rank r, computed once per schedule (the simulator asks for
        it at every plan it evaluates)."""
        keys = [[self.message(a) if a.kind.is_send or a.kind.is_recv else None for a in row] for row in self.actions]
        sent_at, received_at = {}, {}  # message -> (rank, position) of its send, of its receive
        for r, row in enumerate(self.actions):
            for i, (a, k) in enumerate(zip(row, keys[r])):
                if k is not None:
                    (sent_at if a.kind.is_send else received_at)[k] = (r, i)
        out = []
        for r, row in enumerate(self.actions):
            released: dict[Action, list[Action]] = {}
            pending: dict[int, list[tuple[int, int, Action]]] = {}  # peer -> heap of (its receive's position, order, send)
            for order, (a, k) in enumerate(zip(row, keys[r])):
                if k is None:
                    continue
                if a.kind.is_send:
                    peer, at = received_at[k]
                    heapq.heappush(pending.setdefault(peer, []), (at, order, a))
                else:
                    peer, at = sent_at[k]  # the peer sent this after every receive of its before `at`
                    heap, done = pending.get(peer, []), []
                    while heap and heap[0][0] < at:
                        done.append(heapq.heappop(heap)[1:])
                    if done:
                        released[a] = [x for _, x in sorted(done)]
            out.append(released)
        return tuple(out)

    def send_release(self, rank: int) -> dict[Action, list[Action]]:
        """For each receive of ``rank``, the earlier sends of ``rank`` that are certainly complete
        once it returns (the runtime drops their tensors there, `runtime.wire`; the simulator's
        peak memory holds them until then, `passes.simulate`).

        A send to peer P is complete when P has received it, which is certain once we receive a
        message P sent after that receive. Releasing sends there, instead of at the end of the step,
        drops the sent activations when the schedule says so: 1F1B holds p - r of them, not m.
        """
        return self.send_releases[rank]

    def evictor_of(self, a: Action) -> int:
        """The evictor stage whose stash a BPipe action ``a`` moves."""
        key = self.message(a)
        assert key is not None and key[0] in ("S", "R"), a
        return key[1]

    def is_evictor(self, stage: int) -> bool:
        """True when ``stage`` has a BPipe partner above it (it sends stashes out)."""
        return self.partner is not None and self.partner[stage] is not None and self.partner[stage] > stage

    @property
    def uneven(self) -> bool:
        """True when the schedule carries per-stage chunk sizes (UMPIPE)."""
        return self.microbatch_sizes is not None

    def chunks(self, stage: int) -> int:
        """Stage ``stage``'s chunk count: ``len(microbatch_sizes[stage])``, else ``num_microbatches``."""
        if self.microbatch_sizes is None:
            return self.num_microbatches
        return len(self.microbatch_sizes[stage])

    def index_range(self, a: Action) -> int:
        """How many indices ``a.microbatch`` ranges over: the chunks of ``a.stage``, or of
        ``a.stage - 1`` for RECV_F and SEND_B (their message carries an upstream chunk)."""
        if a.kind in (ActionKind.RECV_F, ActionKind.SEND_B) and a.stage > 0:
            return self.chunks(a.stage - 1)
        return self.chunks(a.stage)

    def message_chunk(self, a: Action) -> tuple[int, int] | None:
        """``(stage, chunk)`` whose samples the message of SEND/RECV ``a`` carries (always the
        upstream stage of the boundary), else ``None``. Its size is
        ``microbatch_sizes[stage][chunk]`` (the simulator prices the message by it)."""
        if a.kind in (ActionKind.SEND_F, ActionKind.RECV_B):
            return (a.stage, a.microbatch)
        if a.kind in (ActionKind.RECV_F, ActionKind.SEND_B):
            return (a.stage - 1, a.microbatch)
        return None

    def forward_inputs(self, stage: int, chunk: int) -> list[int]:
        """The chunks of ``stage - 1`` whose samples ``F(stage, chunk)`` reads (``[chunk]``
        with equal sizes)."""
        if self.microbatch_sizes is None or stage == 0:
            return [chunk]
        return overlapping(self.microbatch_sizes[stage - 1], self.microbatch_sizes[stage])[chunk]

    def gradient_inputs(self, stage: int, chunk: int) -> list[int]:
        """The chunks of ``stage + 1`` whose backward must have run before the gradient of
        ``stage``'s chunk ``chunk`` is complete (``[chunk]`` with equal sizes)."""
        if self.microbatch_sizes is None or stage == self.num_stages - 1:
            return [chunk]
        return overlapping(self.microbatch_sizes[stage + 1], self.microbatch_sizes[stage])[chunk]

    @classmethod
    def from_actions(
        cls,
        actions: list[list[Action]] | tuple[tuple[Action, ...], ...],
        microbatch_sizes: Sequence[Sequence[int]] | None = None,
        partner: Sequence[int | None] | None = None,
    ) -> Schedule:
        """Build a schedule, inferring stages, microbatches and placement from the actions.

        A stage belongs to the first rank (in rank order) whose row mentions it. With
        ``microbatch_sizes``, the stage count is at least its length and the microbatch count
        is its longest list. With ``partner`` (BPipe), at least its length.
        """
        rows = tuple(tuple(row) for row in actions)
        flat = [a for row in rows for a in row]
        num_stages = 1 + max((a.stage for a in flat), default=-1)
        num_microbatches = 1 + max((a.microbatch for a in flat), default=-1)
        sizes = None
        if microbatch_sizes is not None:
            sizes = tuple(tuple(row) for row in microbatch_sizes)
            check_size_lists(sizes)
            num_stages = max(num_stages, len(sizes))
            num_microbatches = max(len(row) for row in sizes)
        pairs = None
        if partner is not None:
            pairs = tuple(partner)
            num_stages = max(num_stages, len(pairs))
            pairs = pairs + (None,) * (num_stages - len(pairs))
        owner = [-1] * num_stages
        for rank, row in enumerate(rows):
            for a in row:
                if owner[a.stage] == -1:
                    owner[a.stage] = rank
        return cls(len(rows), num_stages, num_microbatches, tuple(owner), rows, sizes, pairs)

    @property
    def is_training(self) -> bool:
        """True when the schedule has backward actions (B, or I and W)."""
        return any(a.kind.is_backward for row in self.actions for a in row)

    def stages_of(self, rank: int) -> list[int]:
        """The stages held by ``rank``, ascending."""
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]

    def stash_profile(self) -> list[int]:
        """Per stage, the most microbatches whose activations are held at once.

        A microbatch is held on stage ``s`` from its F until its B (or W) on that stage. Ranks
        run their actions in order, so counting along the row is exact in time too.
        Forward-only schedules stash nothing (0 everywhere). 1F1B gives
        ``min(p - s, m)``, GPipe ``m``. With BPipe (``partner``) an evictor's stash leaves at its
        SEND_S and is back from its RECV_R; its acceptor holds it from RECV_S to SEND_R, and
        counts it as its own. O(total actions).
        """
        return self._stash_peaks(lambda stage, mb: 1)

    def stash_bytes_profile(self, activation_bytes: Sequence[float]) -> list[float]:
        """Per stage, the most activation bytes held at once when one micro-batch of stage ``s``
        stashes ``activation_bytes[s]``: ``stash_profile`` with every stash weighted by the bytes
        of the stage that produced it (an acceptor holds its evictor's stashes,
        PAPERS-SPEC.md 2.3)."""
        return self._stash_peaks(lambda stage, mb: activation_bytes[stage])

    def stash_sample_profile(self) -> list[int]:
        """Per stage, the most samples whose activations are held at once (needs
        ``microbatch_sizes``): ``stash_profile`` with every chunk weighted by its size
        (PAPERS-SPEC.md 1.4). GPipe holds the whole batch on every stage."""
        if self.microbatch_sizes is None:
            raise ValueError("stash_sample_profile needs microbatch_sizes (use stash_profile for equal splits)")
        sizes = self.microbatch_sizes
        return self._stash_peaks(lambda stage, mb: sizes[stage][mb])

    def _stash_deltas(self, a: Action) -> tuple[int, int, int] | None:
        """``(holder stage, producer stage, +1/-1)`` when ``a`` changes what a stage holds, else None:
        F +1 and B/W -1 of its own; SEND_S -1 and RECV_R +1 on the evictor; RECV_S +1 and SEND_R -1
        of the evictor's stash on the acceptor."""
        k = a.kind
        if k is ActionKind.F:
            return (a.stage, a.stage, 1)
        if k.frees_stash:
            return (a.stage, a.stage, -1)
        if k.is_stash:
            producer = self.evictor_of(a)
            return (a.stage, producer, 1 if k in (ActionKind.RECV_S, ActionKind.RECV_R) else -1)
        return None

    def _stash_peaks(self, weight: Callable[[int, int], float]) -> list:
        """Per stage, the most ``weight(producer stage, microbatch)`` held at once (F adds, B or W
        takes off, stash transfers move it between partners); 0 everywhere for forward-only
        schedules."""
        if not self.is_training:
            return [0] * self.num_stages
        held, peak = [0] * self.num_stages, [0] * self.num_stages
        for row in self.actions:
            for a in row:
                delta = self._stash_deltas(a)
                if delta is None:
                    continue
                holder, producer, sign = delta
                held[holder] += sign * weight(producer, a.microbatch)
                peak[holder] = max(peak[holder], held[holder])
        return peak

    def rank_stash_profile(self) -> list[int]:
        """Per rank, the most (stage, microbatch) activation sets held at once (BPipe transfers
        counted as in ``stash_profile``).

        With interleaving this is at most (usually below) the sum of ``stash_profile()``
        over the rank's stages, because their peaks need not coincide. O(total actions).
        """
        if not self.is_training:
            return [0] * self.num_ranks
        peaks = []
        for row in self.actions:
            held = peak = 0
            for a in row:
                delta = self._stash_deltas(a)
                if delta is not None:
                    held += delta[2]
                    peak = max(peak, held)
            peaks.append(peak)
        return peaks

    def __str__(self) -> str:
        """The canonical text form (``pipecc.ir.schedule.text.parse`` reads it back)."""
        return "\n".join(header_lines(self) + [f"rank {r}:" + "".join(f" {a}" for a in row)
                                                for r, row in enumerate(self.actions)])


def _F(stage: int, mb: int) -> Action:
    return Action(ActionKind.F, stage, mb)


def _B(stage: int, mb: int) -> Action:
    return Action(ActionKind.B, stage, mb)


def _I(stage: int, mb: int) -> Action:
    return Action(ActionKind.I, stage, mb)


def _W(stage: int, mb: int) -> Action:
    return Action(ActionKind.W, stage, mb)


def _format_sizes(sizes: Sequence[Sequence[int]]) -> str:
    return "sizes: " + " | ".join(" ".join(str(b) for b in row) for row in sizes)


def _format_partner(partner: Sequence[int | None]) -> str:
    return "partner: " + " ".join("-" if x is None else str(x) for x in partner)


def header_lines(schedule: Schedule) -> list[str]:
    """The header lines of the text form: ``sizes:`` (UMPIPE), then ``partner:`` (BPipe)."""
    lines = [] if schedule.microbatch_sizes is None else [_format_sizes(schedule.microbatch_sizes)]
    if schedule.partner is not None:
        lines.append(_format_partner(schedule.partner))
    return lines

