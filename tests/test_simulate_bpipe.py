"""The simulator with BPipe: stash transfers on the pair's links, prefetched returns and the
timeline memory sweep (PAPERS-SPEC.md 2.4, 2.10)."""

from __future__ import annotations

import math

import pytest

from passes.simulate import StageCosts, _peak_memory, _peak_memory_timeline, simulate
from pipecc.ir.schedule import ActionKind, gpipe, interleaved_1f1b, one_f_one_b
from pipecc.techniques.bpipe.schedule import bpipe


def balanced(p: int) -> list[int | None]:
    k = math.ceil((p + 1) / 2)
    return [k if s < p // 2 else None for s in range(p)]


@pytest.mark.parametrize("schedule", [one_f_one_b(4, 8), gpipe(3, 5), interleaved_1f1b(2, 4, 2)])
def test_timeline_sweep_equals_row_walk_without_bpipe(schedule) -> None:
    n, m = schedule.num_stages, schedule.num_microbatches
    costs = StageCosts.per_stage(m, [1.0 + s for s in range(n)], [2.0] * n, [0.3] * n, [0.3] * n,
                                 [10.0 * (s + 1) for s in range(n)], [5.0] * n)
    tl = simulate(schedule, costs)
    walk = [_peak_memory(schedule, costs, r, True) for r in range(schedule.num_ranks)]
    assert _peak_memory_timeline(schedule, costs, tl.events) == pytest.approx(walk)


def test_free_transfers_cost_nothing_and_balance_memory() -> None:
    p, m = 8, 32
    costs = StageCosts.uniform(p, m, 1.0, 2.0, 0.1, activation_bytes=1.0, static_bytes=100.0)
    base = simulate(one_f_one_b(p, m), costs)
    costs.stash_transfer_s = [[0.0] * m for _ in range(p)]
    sched = bpipe(one_f_one_b(p, m), balanced(p))
    tl = simulate(sched, costs)
    assert tl.iteration_s == pytest.approx(base.iteration_s)
    assert base.peak_memory_bytes == [108.0, 107.0, 106.0, 105.0, 104.0, 103.0, 102.0, 101.0]
    assert tl.peak_memory_bytes == [100.0 + c for c in sched.stash_profile()] == [106.0, 106.0, 106.0, 105.0,
                                                                                   104.0, 104.0, 104.0, 104.0]


def test_stash_transfers_use_the_pair_link_and_slow_ones_show() -> None:
    p, m = 4, 8
    costs = StageCosts.uniform(p, m, 1.0, 2.0, 0.1, activation_bytes=1.0)
    sched = bpipe(one_f_one_b(p, m), [2, None, None, None])
    free, fast, slow = (simulate(sched, StageCosts(**{**costs.__dict__, "stash_transfer_s": [[t] * m] * p}))
                        for t in (0.0, 0.2, 6.0))
    sends = [e for e in fast.events if e.kind is ActionKind.SEND_S]
    assert sends and all(e.rank == 0 and e.peer == 3 for e in sends)
    assert all(e.rank == 3 and e.peer == 0 for e in fast.events if e.kind is ActionKind.SEND_R)
    base = simulate(one_f_one_b(p, m), costs)
    assert fast.iteration_s == pytest.approx(base.iteration_s)  # hidden behind compute
    assert slow.iteration_s > base.iteration_s + 1.0            # not hidden: charged
    # while a stash moves both ends hold it: a transfer that ends inside the next F costs the
    # evictor that F's share so far (its stash grows linearly over the F), a slow one the saving
    assert free.peak_memory_bytes[0] == 3.0 == sched.stash_profile()[0]
    assert fast.peak_memory_bytes[0] == pytest.approx(3.2)
    assert slow.peak_memory_bytes[0] == base.peak_memory_bytes[0] == 4.0


def test_stash_table_shape_is_checked() -> None:
    costs = StageCosts.uniform(2, 3, 1.0, 2.0)
    costs.stash_transfer_s = [[0.0] * 2] * 2
    with pytest.raises(ValueError, match="stash_transfer_s"):
        simulate(one_f_one_b(2, 3), costs)
