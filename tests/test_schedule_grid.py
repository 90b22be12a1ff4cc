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

from pipecc.ir.schedule import REGISTRY, Schedule, format, schedule_for, validate, zb_v

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


if __name__ == "__main__":
    text = grid_text()
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(text)
    print(hashlib.sha256(text.encode()).hexdigest())
