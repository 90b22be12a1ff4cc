"""Bound (7) of `bound.lower_bound`: communication and contiguity at once, layer splits
included. Pure numbers, no torch.

The other bounds charge the messages of the cuts (5) and the consecutive stages (6) apart; a
placement pays both at once, in the partitioner's windows (`passes.partition`, module
docstring): B = max over windows k..l of (Σ T + 2 Σ t) / (l - k + 1), and max t. With whole
units the exact optimum of that with memory dropped is a bound; the planner may also split
layers, so the relaxation below covers every split too.

The grid. Unit i that may be split, with c[k][i] on stage k's device and f[k][i] the
per-call fixed cost every piece of it pays there (`CostTables.piece_fixed`), has the
divisible part D = c - f and becomes K_i + 1 pieces: the first costs f + D/K_i, the next
K_i - 1 cost D/K_i, the last 0. The K_i points after its first K_i pieces are *inside*
points: a cut there sends the unit's split floor (the fewest bytes a cut inside a split of it
sends, `plan_emit.split_floor`), the stage after it pays f on its device, and a stage may be
empty there (start and end at the same inside point). Every other point is a unit boundary,
with its bytes X[s]. Stage k costs its pieces + its fixed c_k + f where it starts inside.

Why a real plan is no better than the grid's optimum minus 2δ (δ = max_i max_k D[k][i]/K_i).
A real plan of the shape cuts the graph with some units split into shards (each reads the
layer's input and pays a call's fixed cost again) and a combine (`passes.split_layers`). Map
each cut to a grid point: a cut at a unit boundary to itself; a cut inside unit i's shards
and combine at fraction y ∈ (0, 1] (the shards before it, by extent; 1: before the combine)
to the nearest inside point j/K_i, j ≥ 1: |j/K_i - y| ≤ 1/K_i. The map keeps the cuts in
order (equal only at inside points: empty stages are allowed there), so it is a grid
placement. Its stages cost at most the real ones, but for the rounding: a real stage holding
fraction x of unit i's shards costs ≥ f + x·D (every piece holds a call; the shards' work
divides no better than proportionally, as `bound.lower_bound` (1) assumes), or holds only the
combine, a call (≥ f); on the grid it pays x'·D with |x' - x| at most 1/K_i at each end, and
f only where the real stage starts inside unit i. A cut's bytes on the grid are at most the
real cut's (a split floor at an inside point), so every t is at most the real one. Moving one
cut changes a window's sum by at most δ (the piece leaves one stage and joins the next), a
window of w stages has at most w + 1 cuts touching it, so every window's average grows by at
most (w + 1)·δ/w ≤ 2δ: B_grid ≤ B_real + 2δ. Memory, blocked cuts and the "charged" way
only add to a real plan, so they are left out.

The grid's optimum is found as `partition` finds its own: bisection on T with the exact
reachability (the least window carry per end point), here with no memory (a prefix maximum)
and empty stages at inside points. K_i = ceil(max_k D[k][i] / (eps · start)), so 2δ is at
most 2·eps of the bound the caller already has (eps = 1e-3), with at most `_MAX_PIECES`
pieces in all (eps grows to fit). O(probes · p · N), ~40 probes.
"""
from __future__ import annotations

import math

import numpy as np

from pipecc.passes.partition import PartitionProblem, _link1, cut_bytes

__all__ = ["grid_bound"]

_EPS = 1e-3            # δ ≤ eps · start: the rounding costs at most 0.2 % of the bound
_MAX_PIECES = 20_000   # at most this many split pieces (eps grows to keep to it)
_RTOL = 1e-9           # bisection stops when the bracket is this tight (relative)


def grid_bound(pr: PartitionProblem, c: np.ndarray, fixed: np.ndarray,
               splittable: np.ndarray | list[bool] | None, inside: np.ndarray,
               piece: np.ndarray | None, start: float) -> float:
    """max(start, B_grid - 2δ) (module docstring). `c`: [stage][unit] fwd + bwd (inf where the
    stage cannot run the unit: then `start`, the grid is not built); `fixed`: [stage] c_k;
    `inside`: [unit] the fewest bytes of a cut inside it (inf: not splittable); `piece`:
    [stage][unit] f (None: 0); `start`: a valid bound."""
    p, n = c.shape
    if p < 2 or not np.isfinite(c).all() or not math.isfinite(start) or start <= 0:
        return start
    flags = np.zeros(n, bool) if splittable is None else np.asarray(splittable, bool)
    f = np.zeros_like(c) if piece is None else np.asarray(piece, dtype=float)
    D = np.maximum(c - f, 0.0)
    flags = flags & np.isfinite(inside) & (D.max(axis=0) > 0)
    dmax = np.where(flags, D.max(axis=0), 0.0)
    step = max(_EPS * start, float(dmax.sum()) / _MAX_PIECES)
    K = np.where(flags, np.ceil(dmax / step), 0).astype(np.int64)
    delta = float((dmax[flags] / K[flags]).max(initial=0.0))
    grid = _grid(pr, c, f, D, K, inside, n)
    T0 = (start + 2.0 * delta) * (1 + 1e-12)
    if _feasible(grid, fixed, T0, pr.training):
        return start
    lo, hi = T0, 2.0 * T0
    while not _feasible(grid, fixed, hi, pr.training):
        lo, hi = hi, 2.0 * hi
        if hi > 1e30:  # NOTE: every grid placement is feasible at some finite T
            return start
    while hi - lo > _RTOL * hi:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if not _feasible(grid, fixed, mid, pr.training) else (lo, mid)
    return max(start, lo * (1 - 1e-10) - 2.0 * delta)  # NOTE: the prefix sums' ulps


def _grid(pr: PartitionProblem, c: np.ndarray, f: np.ndarray, D: np.ndarray, K: np.ndarray,
          inside: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(P [stage][point] prefix cost, pen [stage][point] what a stage starting there pays,
    t [link][point] one-way message time, empty [point] True at inside points)."""
    p = c.shape[0]
    count = np.where(K > 0, K + 1, 1)                    # pieces per unit
    unit = np.repeat(np.arange(n), count)                # [piece] its unit
    first = np.concatenate(([0], np.cumsum(count)[:-1]))
    j = np.arange(len(unit)) - first[unit]               # [piece] its place in the unit
    k_of = np.maximum(K[unit], 1)
    split = K[unit] > 0
    cost = np.where(split[None, :],
                    np.where(j < K[unit], D[:, unit] / k_of + np.where(j == 0, f[:, unit], 0.0), 0.0),
                    c[:, unit])
    P = np.concatenate((np.zeros((p, 1)), np.cumsum(cost, axis=1)), axis=1)
    X = np.zeros(n + 1)
    X[1:n] = cut_bytes(pr.out_bytes, pr.last_use)
    # point q (after piece q - 1): inside its unit unless that piece was the unit's last
    last = j == count[unit] - 1
    empty = np.concatenate(([False], ~last))
    nbytes = np.concatenate(([0.0], np.where(last, X[unit + 1], inside[unit])))
    pen = np.zeros((p, len(unit) + 1))
    pen[:, 1:] = np.where(last[None, :], 0.0, f[:, unit])
    uniq, inv = np.unique(nbytes, return_inverse=True)
    t = np.array([[_link1(pr, k, x) for x in uniq] for k in range(p - 1)])[:, inv.ravel()]
    return P, pen, t, empty


def _feasible(grid: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], fixed: np.ndarray,
              T: float, training: bool) -> bool:
    """Some grid placement has every window ≤ T and every message ≤ T (`partition`'s
    reachability: per end point, the least carry of a prefix whose windows all fit)."""
    P, pen, t, empty = grid
    p, N = P.shape[0], P.shape[1] - 1
    R = np.zeros(N + 1, bool)
    R[0] = True
    carry = np.zeros(N + 1)
    W = np.empty(N + 1)
    for k in range(p):
        wm = np.where(R, P[k] - pen[k] - carry, -np.inf)  # a start a: what the stage's sum subtracts
        W[0] = -np.inf
        np.maximum.accumulate(wm[:-1], out=W[1:])          # starts a < e
        W = np.where(empty, np.maximum(W, wm), W)          # or a = e at an inside point
        with np.errstate(invalid="ignore"):
            load = P[k] + fixed[k] - W                    # the stage's cost, ending at e
            tk = t[k] if k < p - 1 else 0.0
            R = (W > -np.inf) & (load <= T) & (tk <= T)
            if training:
                carry = np.maximum(0.0, load - T + 2.0 * tk)
        if not R.any():
            return False
    return bool(R[N])
