"""Golden schedule text over a large grid: every registered schedule by name x ranks x
micro-batches x stages per rank, ZB-V, UMPIPE's uneven GPipe and 1F1B and BPipe's 1F1B, as
``schedule_for`` (or the generator) builds them, in the text form of ``schedule.txt``.

The grid's text is too long to keep; its SHA-256 is kept in tests/golden/schedule_grid.sha256.
The text was recorded before the generators' SEND/RECV moved into one lowering
(``pipecc.ir.schedule.sendrecv``): any change to where a generator, a transform or the lowering
puts an action changes the hash. To see what changed, dump the text before and after and diff:
``python tests/test_schedule_grid.py grid.txt``.
"""

from __future__ import annotations

import hashlib
import random
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipecc.ir.schedule import (REGISTRY, Schedule, add_send_recv, compute_by_name, format, parse, schedule_for,
                                validate, zb_v, zb_v_compute)

GOLDEN = Path(__file__).parent / "golden" / "schedule_grid.sha256"


def _compositions(rng: random.Random, batch: int, stages: int) -> list[list[int]]:
    """One random split of ``batch`` samples into positive chunk sizes per stage."""
    out = []
    for _ in range(stages):
        cuts = sorted(rng.sample(range(1, batch), rng.randint(0, batch - 1)))
        bounds = [0, *cuts, batch]
        out.append([b - a for a, b in zip(bounds, bounds[1:])])
    return out


def _validated(schedule: Schedule) -> Schedule:
    validate(schedule)
    return schedule


def _cases() -> Iterator[tuple[str, str]]:
    """(label, schedule text or error message) for every case of the grid, in a fixed order."""

    def build(label: str, make) -> tuple[str, str]:
        try:
            return label, format(make())
        except ValueError as e:  # the refusals are part of the contract too
            return label, f"error: {type(e).__name__}: {e}"

    for name, kind in REGISTRY.items():
        for p in range(1, 7):
            for m in range(1, 13):
                for v in (1, 2, 3, 4) if kind.virtual_stages else (1, 2) if p == 2 else (1,):
                    yield build(f"{name} p={p} m={m} v={v}",
                                lambda: schedule_for(name, p * v, m, num_ranks=p))
    for p in range(1, 6):
        for m in range(1, 13):
            yield build(f"zb-v p={p} m={m}", lambda: _validated(zb_v(p, m)))
    rng = random.Random(32)
    for _ in range(120):
        stages, batch = rng.randint(1, 5), rng.randint(1, 12)
        sizes = _compositions(rng, batch, stages)
        for ranks in (r for r in range(1, stages + 1) if stages % r == 0):
            yield build(f"gpipe sizes={sizes} ranks={ranks}",
                        lambda: schedule_for("gpipe", stages, 0, num_ranks=ranks, microbatch_sizes=sizes))
        yield build(f"1f1b sizes={sizes}", lambda: schedule_for("1f1b", stages, 0, microbatch_sizes=sizes))
    for p in range(2, 7):
        evictors = p // 2
        choices = [[k] * evictors for k in (1, 2, 3)] + [[1] + [None] * (evictors - 1), [None] * (evictors - 1) + [2]]
        for m in range(1, 11):
            for policy in ("jit", "eager"):
                for chosen in choices:
                    thresholds = chosen + [None] * (p - evictors)
                    yield build(f"bpipe p={p} m={m} {policy} {thresholds}",
                                lambda: schedule_for("1f1b", p, m, bpipe_thresholds=thresholds, bpipe_policy=policy))


def grid_text() -> str:
    return "\n".join(f"# {label}\n{text}" for label, text in _cases()) + "\n"


def test_schedule_grid_text_is_unchanged() -> None:
    digest = hashlib.sha256(grid_text().encode()).hexdigest()
    assert digest == GOLDEN.read_text().split()[0], (
        "schedule text changed; diff `python tests/test_schedule_grid.py FILE` before and after")


def test_generators_list_compute_actions_only_and_schedule_for_lowers_them() -> None:
    for name, kind in REGISTRY.items():
        for p, m, v in ((1, 2, 1), (3, 6, 1), (2, 4, 2), (3, 6, 3)):
            if v > 1 and not kind.virtual_stages:
                continue
            compute = compute_by_name(name, p, m, v)
            assert all(a.kind.is_compute for row in compute.actions for a in row)
            assert schedule_for(name, p * v, m, num_ranks=p) == add_send_recv(compute)
    assert all(a.kind.is_compute for row in zb_v_compute(3, 7).actions for a in row)
    assert zb_v(3, 7) == add_send_recv(zb_v_compute(3, 7))


def test_add_send_recv_places_messages_by_one_rule() -> None:
    # equal micro-batches: receive right before the compute that needs it, send right after
    assert format(add_send_recv(parse("rank 0: 0F0 0B0\nrank 1: 1F0 1B0"))) == (
        "rank 0: 0F0 0SEND_F0 0RECV_B0 0B0\nrank 1: 1RECV_F0 1F0 1B0 1SEND_B0")
    # I sends the gradient, W needs nothing; stages on one rank exchange locally
    assert format(add_send_recv(parse("rank 0: 0F0 1F0 1I0 1W0 0I0 0W0"))) == "rank 0: 0F0 1F0 1I0 1W0 0I0 0W0"
    # unequal chunks: F(1, 0) needs stage 0's chunks 0 and 1; the gradient of stage 0's chunk 1
    # goes once every chunk of stage 1 overlapping it ran its backward
    uneven = parse("sizes: 1 3 | 2 2\nrank 0: 0F0 0F1 0B0 0B1\nrank 1: 1F0 1F1 1B0 1B1")
    assert format(add_send_recv(uneven)).splitlines()[1:] == [
        "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
        "rank 1: 1RECV_F0 1RECV_F1 1F0 1F1 1B0 1SEND_B0 1B1 1SEND_B1"]


def test_add_send_recv_refuses_a_schedule_with_messages() -> None:
    with pytest.raises(ValueError, match="compute actions only .* rank 0 runs 0SEND_F0"):
        add_send_recv(schedule_for("1f1b", 2, 2))


if __name__ == "__main__":
    text = grid_text()
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(text)
    print(hashlib.sha256(text.encode()).hexdigest())
