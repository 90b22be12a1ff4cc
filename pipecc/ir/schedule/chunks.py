"""Chunk arithmetic of unequal micro-batches (UMPIPE): every stage splits the same batch into
contiguous sample intervals of its own sizes; these say which chunks of two splits overlap."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["check_size_lists", "chunk_bounds", "overlapping"]


def check_size_lists(sizes: Sequence[Sequence[int]]) -> None:
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

