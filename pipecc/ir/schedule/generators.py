"""The schedule generators: GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V and forward-only
inference, each a pure function of (ranks or stages, micro-batches) to a ``Schedule``.

Every generator (``gpipe_compute``, ``one_f_one_b_compute``, ...) lists each rank's compute
actions only: F, B or I and W, in the order the rank runs them. The SEND/RECV between stages on
different ranks are added afterwards, by one rule for every schedule
(``pipecc.ir.schedule.sendrecv.add_send_recv``, which ``schedule_for`` applies);
``gpipe``, ``one_f_one_b``, ... are the generators so lowered: the schedules that run,
unvalidated (``pipecc.ir.schedule.validate`` states the communication semantics they are proved
against).
"""

from __future__ import annotations

from pipecc.ir.schedule.actions import _B, _F, _I, _W, Action, ActionKind, Schedule
from pipecc.ir.schedule.sendrecv import add_send_recv

__all__ = ["gpipe", "gpipe_compute", "inference", "inference_compute", "interleaved_1f1b", "interleaved_1f1b_compute",
           "one_f_one_b", "one_f_one_b_compute", "zb_h1", "zb_h1_compute", "zb_v", "zb_v_compute"]


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(f"need at least one stage and one microbatch, got p={num_stages}, m={num_microbatches}")


def _build(num_ranks: int, num_microbatches: int, stage_to_rank: tuple[int, ...],
           compute: list[list[Action]]) -> Schedule:
    """The compute-only schedule of rows ``compute`` (no SEND/RECV: ``add_send_recv`` adds them)."""
    rows = tuple(tuple(row) for row in compute)
    return Schedule(num_ranks, len(stage_to_rank), num_microbatches, stage_to_rank, rows)


def gpipe_compute(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: every rank runs all m forwards, then all m backwards in microbatch order.

    Backwards go in order 0..m-1, like torch's ScheduleGPipe (with equal costs the
    makespan is the same either way). Stage s on rank s. Every stage stashes m.
    """
    _check_sizes(num_stages, num_microbatches)
    m = num_microbatches
    compute = [[_F(s, i) for i in range(m)] + [_B(s, i) for i in range(m)] for s in range(num_stages)]
    return _build(num_stages, m, tuple(range(num_stages)), compute)


def one_f_one_b_compute(num_stages: int, num_microbatches: int) -> Schedule:
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


def interleaved_1f1b_compute(num_ranks: int, num_microbatches: int, virtual_stages_per_rank: int) -> Schedule:
    """Megatron-style interleaved 1F1B: rank r holds stages r, r+p, ..., r+(v-1)p.

    Microbatches go round in groups of p: forward step k on a rank runs chunk
    ``(k // p) % v`` on microbatch ``(k // (p*v)) * p + k % p``; backward step k runs
    chunk ``v - 1 - (k // p) % v`` on the same microbatch formula. Rank r warms up with
    ``min(m*v, (v-1)*p + 2*(p-r-1))`` forwards (as in Megatron and torch's
    ScheduleInterleaved1F1B), then alternates F and B, then drains. Requires
    ``m % p == 0``. With v == 1 this is plain ``one_f_one_b_compute``.
    """
    p, m, v = num_ranks, num_microbatches, virtual_stages_per_rank
    _check_sizes(p, m)
    if v < 1:
        raise ValueError(f"virtual_stages_per_rank must be >= 1, got {v}")
    if v == 1:
        return one_f_one_b_compute(p, m)
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


def zb_h1_compute(num_stages: int, num_microbatches: int) -> Schedule:
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


def zb_v_compute(num_ranks: int, num_microbatches: int) -> Schedule:
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



def inference_compute(num_stages: int, num_microbatches: int) -> Schedule:
    """Forwards only: rank s runs F(s, 0..m-1)."""
    _check_sizes(num_stages, num_microbatches)
    compute = [[_F(s, i) for i in range(num_microbatches)] for s in range(num_stages)]
    return _build(num_stages, num_microbatches, tuple(range(num_stages)), compute)


# ---------------------------------------------------------------------------- lowered


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """``gpipe_compute`` with its SEND/RECV (``add_send_recv``)."""
    return add_send_recv(gpipe_compute(num_stages, num_microbatches))


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """``one_f_one_b_compute`` with its SEND/RECV (``add_send_recv``)."""
    return add_send_recv(one_f_one_b_compute(num_stages, num_microbatches))


def interleaved_1f1b(num_ranks: int, num_microbatches: int, virtual_stages_per_rank: int) -> Schedule:
    """``interleaved_1f1b_compute`` with its SEND/RECV (``add_send_recv``)."""
    return add_send_recv(interleaved_1f1b_compute(num_ranks, num_microbatches, virtual_stages_per_rank))


def zb_h1(num_stages: int, num_microbatches: int) -> Schedule:
    """``zb_h1_compute`` with its SEND/RECV (``add_send_recv``)."""
    return add_send_recv(zb_h1_compute(num_stages, num_microbatches))


def zb_v(num_ranks: int, num_microbatches: int) -> Schedule:
    """``zb_v_compute`` with its SEND/RECV (``add_send_recv``)."""
    return add_send_recv(zb_v_compute(num_ranks, num_microbatches))


def inference(num_stages: int, num_microbatches: int) -> Schedule:
    """``inference_compute`` with its SEND/RECV (``add_send_recv``)."""
    return add_send_recv(inference_compute(num_stages, num_microbatches))
