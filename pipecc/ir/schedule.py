"""Pipeline schedules as data: a tiny IR with a text form, generators and a validator.

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

A training schedule runs, for every (stage, microbatch), either one B or an I and a later W
(Qi et al., *Zero Bubble Pipeline Parallelism*, ICLR 2024: splitting B lets the gradient go
upstream after I and moves W into what would be bubbles).

Text form: an action is ``{stage}{kind}{microbatch}`` (``0F3``, ``2RECV_B1``, ``1I0``); a schedule
is one line per rank, ``rank 0: 0F0 0SEND_F0 0F1 ...``. ``parse(format(s)) == s`` and
``format(parse(t)) == t`` for canonical text.

Communication semantics (what ``validate`` and the simulator assume): sends are
asynchronous and buffered (NCCL ``isend``), receives block until the matching send was
executed. Stages ``s`` and ``s + 1`` on the same rank exchange data locally, without
SEND/RECV actions.

Unequal micro-batches (UMPIPE, PAPERS-SPEC.md section 1): ``Schedule.microbatch_sizes`` may
give each stage its own list of chunk sizes (positive, in sample order, every list summing to
the batch); ``None`` means the equal split of today. Then an action's ``microbatch`` is a chunk
index of its stage, except that every message on the boundary between stages ``s`` and ``s+1``
carries one chunk of the *upstream* stage ``s`` in both directions: ``sSEND_Fj``/``s+1RECV_Fj``
move the activation of stage ``s``'s chunk ``j``, and ``s+1SEND_Bj``/``sRECV_Bj`` the gradient
of that same chunk (sent once every chunk of ``s+1`` overlapping it has run its backward).
``F(s, k)`` needs every chunk of ``s-1`` that overlaps chunk ``k``'s samples; ``B(s, k)``
(or ``I``) needs its own ``RECV_B(s, k)``. ``gpipe_uneven`` builds the one row order the
runtime executes with unequal sizes (GPipe's); the text form gains a first line
``sizes: 1 3 4 | 4 4`` (stage lists separated by ``|``).

BPipe (activation balancing, PAPERS-SPEC.md 2.3-2.4): ``Schedule.partner`` pairs stage ``s``
with ``p-1-s`` (one stage per rank); the lower stage of a pair is the *evictor*, which moves
stashed activations to its *acceptor* and takes them back before their backward. A stash
message's key names the evictor (``Action.message(partner)``, ``Schedule.message``); the text
form gains a line ``partner: 3 2 1 0`` (``-``: none) before the rows. ``bpipe(one_f_one_b(p, m),
thresholds)`` builds the schedule; ``stash_profile`` counts an evicted stash on the acceptor.

This module must stay free of torch and of ``pipecc.passes``: both the planner's
simulator and the distributed runtime import it.
"""

from __future__ import annotations

# NOTE(size): the IR, its text form, its validator and every generator stay together: the
# generators share the private comm placement (_place_comms, _build), and the validator is the
# contract they are tested against; splitting would export those internals.

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import NoReturn

__all__ = [
    "Action",
    "ActionKind",
    "Schedule",
    "SCHEDULES",
    "ScheduleError",
    "BPIPE_POLICIES",
    "bpipe",
    "bpipe_pairs",
    "by_name",
    "format",
    "format_grid",
    "chunk_bounds",
    "gpipe",
    "gpipe_uneven",
    "inference",
    "interleaved_1f1b",
    "one_f_one_b",
    "overlapping",
    "parse",
    "parse_action",
    "validate",
    "zb_h1",
    "zb_v",
]


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
            _check_size_lists(sizes)
            if len(sizes) != self.num_stages:
                raise ValueError(f"microbatch_sizes has {len(sizes)} stage lists for {self.num_stages} stages")
            if self.num_microbatches != max(len(row) for row in sizes):
                raise ValueError(f"num_microbatches is {self.num_microbatches} but the longest size list "
                                 f"has {max(len(row) for row in sizes)} chunks")
            object.__setattr__(self, "microbatch_sizes", sizes)

    def message(self, a: Action) -> tuple[str, int, int] | None:
        """``a.message(self.partner)``: the key of the message ``a`` sends or receives."""
        return a.message(self.partner)

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
            _check_size_lists(sizes)
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
        return format(self)


class ScheduleError(ValueError):
    """A schedule broke a rule. The message is a one-line summary, then the grid.

    ``marks`` lists the offending ``(rank, step)`` cells, marked ``>..<`` in the grid.
    """

    def __init__(self, summary: str, schedule: Schedule, marks: list[tuple[int, int]]):
        self.summary = summary
        self.marks = marks
        super().__init__(f"{summary}\n{format_grid(schedule, marks)}")


# ---------------------------------------------------------------------------- text form

_ACTION_RE = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|SEND_S|RECV_S|SEND_R|RECV_R|F|B|I|W)(\d+)")
_ROW_RE = re.compile(r"rank (\d+):(.*)")
_SIZES_RE = re.compile(r"sizes:(.*)")
_PARTNER_RE = re.compile(r"partner:(.*)")


def _check_size_lists(sizes: Sequence[Sequence[int]]) -> None:
    """ValueError unless ``sizes`` is a non-empty list of non-empty lists of positive ints
    with one common sum."""
    if not sizes or any(len(row) == 0 for row in sizes):
        raise ValueError(f"microbatch_sizes needs one non-empty size list per stage, got {sizes!r}")
    for s, row in enumerate(sizes):
        if any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in row):
            raise ValueError(f"microbatch_sizes of stage {s} must be positive integers, got {list(row)}")
    totals = [sum(row) for row in sizes]
    if len(set(totals)) != 1:
        raise ValueError(f"microbatch_sizes must sum to the same batch on every stage, got sums {totals}")


def chunk_bounds(sizes: Sequence[int]) -> list[int]:
    """Prefix sums ``[0, b0, b0+b1, ..., B]``: chunk ``k`` holds samples ``[bounds[k], bounds[k+1])``."""
    bounds = [0]
    for b in sizes:
        bounds.append(bounds[-1] + b)
    return bounds


def overlapping(sizes_a: Sequence[int], sizes_b: Sequence[int]) -> list[list[int]]:
    """For each chunk ``k`` of split ``b``, the chunks of split ``a`` (same batch) sharing a
    sample with it, ascending. Both splits are contiguous sample intervals in order, so
    each answer is a run of consecutive indices. O(len(a) + len(b))."""
    ea, eb = chunk_bounds(sizes_a), chunk_bounds(sizes_b)
    if ea[-1] != eb[-1]:
        raise ValueError(f"splits of different batches: {list(sizes_a)} sums to {ea[-1]}, "
                         f"{list(sizes_b)} to {eb[-1]}")
    out, j = [], 0
    for k in range(len(sizes_b)):
        lo, hi = eb[k], eb[k + 1]
        while ea[j + 1] <= lo:
            j += 1
        run, i = [], j
        while i < len(sizes_a) and ea[i] < hi:
            run.append(i)
            i += 1
        out.append(run)
    return out


def _format_sizes(sizes: Sequence[Sequence[int]]) -> str:
    return "sizes: " + " | ".join(" ".join(str(b) for b in row) for row in sizes)


def _format_partner(partner: Sequence[int | None]) -> str:
    return "partner: " + " ".join("-" if x is None else str(x) for x in partner)


def _header(schedule: Schedule) -> list[str]:
    """The header lines of the text form: ``sizes:`` (UMPIPE), then ``partner:`` (BPipe)."""
    lines = [] if schedule.microbatch_sizes is None else [_format_sizes(schedule.microbatch_sizes)]
    if schedule.partner is not None:
        lines.append(_format_partner(schedule.partner))
    return lines


def parse_action(text: str) -> Action:
    """``"2RECV_B1"`` -> ``Action(RECV_B, 2, 1)``; ``ValueError`` on anything else."""
    match = _ACTION_RE.fullmatch(text)
    if match is None:
        raise ValueError(f"not an action: {text!r} (expected e.g. '0F3' or '1SEND_B2')")
    return Action(ActionKind(match.group(2)), int(match.group(1)), int(match.group(3)))


def parse(text: str) -> Schedule:
    """Parse the text form: one ``rank N: a a a`` line per rank, ranks 0, 1, ... in order.

    Blank lines are ignored. Placement and sizes are inferred (``Schedule.from_actions``).
    An unequal schedule starts with a line ``sizes: 1 3 4 | 4 4`` (stage 0's chunk sizes,
    then stage 1's, ...); a BPipe schedule has a line ``partner: 3 2 1 0`` (``-``: no partner)
    before the rows.
    """
    rows: list[list[Action]] = []
    sizes: list[list[int]] | None = None
    partner: list[int | None] | None = None
    for line in text.splitlines():
        if not line.strip():
            continue
        sized = _SIZES_RE.fullmatch(line.strip())
        if sized is not None:
            if rows or sizes is not None or partner is not None:
                raise ValueError(f"the 'sizes:' line must come first, once: {line!r}")
            try:
                sizes = [[int(tok) for tok in part.split()] for part in sized.group(1).split("|")]
            except ValueError:
                raise ValueError(f"not a sizes line: {line!r} (expected e.g. 'sizes: 1 3 | 4')") from None
            _check_size_lists(sizes)
            continue
        paired = _PARTNER_RE.fullmatch(line.strip())
        if paired is not None:
            if rows or partner is not None:
                raise ValueError(f"the 'partner:' line must come before the rows, once: {line!r}")
            try:
                partner = [None if tok == "-" else int(tok) for tok in paired.group(1).split()]
            except ValueError:
                raise ValueError(f"not a partner line: {line!r} (expected e.g. 'partner: 3 2 1 0', "
                                 "'-' for no partner)") from None
            continue
        match = _ROW_RE.fullmatch(line.strip())
        if match is None:
            raise ValueError(f"not a schedule row: {line!r} (expected 'rank N: ...')")
        if int(match.group(1)) != len(rows):
            raise ValueError(f"expected 'rank {len(rows)}:', got {line!r}")
        rows.append([parse_action(tok) for tok in match.group(2).split()])
    return Schedule.from_actions(rows, sizes, partner)


def format(schedule: Schedule) -> str:  # noqa: A001 - the IR's name for it; shadows only here
    """The canonical text form, ``parse``'s inverse. No trailing newline."""
    lines = _header(schedule)
    lines += [f"rank {r}:" + "".join(f" {a}" for a in row) for r, row in enumerate(schedule.actions)]
    return "\n".join(lines)


def format_grid(schedule: Schedule, marks: Sequence[tuple[int, int]] = ()) -> str:
    """The schedule as an aligned grid, one row per rank, marked cells as ``>0B1<``."""
    marked = set(marks)
    width = max((len(row) for row in schedule.actions), default=0)
    cells = [
        [(f">{a}<" if (r, i) in marked else f" {a} ") for i, a in enumerate(row)] + [""] * (width - len(row))
        for r, row in enumerate(schedule.actions)
    ]
    col = [max([len(str(i)) + 2] + [len(row[i]) for row in cells]) for i in range(width)]
    label = max(len(f"rank {schedule.num_ranks - 1}:"), len("step"))
    label += 1
    lines = _header(schedule)
    lines.append("step".ljust(label) + "".join(f" {i} ".ljust(col[i]) for i in range(width)).rstrip())
    for r, row in enumerate(cells):
        lines.append(f"rank {r}:".ljust(label) + "".join(c.ljust(col[i]) for i, c in enumerate(row)).rstrip())
    return "\n".join(lines)


# ---------------------------------------------------------------------------- generators


def _place_comms(compute: list[list[Action]], stage_to_rank: tuple[int, ...]) -> tuple[tuple[Action, ...], ...]:
    """Insert SEND/RECV around compute actions wherever neighbouring stages sit on different ranks.

    Receives go just before the compute that needs them and sends just after the compute
    that produces them, which waits least under async sends. O(actions).
    """
    last = len(stage_to_rank) - 1
    rows = []
    for rank, row in enumerate(compute):
        out: list[Action] = []
        for a in row:
            s, mb = a.stage, a.microbatch
            if a.kind is ActionKind.F:
                if s > 0 and stage_to_rank[s - 1] != rank:
                    out.append(Action(ActionKind.RECV_F, s, mb))
                out.append(a)
                if s < last and stage_to_rank[s + 1] != rank:
                    out.append(Action(ActionKind.SEND_F, s, mb))
            elif a.kind is ActionKind.W:  # weights only: nothing to receive or send
                out.append(a)
            else:  # B or I: needs the output gradient, produces the input gradient
                if s < last and stage_to_rank[s + 1] != rank:
                    out.append(Action(ActionKind.RECV_B, s, mb))
                out.append(a)
                if s > 0 and stage_to_rank[s - 1] != rank:
                    out.append(Action(ActionKind.SEND_B, s, mb))
        rows.append(tuple(out))
    return tuple(rows)


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(f"need at least one stage and one microbatch, got p={num_stages}, m={num_microbatches}")


def _build(num_ranks: int, num_microbatches: int, stage_to_rank: tuple[int, ...], compute: list[list[Action]]) -> Schedule:
    return Schedule(num_ranks, len(stage_to_rank), num_microbatches, stage_to_rank, _place_comms(compute, stage_to_rank))


def _F(stage: int, mb: int) -> Action:
    return Action(ActionKind.F, stage, mb)


def _B(stage: int, mb: int) -> Action:
    return Action(ActionKind.B, stage, mb)


def _I(stage: int, mb: int) -> Action:
    return Action(ActionKind.I, stage, mb)


def _W(stage: int, mb: int) -> Action:
    return Action(ActionKind.W, stage, mb)


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: every rank runs all m forwards, then all m backwards in microbatch order.

    Backwards go in order 0..m-1, like torch's ScheduleGPipe (with equal costs the
    makespan is the same either way). Stage s on rank s. Every stage stashes m.
    """
    _check_sizes(num_stages, num_microbatches)
    m = num_microbatches
    compute = [[_F(s, i) for i in range(m)] + [_B(s, i) for i in range(m)] for s in range(num_stages)]
    return _build(num_stages, m, tuple(range(num_stages)), compute)


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush): rank r runs w = min(p-r-1, m) warm-up forwards, then
    alternates F(w+i), B(i), then drains the remaining backwards. Stage r stashes
    min(p-r, m)."""
    _check_sizes(num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    compute = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        row = [_F(r, i) for i in range(warmup)]
        for i in range(m - warmup):
            row += [_F(r, warmup + i), _B(r, i)]
        row += [_B(r, i) for i in range(m - warmup, m)]
        compute.append(row)
    return _build(p, m, tuple(range(p)), compute)


def interleaved_1f1b(num_ranks: int, num_microbatches: int, virtual_stages_per_rank: int) -> Schedule:
    """Megatron-style interleaved 1F1B: rank r holds stages r, r+p, ..., r+(v-1)p.

    Microbatches go round in groups of p: forward step k on a rank runs chunk
    ``(k // p) % v`` on microbatch ``(k // (p*v)) * p + k % p``; backward step k runs
    chunk ``v - 1 - (k // p) % v`` on the same microbatch formula. Rank r warms up with
    ``min(m*v, (v-1)*p + 2*(p-r-1))`` forwards (as in Megatron and torch's
    ScheduleInterleaved1F1B), then alternates F and B, then drains. Requires
    ``m % p == 0``. With v == 1 this is plain ``one_f_one_b``.
    """
    p, m, v = num_ranks, num_microbatches, virtual_stages_per_rank
    _check_sizes(p, m)
    if v < 1:
        raise ValueError(f"virtual_stages_per_rank must be >= 1, got {v}")
    if v == 1:
        return one_f_one_b(p, m)
    if m % p != 0:
        raise ValueError(
            f"interleaved 1F1B needs num_microbatches divisible by num_ranks: m={m}, p={p} "
            f"(use m={((m + p - 1) // p) * p} or plain 1F1B)"
        )

    def microbatch(k: int) -> int:
        return (k // (p * v)) * p + k % p

    def forward(r: int, k: int) -> Action:
        return _F(((k // p) % v) * p + r, microbatch(k))

    def backward(r: int, k: int) -> Action:
        return _B((v - 1 - (k // p) % v) * p + r, microbatch(k))

    total = m * v
    compute = []
    for r in range(p):
        warmup = min(total, (v - 1) * p + 2 * (p - r - 1))
        row = [forward(r, k) for k in range(warmup)]
        for k in range(total - warmup):
            row += [forward(r, warmup + k), backward(r, k)]
        row += [backward(r, k) for k in range(total - warmup, total)]
        compute.append(row)
    return _build(p, m, tuple(s % p for s in range(p * v)), compute)


def zb_h1(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al., *Zero Bubble Pipeline Parallelism*, ICLR 2024, section 3.1): 1F1B
    with each B split into I and W, the W's deferred to fill the drain bubbles.

    Rank r warms up with w = min(p-r-1, m) forwards, as 1F1B; then for i = 0..m-1 it runs
    F(w+i) (while forwards remain), I(i), and after I(i) with i >= r also W(i-r): rank r
    holds back r weight gradients, which run after its last I. Stage r on rank r.

    Memory: a micro-batch is stashed from F to W, so rank r peaks at min(w + 1 + r, m) =
    min(p, m) micro-batches: every rank holds what 1F1B's first rank holds, so the peak over
    ranks equals 1F1B's (the paper's "same peak memory as 1F1B"), while ranks r > 0 hold
    more than under 1F1B (min(p-r, m)). With equal F, I and W times the bubble is
    (p-1)(F + I - W) instead of 1F1B's (p-1)(F + I + W). This is the compute order of torch's
    ScheduleInterleavedZeroBubble with one stage per rank (its ZB1P with v = 1).
    """
    _check_sizes(num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    compute = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        row = [_F(r, i) for i in range(warmup)]
        for i in range(m):
            if warmup + i < m:
                row.append(_F(r, warmup + i))
            row.append(_I(r, i))
            if i >= r:
                row.append(_W(r, i - r))
        row += [_W(r, i) for i in range(max(m - r, 0), m)]
        compute.append(row)
    return _build(p, m, tuple(range(p)), compute)


def zb_v(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-V (Qi et al., ICLR 2024, section 6): 2p stages in a V, rank r holding stage r (down
    the V) and 2p-1-r (back up), each B split into I and W. Ranks p-1's two stages meet at the
    point of the V and hand over locally; the loss is on rank 0.

    Rank r: 2(p-r)-1 forwards down; r pairs (F up, F down); p-r triples (F, I, W up); then
    rounds of (F down while forwards remain, I and W down, F, I and W up) until every forward
    ran; then r pairs of I's (down, up) whose W's wait, p-r pairs (I, W down), and the W's
    left, up first. Planned for max(m, 2p-1) micro-batches, then the missing ones dropped
    (the order of torch's ScheduleZBVZeroBubble). With F = I = W per stage and m >= 2p-1 the
    only bubble is the ramp; a rank holds at most 2p stage-micro-batches of half a 1F1B
    stage, i.e. 1F1B's peak. Not planned or compiled yet: only as a schedule (text or object).
    """
    p, m = num_ranks, num_microbatches
    _check_sizes(p, m)
    n = max(m, 2 * p - 1)
    compute = []
    for r in range(p):
        down, up = r, 2 * p - 1 - r
        row: list[Action] = []
        count = {(k, s): 0 for k in (ActionKind.F, ActionKind.I, ActionKind.W) for s in (down, up)}

        def run(kind: ActionKind, stage: int) -> None:
            row.append(Action(kind, stage, count[(kind, stage)]))
            count[(kind, stage)] += 1

        for _ in range(2 * (p - r) - 1):
            run(ActionKind.F, down)
        for _ in range(r):
            run(ActionKind.F, up), run(ActionKind.F, down)
        for _ in range(p - r):
            run(ActionKind.F, up), run(ActionKind.I, up), run(ActionKind.W, up)
        while count[(ActionKind.F, up)] < count[(ActionKind.F, down)] or count[(ActionKind.F, down)] < n:
            if count[(ActionKind.F, down)] < n:
                run(ActionKind.F, down)
            run(ActionKind.I, down), run(ActionKind.W, down)
            run(ActionKind.F, up), run(ActionKind.I, up), run(ActionKind.W, up)
        for _ in range(r):
            run(ActionKind.I, down), run(ActionKind.I, up)
        for _ in range(p - r):
            run(ActionKind.I, down), run(ActionKind.W, down)
        for stage in (up, down):
            while count[(ActionKind.W, stage)] < count[(ActionKind.I, stage)]:
                run(ActionKind.W, stage)
        compute.append([a for a in row if a.microbatch < m])
    placement = tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p))
    return _build(p, m, placement, compute)


def _place_comms_uneven(
    compute: list[list[Action]], stage_to_rank: tuple[int, ...], sizes: tuple[tuple[int, ...], ...]
) -> tuple[tuple[Action, ...], ...]:
    """``_place_comms`` for per-stage chunk sizes: before ``F(s, k)`` receive every chunk of
    ``s-1`` overlapping it not yet received; after ``F(s, k)`` send it whole; before ``B(s, k)``
    (or ``I``) receive its gradient; after it, send the gradient of every chunk of ``s-1`` whose
    overlapping chunks of ``s`` have all run their backward. O(actions + chunks)."""
    last = len(stage_to_rank) - 1
    needs = [[]] + [overlapping(sizes[s - 1], sizes[s]) for s in range(1, last + 1)]  # [s][k] -> chunks of s-1
    covers = [overlapping(sizes[s + 1], sizes[s]) for s in range(last)]  # [s][j] -> chunks of s+1
    rows = []
    for rank, row in enumerate(compute):
        out: list[Action] = []
        received: set[tuple[int, int]] = set()
        graded: set[tuple[int, int]] = set()
        sent: set[tuple[int, int]] = set()
        for a in row:
            s, k = a.stage, a.microbatch
            if a.kind is ActionKind.F:
                if s > 0 and stage_to_rank[s - 1] != rank:
                    for j in needs[s][k]:
                        if (s, j) not in received:
                            received.add((s, j))
                            out.append(Action(ActionKind.RECV_F, s, j))
                out.append(a)
                if s < last and stage_to_rank[s + 1] != rank:
                    out.append(Action(ActionKind.SEND_F, s, k))
            elif a.kind is ActionKind.W:
                out.append(a)
            else:
                if s < last and stage_to_rank[s + 1] != rank:
                    out.append(Action(ActionKind.RECV_B, s, k))
                out.append(a)
                graded.add((s, k))
                if s > 0 and stage_to_rank[s - 1] != rank:
                    for j in needs[s][k]:
                        if (s, j) not in sent and all((s, i) in graded for i in covers[s - 1][j]):
                            sent.add((s, j))
                            out.append(Action(ActionKind.SEND_B, s, j))
        rows.append(tuple(out))
    return tuple(rows)


def gpipe_uneven(sizes: Sequence[Sequence[int]], num_ranks: int | None = None) -> Schedule:
    """GPipe with per-stage chunk sizes (UMPIPE, tied mode: one list per stage for its forward
    and backward chunks): stage ``s`` on rank ``s`` runs ``F(s, 0..K_s-1)`` then
    ``B(s, 0..K_s-1)`` in sample order. Messages carry whole chunks of the upstream stage
    (module docstring); ``F(s, k)`` first receives every upstream chunk it overlaps, and the
    gradient of upstream chunk ``j`` goes out right after the last ``B`` overlapping it.
    Every stage stashes the whole batch (``stash_sample_profile``). With equal lists the
    actions are ``gpipe``'s.

    ``num_ranks`` (default: one rank per stage) must divide the stage count; rank ``r`` then
    holds stages ``r, r + p, ...`` (interleaved placement; ``num_ranks=1`` runs every stage in
    one process) and runs all its stages' forwards in stage order, then all their backwards in
    reverse stage order. Raises ValueError for size lists that are empty, not positive or of
    different sums, or a rank count that does not divide the stages.
    """
    table = tuple(tuple(row) for row in sizes)
    _check_size_lists(table)
    p = len(table) if num_ranks is None else num_ranks
    if p < 1 or len(table) % p:
        raise ValueError(f"{len(table)} stages do not divide over {p} ranks")
    placement = tuple(s % p for s in range(len(table)))
    compute = []
    for r in range(p):
        mine = [s for s in range(len(table)) if placement[s] == r]
        row = [_F(s, k) for s in mine for k in range(len(table[s]))]
        row += [_B(s, k) for s in reversed(mine) for k in range(len(table[s]))]
        compute.append(row)
    m = max(len(row) for row in table)
    return Schedule(p, len(table), m, placement, _place_comms_uneven(compute, placement, table), table)


# ---------------------------------------------------------------------------- BPipe

BPIPE_POLICIES = ("jit", "eager")


def bpipe_pairs(num_stages: int) -> list[tuple[int, int]]:
    """BPipe's (evictor, acceptor) pairs: ``(s, p-1-s)`` for ``s < p // 2`` (PAPERS-SPEC.md 2.3);
    with odd ``p`` the middle stage has no partner."""
    return [(s, num_stages - 1 - s) for s in range(num_stages // 2)]


def _unit_times(base: Schedule, backward: float) -> dict[Action, tuple[float, float]]:
    """(start, end) of every compute action of a one-stage-per-rank schedule when every F takes
    1 and every B ``backward`` and messages are free: the clock the BPipe generator aligns the
    acceptor's returns with."""
    last = base.num_stages - 1
    done: dict[Action, tuple[float, float]] = {}
    pc, clock = [0] * base.num_ranks, [0.0] * base.num_ranks
    progress = True
    while progress:
        progress = False
        for r, row in enumerate(base.actions):
            while pc[r] < len(row):
                a = row[pc[r]]
                if a.kind.is_compute:
                    s, mb = a.stage, a.microbatch
                    if a.kind is ActionKind.F:
                        deps = [_F(s - 1, mb)] if s > 0 else []
                    else:
                        deps = [_F(s, mb)] + ([_B(s + 1, mb)] if s < last else [])
                    if any(d not in done for d in deps):
                        break
                    start = max([clock[r]] + [done[d][1] for d in deps])
                    clock[r] = start + (1.0 if a.kind is ActionKind.F else backward)
                    done[a] = (start, clock[r])
                pc[r] += 1
                progress = True
    return done


def _evictions(compute: list[Action], stage: int, threshold: int, policy: str
               ) -> tuple[dict[int, list[Action]], dict[int, list[Action]]]:
    """The evictor's stash actions around its compute actions: ``(before, after)``, each
    compute index -> actions. A stash counts as resident from its F (or its return) until its
    B or its eviction; after F(j), more than ``threshold`` resident evicts j, the newest.
    "jit" takes stash j back one compute step before B(j); "eager" takes the oldest remote
    stash back after every B that leaves fewer than ``threshold`` resident (and, either way,
    one still away is taken back right before its B)."""
    before: dict[int, list[Action]] = {}
    after: dict[int, list[Action]] = {}
    resident, remote = 0, []  # remote: evicted micro-batches, oldest first

    def take_back(where: dict[int, list[Action]], i: int, mb: int) -> None:
        nonlocal resident
        remote.remove(mb)
        where.setdefault(i, []).append(Action(ActionKind.RECV_R, stage, mb))
        resident += 1

    for i, c in enumerate(compute):
        nxt = compute[i + 1] if i + 1 < len(compute) else None
        if policy == "jit" and nxt is not None and nxt.kind is ActionKind.B and nxt.microbatch in remote:
            take_back(before, i, nxt.microbatch)
        if c.kind is ActionKind.B and c.microbatch in remote:
            take_back(before, i, c.microbatch)
        if c.kind is ActionKind.F:
            resident += 1
            if resident > threshold:
                after.setdefault(i, []).append(Action(ActionKind.SEND_S, stage, c.microbatch))
                remote.append(c.microbatch)
                resident -= 1
        else:
            resident -= 1
            while policy == "eager" and remote and resident < threshold:
                take_back(after, i, min(remote))
    return before, after


def _insert(row: Sequence[Action], before: dict[int, list[Action]], after: dict[int, list[Action]]) -> tuple[Action, ...]:
    """``row`` with ``before[i]`` right before its i-th compute action (after that action's
    receives) and ``after[i]`` after it and its sends."""
    out: list[Action] = []
    pending: list[Action] = []
    index = 0
    for x in row:
        if x.kind.is_compute or x.kind.is_recv:
            out += pending
            pending = []
        if x.kind.is_compute:
            out += before.get(index, [])
            out.append(x)
            pending = list(after.get(index, []))
            index += 1
        else:
            out.append(x)
    return tuple(out + pending)


def bpipe(base: Schedule, thresholds: Sequence[int | None], policy: str = "jit",
          backward_ratio: float = 2.0) -> Schedule:
    """BPipe (PAPERS-SPEC.md 2.3-2.4): ``base`` (``one_f_one_b(p, m)``) with stash transfers
    between each evictor ``s`` (``thresholds[s]`` = K_s, not None) and its acceptor ``p-1-s``.

    Evictor ``s``: after ``F(s, j)`` (and its SEND_F), if more than K_s of its stashes are
    resident, ``SEND_S`` the newest (j, needed last); it takes j back with ``RECV_R(s, j)``
    one compute step before ``B(s, j)`` ("jit", a prefetch of one), or after each B that
    leaves fewer than K_s resident, oldest first ("eager"). Resident counts include a
    returned stash, so the evictor peaks at K_s + 1 (the F that overflows, before its SEND_S:
    PAPERS-SPEC.md 2.10 item 1). Acceptor ``a = p-1-s``: ``RECV_S(j)`` right after its
    ``F(a, j)``, which needs the evictor's F(s, j) anyway; ``SEND_R(j)`` after its last
    compute that ends, on a clock where F costs 1 and B ``backward_ratio`` and messages are
    free, no later than the evictor's RECV_R(j) starts (never before its RECV_S(j)). Every
    stash dependency then points forward on that clock, so ``validate`` finds no deadlock.

    Raises ValueError unless ``base`` is plain 1F1B (one stage per rank, equal micro-batches,
    no partner), ``thresholds`` has one entry per stage, only stages ``s < p // 2`` have one,
    each at least 1, and ``policy`` is one of ``BPIPE_POLICIES``. All None: ``base`` itself.
    """
    p, m = base.num_stages, base.num_microbatches
    if policy not in BPIPE_POLICIES:
        raise ValueError(f"unknown BPipe policy {policy!r}; choose from {', '.join(BPIPE_POLICIES)}")
    if base.partner is not None or base.uneven or base.num_ranks != p or base != one_f_one_b(p, m):
        raise ValueError("BPipe inserts its transfers into plain 1F1B (one stage per rank, equal "
                         "micro-batches): build the base with one_f_one_b(p, m)")
    if len(thresholds) != p:
        raise ValueError(f"thresholds needs one entry per stage ({p}), got {len(thresholds)}")
    partner: list[int | None] = [None] * p
    for s, k in enumerate(thresholds):
        if k is None:
            continue
        if s >= p // 2:
            raise ValueError(f"stage {s} cannot evict: BPipe evictors are stages s < p//2 = {p // 2}, "
                             f"paired with p-1-s")
        if isinstance(k, bool) or int(k) != k or k < 1:
            raise ValueError(f"threshold of stage {s} must be an integer >= 1, got {k!r}")
        partner[s], partner[p - 1 - s] = p - 1 - s, s
    if all(x is None for x in partner):
        return base
    clock = _unit_times(base, backward_ratio)
    rows = [list(row) for row in base.actions]
    for s, k in enumerate(thresholds):
        if k is None:
            continue
        a = p - 1 - s
        compute = [x for x in base.actions[s] if x.kind.is_compute]
        before, after = _evictions(compute, s, int(k), policy)
        rows[s] = list(_insert(base.actions[s], before, after))
        needed_at: dict[int, float] = {}  # j -> when the evictor's RECV_R(j) starts on the clock
        for where, at_start in ((before, True), (after, False)):
            for i, acts in where.items():
                span = clock[compute[i]]
                for x in acts:
                    if x.kind is ActionKind.RECV_R:
                        needed_at[x.microbatch] = span[0] if at_start else span[1]
        mine = [x for x in base.actions[a] if x.kind.is_compute]
        position = {x: i for i, x in enumerate(mine)}
        acc_after: dict[int, list[Action]] = {}
        for j in sorted(needed_at):
            acc_after.setdefault(position[_F(a, j)], []).append(Action(ActionKind.RECV_S, a, j))
        for j in sorted(needed_at):
            first = position[_F(a, j)]
            last = max([first] + [i for i in range(first, len(mine)) if clock[mine[i]][1] <= needed_at[j]])
            acc_after.setdefault(last, []).append(Action(ActionKind.SEND_R, a, j))
        rows[a] = list(_insert(base.actions[a], {}, acc_after))
    return Schedule(p, p, m, base.stage_to_rank, tuple(tuple(r) for r in rows), None, tuple(partner))


def inference(num_stages: int, num_microbatches: int) -> Schedule:
    """Forwards only: rank s runs F(s, 0..m-1)."""
    _check_sizes(num_stages, num_microbatches)
    compute = [[_F(s, i) for i in range(num_microbatches)] for s in range(num_stages)]
    return _build(num_stages, num_microbatches, tuple(range(num_stages)), compute)


# ---------------------------------------------------------------------------- validation


def _remote(schedule: Schedule, neighbour: int, rank: int) -> bool:
    """True when stage ``neighbour`` exists and sits on a rank other than ``rank``."""
    return 0 <= neighbour < schedule.num_stages and schedule.stage_to_rank[neighbour] != rank


def _message_peer(schedule: Schedule, key: tuple[str, int, int], sending: bool) -> int:
    """The stage at the other end of message ``key`` from the sender's (``sending``) or the
    receiver's side."""
    kind, stage, _ = key
    if kind == "F":
        return stage if sending else stage - 1
    if kind == "B":
        return stage if sending else stage + 1
    acceptor = schedule.partner[stage] if schedule.partner is not None else None
    acceptor = stage if acceptor is None else acceptor
    # "S": evictor -> acceptor; "R": acceptor -> evictor
    return (acceptor if kind == "S" else stage) if sending else (stage if kind == "S" else acceptor)


def _check_pairing(schedule: Schedule, fail: Callable[..., NoReturn]) -> None:
    """BPipe pairs (PAPERS-SPEC.md 2.3): one stage per rank, stage s with p-1-s for s < p//2,
    symmetric; anything else is an odd pairing."""
    p, partner = schedule.num_stages, schedule.partner
    assert partner is not None
    if schedule.num_ranks != p:
        fail(f"BPipe needs one stage per rank, got {p} stages on {schedule.num_ranks} ranks")
    for s, a in enumerate(partner):
        if a is None:
            continue
        if a == s:
            fail(f"odd BPipe pairing: stage {s} is paired with itself (pairs are (s, {p - 1}-s))")
        if not 0 <= a < p or partner[a] != s:
            fail(f"odd BPipe pairing: partner of stage {s} is {a} but partner of {a} is "
                 f"{partner[a] if 0 <= a < p else 'out of range'} (pairs are symmetric)")
        if a != p - 1 - s:
            fail(f"odd BPipe pairing: stage {s} paired with {a}; BPipe pairs stage s with p-1-s = {p - 1 - s}")


def _check_stash_role(schedule: Schedule, a: Action, r: int, i: int, fail: Callable[..., NoReturn]) -> None:
    """A stash action runs on a stage with a partner: SEND_S/RECV_R on the evictor (the lower
    stage of the pair), RECV_S/SEND_R on the acceptor."""
    partner = schedule.partner
    if partner is None or partner[a.stage] is None:
        fail(f"rank {r} step {i}: {a} but stage {a.stage} has no BPipe partner (add a 'partner:' line)", (r, i))
    evicting = a.kind in (ActionKind.SEND_S, ActionKind.RECV_R)
    if evicting != schedule.is_evictor(a.stage):
        role = "evictor" if evicting else "acceptor"
        fail(f"rank {r} step {i}: {a} runs on stage {a.stage}, which is not the {role} of its pair "
             f"(the lower stage of a pair evicts)", (r, i))
    if not schedule.is_training:
        fail(f"rank {r} step {i}: {a} in a forward-only schedule", (r, i))


def validate(schedule: Schedule) -> None:
    """Raise ``ScheduleError`` unless the schedule is complete, ordered, matched and deadlock-free.

    With ``microbatch_sizes``, counts are per stage and the dependencies follow the overlap
    of chunks (module docstring): F after every upstream chunk it overlaps, SEND_B after the
    backward of every chunk overlapping the upstream chunk it returns.

    Checks, in order: (1) every action is in range, on the rank owning its stage, and
    appears once; SEND/RECV only cross ranks; every (stage, mb) has one F and, if the
    schedule trains, either one B or one I and one W (never B with I or W); (2) every SEND
    has its RECV and vice versa; (3) along each row, local inputs come first: F after its
    RECV_F (or the local F of stage-1), B or I after its own F and its RECV_B (or the local
    B or I of stage+1), W after its own I, SEND_F after the F, SEND_B after the B or I;
    (4) running all rows with async sends and blocking receives finishes.
    BPipe (``partner``): pairs are (s, p-1-s), one stage per rank; SEND_S/RECV_R only on the
    evictor, RECV_S/SEND_R only on the acceptor; every SEND_S has its RECV_R; SEND_S after the
    F, RECV_R after the SEND_S and before the B, SEND_R after the RECV_S; stash messages take
    part in matching (2) and in the deadlock run (4).
    The first broken rule is raised. O(R * A) for R ranks and A actions (O(A) in practice).
    """
    S = schedule.num_stages
    owner = schedule.stage_to_rank
    training = schedule.is_training

    def fail(summary: str, *marks: tuple[int, int]) -> NoReturn:
        raise ScheduleError(summary, schedule, list(marks))

    # (1) ownership, range, uniqueness, completeness
    if schedule.partner is not None:
        _check_pairing(schedule, fail)
    where: dict[Action, tuple[int, int]] = {}
    for r, row in enumerate(schedule.actions):
        for i, a in enumerate(row):
            if not (0 <= a.stage < S):
                fail(f"rank {r} step {i}: {a} is out of range (stages 0..{S - 1})", (r, i))
            if not (0 <= a.microbatch < schedule.index_range(a)):
                m = schedule.index_range(a)
                fail(f"rank {r} step {i}: {a} is out of range (stages 0..{S - 1}, microbatches 0..{m - 1})", (r, i))
            if owner[a.stage] != r:
                fail(f"rank {r} step {i}: {a} runs on rank {r} but stage {a.stage} is on rank {owner[a.stage]}", (r, i))
            if a in where:
                fail(f"rank {r} step {i}: {a} appears twice", where[a], (r, i))
            if a.kind in (ActionKind.SEND_F, ActionKind.RECV_B) and not _remote(schedule, a.stage + 1, r):
                fail(f"rank {r} step {i}: {a} but stage {a.stage + 1} is not on another rank", (r, i))
            if a.kind in (ActionKind.SEND_B, ActionKind.RECV_F) and not _remote(schedule, a.stage - 1, r):
                fail(f"rank {r} step {i}: {a} but stage {a.stage - 1} is not on another rank", (r, i))
            if a.kind is ActionKind.RECV_B and not training:
                fail(f"rank {r} step {i}: {a} in a forward-only schedule", (r, i))
            if a.kind.is_stash:
                _check_stash_role(schedule, a, r, i, fail)
            where[a] = (r, i)
    for s in range(S):
        if owner[s] == -1:
            fail(f"stage {s} has no actions")
        for mb in range(schedule.chunks(s)):
            if _F(s, mb) not in where:
                fail(f"missing {_F(s, mb)}: forward of stage {s} microbatch {mb} never runs")
            if not training:
                continue
            split = [x for x in (_I(s, mb), _W(s, mb)) if x in where]
            if _B(s, mb) in where and split:
                fail(f"{_B(s, mb)} and {split[0]}: stage {s} microbatch {mb} runs its backward twice "
                     f"(either B, or I then W)", where[_B(s, mb)], where[split[0]])
            if _B(s, mb) not in where and not split:
                fail(f"missing {_B(s, mb)}: backward of stage {s} microbatch {mb} never runs", where[_F(s, mb)])
            for x, y in ((_I(s, mb), _W(s, mb)), (_W(s, mb), _I(s, mb))):
                if x in where and y not in where:
                    fail(f"missing {y}: stage {s} microbatch {mb} has {x} but not {y} "
                         f"(a split backward needs both I and W)", where[x])

    for a, (r, i) in where.items():  # an evicted stash comes back before its backward
        if a.kind is ActionKind.SEND_S and Action(ActionKind.RECV_R, a.stage, a.microbatch) not in where:
            fail(f"rank {r} step {i}: {a} evicts a stash that never comes back "
                 f"(missing {Action(ActionKind.RECV_R, a.stage, a.microbatch)})", (r, i))
        if a.kind is ActionKind.RECV_R and Action(ActionKind.SEND_S, a.stage, a.microbatch) not in where:
            fail(f"rank {r} step {i}: {a} takes back a stash that was never evicted "
                 f"(missing {Action(ActionKind.SEND_S, a.stage, a.microbatch)})", (r, i))

    # (2) matching
    sends = {schedule.message(a): where[a] for a in where if a.kind.is_send}
    recvs = {schedule.message(a): where[a] for a in where if a.kind.is_recv}
    for key, (r, i) in sends.items():
        if key not in recvs:
            dst = _message_peer(schedule, key, sending=True)
            fail(f"rank {r} step {i}: {schedule.actions[r][i]} has no matching receive on rank {owner[dst]}", (r, i))
    for key, (r, i) in recvs.items():
        if key not in sends:
            src = _message_peer(schedule, key, sending=False)
            fail(f"rank {r} step {i}: {schedule.actions[r][i]} has no matching send on rank {owner[src]}", (r, i))

    # (3) per-row order of local dependencies
    def grad_of(stage: int, mb: int) -> Action:
        """The action that produces stage's input gradient: its B, or its I when split."""
        return _I(stage, mb) if _I(stage, mb) in where else _B(stage, mb)

    def before(need: Action, r: int, i: int, a: Action, why: str) -> None:
        got = where.get(need)
        if got is None or got[0] != r or got[1] > i:
            fail(f"rank {r} step {i}: {a} runs before {need} ({why})", (r, i))

    for r, row in enumerate(schedule.actions):
        for i, a in enumerate(row):
            s, mb, k = a.stage, a.microbatch, a.kind
            prev_remote, next_remote = _remote(schedule, s - 1, r), _remote(schedule, s + 1, r)
            if k is ActionKind.F and s > 0:
                for j in schedule.forward_inputs(s, mb):
                    need = Action(ActionKind.RECV_F, s, j) if prev_remote else _F(s - 1, j)
                    before(need, r, i, a, "its input")
            elif k in (ActionKind.B, ActionKind.I):
                before(_F(s, mb), r, i, a, "backward needs its forward")
                if s < S - 1:
                    if next_remote:
                        before(Action(ActionKind.RECV_B, s, mb), r, i, a, "its output gradient")
                    else:
                        for j in schedule.gradient_inputs(s, mb):
                            before(grad_of(s + 1, j), r, i, a, "its output gradient")
            elif k is ActionKind.W:
                before(_I(s, mb), r, i, a, "the weight gradient comes after the input gradient")
            elif k is ActionKind.SEND_F:
                before(_F(s, mb), r, i, a, "sends the forward's output")
            elif k is ActionKind.SEND_B:
                for j in schedule.gradient_inputs(s - 1, mb):
                    before(grad_of(s, j), r, i, a, "sends the backward's input gradient")
            elif k is ActionKind.SEND_S:
                before(_F(s, mb), r, i, a, "evicts the stash its forward made")
            elif k is ActionKind.RECV_R:
                before(Action(ActionKind.SEND_S, s, mb), r, i, a, "takes back what it evicted")
                back = where.get(grad_of(s, mb))
                if back is not None and back[0] == r and back[1] < i:
                    fail(f"rank {r} step {i}: {a} runs after {grad_of(s, mb)} (the backward needs its "
                         f"stash back first)", (r, i), back)
            elif k is ActionKind.SEND_R:
                before(Action(ActionKind.RECV_S, s, mb), r, i, a, "returns what it accepted")

    # (4) deadlock: advance every row until it blocks on a receive whose send has not run
    pc = [0] * schedule.num_ranks
    sent: set[tuple[str, int, int]] = set()
    progress = True
    while progress:
        progress = False
        for r, row in enumerate(schedule.actions):
            while pc[r] < len(row):
                a = row[pc[r]]
                if a.kind.is_recv and schedule.message(a) not in sent:
                    break
                if a.kind.is_send:
                    sent.add(schedule.message(a))
                pc[r] += 1
                progress = True
    stuck = [(r, pc[r]) for r in range(schedule.num_ranks) if pc[r] < len(schedule.actions[r])]
    if stuck:
        waits = ", ".join(f"rank {r} at step {i} ({schedule.actions[r][i]})" for r, i in stuck)
        fail(f"deadlock: every unfinished rank waits on a receive: {waits}", *stuck)


# Every schedule by its name, as plans, `pipecc run --schedule` and the simulator spell it.
SCHEDULES = ("gpipe", "1f1b", "interleaved", "inference", "zb-h1")
ZERO_BUBBLE = ("zb-h1",)  # the schedules whose backward is split into I and W actions

# What pipecc's runtime pays for the split: its I and W together cost SPLIT_BACKWARD_COST times
# one plain backward B, each part scaled alike. Measured on CPU (one thread, middle stages of
# Linear+ReLU chains, best of 30; pipecc.runtime.split_backward's docstring): I + W = 1.14-1.29 B
# through torch's split, whose graph analysis and hooks run in Python per micro-batch; the
# paper's split costs 1.0 B. The planner, the report's timeline and `run --json`'s predictions
# all use it; re-measure on another machine (`pipecc run --json` shows backward_s per stage).
SPLIT_BACKWARD_COST = 1.2


def by_name(name: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The schedule called `name` over `num_ranks` ranks (`virtual_stages` stages per rank for
    "interleaved"; the others hold one stage per rank). The one map from a schedule's name to
    its builder: the planner, the simulator's report and the runtime all go through it.

    Raises ValueError for an unknown name or a stage count the schedule cannot hold.
    """
    if name == "interleaved":
        return interleaved_1f1b(num_ranks, num_microbatches, virtual_stages)
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose from {', '.join(SCHEDULES)}")
    if virtual_stages != 1:
        raise ValueError(f"schedule {name!r} puts one stage on each rank, got {virtual_stages} per "
                            "rank; use the interleaved schedule")
    builder = {"gpipe": gpipe, "1f1b": one_f_one_b, "inference": inference, "zb-h1": zb_h1}[name]
    return builder(num_ranks, num_microbatches)
