"""The lower bound: a bottleneck no placement of a `PartitionProblem` beats, whatever its cuts
and layer splits, every cost the partitioner charges counted (`lower_bound`'s docstring has
the proof of each term). Pure numbers, no torch.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from pipecc.passes.bound_grid import grid_bound
from pipecc.passes.partition import PartitionProblem, _link1, cut_bytes
from pipecc.targets.timing import CANNOT_RUN_S

__all__ = ["lower_bound"]

_LB_STEPS = 200    # mirror-ascent steps for the fluid lower bound (every iterate is valid)
_LB_ETA = 0.5      # its step size, / sqrt(step); tuned on random heterogeneous instances


def lower_bound(problem: PartitionProblem, splittable: Sequence[bool] | None = None,
                comm: bool = True, bipartition: bool = False,
                split_bytes: Sequence[float] | None = None,
                split_fixed: np.ndarray | Sequence[Sequence[float]] | None = None) -> float:
    """A bottleneck no placement on these devices can beat, even with intra-layer splits.

    Let c[d][i] = fwd + bwd of node i on device d, and suppose node i may be sharded with
    fraction x[d][i] ≥ 0 on device d (Σ_d x[d][i] = 1) at cost ≥ x[d][i]·c[d][i] (no
    superlinear speedup from splitting). Stage d runs on device d with compute load L_d.
    (1) Fluid bound: B ≥ T_d ≥ L_d for every d (a one-stage window), so for any λ ≥ 0 with
    Σ λ_d = 1, by weak duality
        B ≥ Σ_d λ_d L_d = Σ_i Σ_d x[d][i] λ_d c[d][i] ≥ Σ_i min_d λ_d c[d][i] =: F(λ).
    (2) A node that may not be split (splittable None: none may) runs whole on one device:
    B ≥ min_d c[d][i].
    Communication (comm=True). With p stages there are p-1 cuts, and every possible cut
    point s ∈ 1..n-1 carries at least x0 = min_s X[s] bytes; a cut inside a split layer
    carries the later shards' input, so it is taken to carry something (> 0 bytes) when the
    boundary before the layer does and possibly nothing otherwise: x0 drops to "one byte's
    worth" (5e-324) or 0 accordingly. link_time is nondecreasing in bytes, so every cut of
    link k costs t_k ≥ τ_k = link_time(k, x0) one way (0 when x0 = 0: no message).
    (3) The link is a resource: B ≥ max_k τ_k.
    (4) Training: mix the one-stage windows with weight μ_d ≥ 0 and the whole-pipeline window
    with weight ν (Σ μ + ν = 1): B ≥ Σ_d μ_d T_d + ν (Σ_d T_d + 2 Σ_k t_k) / p. Put
    λ_d = μ_d + ν/p and ν = p · min_d λ_d (so μ ≥ 0); then for every λ as in (1)
        B ≥ F(λ) + 2 · min_d λ_d · Σ_k τ_k,
    exact for identical devices (λ = 1/p: total work over p plus every round trip over p).
    We start from λ_d ∝ 1/Σ_i c[d][i] (exact for identical devices), also try λ = 1/p, and
    take mirror-ascent steps along the supergradient of F (per-device loads of the cheapest
    assignment), keeping the best value of (4) seen: every λ gives a valid bound.
    comm=False gives the compute-only bound max(F, (2)) (plan.json's `lower_bound_compute_s`).
    bipartition=True (separate forward and backward cuts, `techniques.bipartition.search`): a whole
    node's forward and backward may sit on different devices, so (2) becomes
    max(min_d fwd[d][i], min_d bwd[d][i]) (PAPERS-SPEC §3.4: min_d (f+g) is not a bound
    then). (1), (3) and (4) stay: every worker still holds whole pieces of compute with
    x[d][i] fractions summing to one per direction, and every forward and gradient message
    carries at least x0 bytes.
    Costs ≥ CANNOT_RUN_S mean the device cannot run the node (x[d][i] = 0 is forced): they
    are left out of both the fluid sum and the device's starting weight.
    Fixed costs c_k (`stage_fixed`): T_d = L_d + c_d, so (1), (4) gain Σ λ_d c_d, (2) min_d c_d.
    A unit's per-call fixed costs are in its c[d][i] (`CostTables.times`): every shard of a
    split unit pays them again, so x·c[d][i] still never exceeds what a fraction x costs.
    (5) Where the cuts can be (comm=True, not bipartition; `_region_bound`): in a placement
    with bottleneck B every stage computes at most B, so the units before cut k (stages
    0..k-1) cost at most k·B - Σ_{j<k} c_j even on the cheapest of those stages' devices,
    and the units after it at most (p-k)·B - Σ_{j≥k} c_j on the cheapest of the others'. Cut
    k therefore lies in an interval of boundaries R_k(B) (or inside a splittable unit next to
    one), and sends at least the fewest bytes there: t_k ≥ τ_k(B) = link_time(k, min X over
    R_k(B)), which falls as B grows. A cut inside a split unit i carries at least
    `split_bytes[i]` (the caller's: `passes.plan_emit.split_floor`; None: the rule of (2)'s
    x0, something or nothing). So the optimum B* satisfies B* ≥ G(B*) with G(B) the larger of
    (4) with τ(B) for every λ tried and max_k τ_k(B) (3); G is non-increasing, so every
    B < G(B) is below B*, and bisection finds the least B ≥ G(B) to relative 1e-12.
    (6) Contiguity (not bipartition; `_cut_bound`): stages are consecutive runs of units, so
    with every splittable unit divisible at a cut and no messages, the least B at which the
    stages, filled in order, hold everything bounds B* (the fluid bound (1) lets every unit go
    to its cheapest device, which heterogeneous devices in a pipeline cannot do). A piece of
    a divided unit i on stage k costs at least f + x·(c[k][i] - f), f = split_fixed[k][i]
    (the caller's, `CostTables.piece_fixed`: the per-call fixed cost every piece's stage pays
    again, at most c; None: 0, the pieces' costs proportional).
    (7) Communication and contiguity at once (comm=True, not bipartition, every cost finite;
    `passes.bound_grid`): the exact optimum of a relaxation, over stages that are
    consecutive runs of a grid (each splittable unit in K_i pieces, a cut inside it sending
    its split floor and the next stage paying f), of the same windows the partitioner
    charges, minus 2·δ for rounding a real plan's cuts to the grid (δ = max_i of the unit's
    divisible cost / K_i). That module's docstring has the proof.
    Returns the max of the valid bounds. O(steps · D · n + n + D) with steps = 200 (none
    when every device costs the same: λ = 1/p is then optimal), plus O(50 · p · n) for (5)
    and O(50 · p · log n) for (6), O(40 · p · N) for (7) on a grid of N ≤ 20,000 pieces.
    """
    c = np.asarray(problem.fwd, dtype=float) + np.asarray(problem.bwd, dtype=float)
    if c.size == 0:
        return 0.0
    tau = _link_floor(problem, splittable) if comm else np.zeros(0)
    ring = 2.0 * float(tau.sum()) if problem.training else 0.0
    c = np.where(c >= CANNOT_RUN_S, np.inf, c)  # "cannot run here": x[d][i] = 0 is forced
    whole = np.ones(c.shape[1], bool) if splittable is None else ~np.asarray(splittable, bool)
    per_item = c.min(axis=0)
    if bipartition:
        f = np.asarray(problem.fwd, dtype=float)
        g = np.asarray(problem.bwd, dtype=float)
        f, g = np.where(f >= CANNOT_RUN_S, np.inf, f), np.where(g >= CANNOT_RUN_S, np.inf, g)
        per_item = np.maximum(f.min(axis=0), g.min(axis=0))
    fixed = np.array([sum(problem.stage_fixed(k)) for k in range(c.shape[0])])  # c_k
    item = max(float(per_item[whole].max(initial=0.0)) + float(fixed.min(initial=0.0)),
               float(tau.max(initial=0.0)))
    usable = np.isfinite(c)
    total = np.where(usable, c, 0.0).sum(axis=1)
    runs_some = usable.any(axis=1)
    if np.any(runs_some & (total <= 0)):  # a free device absorbs every splittable node
        return item
    inv = np.where(runs_some, 1.0 / np.where(total > 0, total, 1.0), 0.0)
    cols, lam, best = np.arange(c.shape[1]), inv / inv.sum(), 0.0
    pairs: list[tuple[float, float]] = []  # (F(λ) + λ·c_k, min λ) of every λ tried: (4) with any τ
    if runs_some.all():  # equal weights: F(1/p) + 2 Σ τ / p
        pairs.append((float(c.min(axis=0).sum() + fixed.sum()) / len(lam), 1.0 / len(lam)))
        best = pairs[-1][0] + ring / len(lam) if ring > 0 else 0.0
    # NOTE: identical rows (one device type, its fixed costs alike): λ = 1/p maximises F, the
    # ascent could only repeat it
    steps = 0 if runs_some.all() and np.array_equal(c, np.broadcast_to(c[:1], c.shape)) else _LB_STEPS
    for t in range(1, steps + 1):
        scaled = np.where(usable, lam[:, None] * np.where(usable, c, 0.0), np.inf)
        arg = scaled.argmin(axis=0)
        pairs.append((float(scaled[arg, cols].sum()) + float(lam @ fixed), float(lam.min())))
        best = max(best, pairs[-1][0] + ring * pairs[-1][1])
        load = np.bincount(arg, weights=c[arg, cols], minlength=len(lam))
        if load.max() <= 0:
            break
        lam = lam * np.exp(_LB_ETA * load / load.max() / math.sqrt(t))  # raise the price of busy devices
        lam /= lam.sum()
    out = max(item, best, max((f for f, _ in pairs), default=0.0))
    piece = None
    if split_fixed is not None and splittable is not None:
        piece = np.minimum(np.broadcast_to(np.asarray(split_fixed, dtype=float), c.shape), c)
        piece = np.where(np.asarray(splittable, bool)[None, :], np.maximum(piece, 0.0), 0.0)
    if not bipartition and c.shape[0] > 1:
        out = max(out, _cut_bound(c, fixed, splittable, out, piece))
    if comm and not bipartition and c.shape[0] > 1 and c.shape[1] > 1:
        out = max(out, _region_bound(problem, c, fixed, pairs, splittable, split_bytes, out))
        out = max(out, grid_bound(problem, c, fixed, splittable, _inside_floor(problem, splittable, split_bytes),
                                  piece, out))
    return out


def _inside_floor(pr: PartitionProblem, splittable: Sequence[bool] | None,
                  split_bytes: Sequence[float] | None) -> np.ndarray:
    """[unit] the fewest bytes a cut inside the unit sends ((5) of `lower_bound`: the caller's
    `split_bytes`, at least the rule of (2): something when bytes cross the boundary before it);
    inf for a unit that is not splittable."""
    n = len(pr.out_bytes)
    X = np.zeros(n + 1)
    X[1:n] = cut_bytes(pr.out_bytes, pr.last_use)
    inside = np.full(n, np.inf)
    if splittable is not None:
        flags = np.asarray(splittable, bool)
        old = np.where(X[:n] <= 0, 0.0, 5e-324)  # (2)'s rule: something or nothing
        floor = old if split_bytes is None else np.maximum(old, np.asarray(split_bytes, float))
        inside[flags] = floor[flags]
    return inside


def _cut_bound(c: np.ndarray, fixed: np.ndarray, splittable: Sequence[bool] | None,
               start: float, piece: np.ndarray | None = None) -> float:
    """Bound (6) of `lower_bound`: the least B at which stages 0..p-1, in order, each computing
    at most B - c_k, can hold every unit, a splittable unit dividing between neighbouring
    stages, each piece on stage k costing f + x·(c[k][i] - f) (f = piece[k][i], None: 0), no
    messages. Filling each stage as far as it goes is optimal for that question: what is left
    of a unit after a piece of it costs f + (1 - x)·(c - f) ≤ c on the next stage, so taking
    more always leaves the later stages less; bisection on B finds the least to relative
    1e-12, and every real placement's stages are at least those loads. `c`: [stage][unit]
    with inf where the stage cannot run the unit."""
    p, n = c.shape
    split = np.zeros(n, bool) if splittable is None else np.asarray(splittable, bool)
    f = np.zeros_like(c) if piece is None else piece
    var = c - f  # [stage][unit] the divisible part (inf where the stage cannot run it)
    P = np.concatenate((np.zeros((p, 1)), np.cumsum(c, axis=1)), axis=1)  # [k][e] units < e on k
    finite = np.isfinite(c).all(axis=1)

    def fits(B: float) -> bool:
        i, done = 0, 0.0  # unit i, of which the fraction `done` is placed already
        for k in range(p):
            budget = (B - fixed[k]) * (1 + 1e-12)
            if budget < 0:
                return False
            if done > 0:  # the rest of a divided unit: its per-call cost again, and the rest
                rest = f[k, i] + (1.0 - done) * var[k, i]
                if rest > budget:
                    if math.isfinite(var[k, i]) and var[k, i] > 0 and budget > f[k, i]:
                        done += (budget - f[k, i]) / var[k, i]
                    continue
                budget -= rest
                i, done = i + 1, 0.0
            if finite[k]:  # whole units i..e-1
                e = max(int(np.searchsorted(P[k], P[k, i] + budget, side="right")) - 1, i)
                used = P[k, e] - P[k, i]
            else:  # NOTE: a prefix sum past an inf is inf: sum from i on
                run = np.concatenate(([0.0], np.cumsum(c[k, i:])))
                j = int(np.searchsorted(run, budget, side="right")) - 1
                e, used = i + j, float(run[j])
            if e >= n:
                return True
            budget -= used
            i = e
            if split[i] and math.isfinite(var[k, i]) and var[k, i] > 0 and budget > f[k, i]:
                done = (budget - f[k, i]) / var[k, i]
        return i >= n

    if not math.isfinite(start) or start <= 0 or fits(start):
        return start
    lo, hi = start, 2.0 * start
    for _ in range(200):
        if fits(hi):
            break
        lo, hi = hi, 2.0 * hi
    else:
        return start  # some unit runs nowhere: (2) says so already
    while hi - lo > 1e-12 * hi:
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return lo


def _region_bound(pr: PartitionProblem, c: np.ndarray, fixed: np.ndarray,
                  pairs: list[tuple[float, float]], splittable: Sequence[bool] | None,
                  split_bytes: Sequence[float] | None, start: float) -> float:
    """Bound (5) of `lower_bound`: the least B with B ≥ G(B), from `start` (a valid bound).
    `c`: [stage][unit] fwd + bwd with inf where the stage's device cannot run the unit."""
    p, n = c.shape
    X = np.zeros(n + 1)
    X[1:n] = cut_bytes(pr.out_bytes, pr.last_use)
    inside = _inside_floor(pr, splittable, split_bytes)  # [unit] fewest bytes a cut inside it sends
    pre = np.minimum.accumulate(c, axis=0)               # [k] cheapest of stages 0..k
    suf = np.minimum.accumulate(c[::-1], axis=0)[::-1]   # [k] cheapest of stages k..p-1
    zero = np.zeros((p, 1))
    P = np.concatenate((zero, np.cumsum(pre, axis=1)), axis=1)          # [k][s] units < s on 0..k
    Q = np.concatenate((np.cumsum(suf[:, ::-1], axis=1)[:, ::-1], zero), axis=1)  # [k][s] units ≥ s on k..
    FP = np.concatenate(([0.0], np.cumsum(fixed)))      # [k] Σ_{j<k} c_j
    FS = fixed.sum() - FP                               # [k] Σ_{j≥k} c_j
    F = np.array([f for f, _ in pairs]) if pairs else np.zeros(1)
    L = np.array([lam for _, lam in pairs]) if pairs else np.zeros(1)
    uniq: dict[tuple[int, float], float] = {}

    def link(k: int, nbytes: float) -> float:
        key = (k, nbytes)
        if key not in uniq:
            uniq[key] = _link1(pr, k, nbytes)
        return uniq[key]

    def G(B: float) -> float:
        slack = 1.0 + 1e-12
        tau = np.zeros(p - 1)
        for k in range(1, p):  # cut k: between stage k-1 and stage k (link k-1)
            s_hi = int(np.searchsorted(P[k - 1], k * B * slack - FP[k], side="right")) - 1
            s_lo = int(np.searchsorted(-Q[k], -((p - k) * B * slack - FS[k]), side="left"))
            if s_lo > s_hi + 1 or s_hi < 0 or s_lo > n:
                return math.inf  # no cut k fits: no placement has bottleneck B
            lo, hi = max(s_lo, 1), min(s_hi, n - 1)
            least = float(X[lo:hi + 1].min()) if lo <= hi else math.inf
            a, b = max(s_lo - 1, 0), min(s_hi, n - 1)  # units with a cut inside next to the interval
            if a <= b:
                least = min(least, float(inside[a:b + 1].min()))
            if not math.isfinite(least):
                return math.inf
            tau[k - 1] = link(k - 1, least)
        ring = 2.0 * float(tau.sum()) if pr.training else 0.0
        return max(float((F + ring * L).max()), float(tau.max()))

    lo = start
    g = G(lo)
    if lo >= g:
        return lo
    hi = g if math.isfinite(g) else 2.0 * lo + 1e-30
    while G(hi) > hi:
        hi *= 2.0
    for _ in range(200):
        if hi - lo <= 1e-12 * hi:
            break
        mid = 0.5 * (lo + hi)
        if mid < G(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _link_floor(pr: PartitionProblem, splittable: Sequence[bool] | None) -> np.ndarray:
    """τ_k of `lower_bound`: one-way time of the smallest message any cut of link k sends."""
    n, p = len(pr.out_bytes), len(pr.mem_cap)
    if p < 2 or n < 2:
        return np.zeros(0)
    X = np.zeros(n + 1)
    X[1:n] = cut_bytes(pr.out_bytes, pr.last_use)
    x0 = float(X[1:n].min())
    if splittable is not None and np.any(splittable):
        inside = X[:n][np.asarray(splittable, bool)]  # boundary before each splittable node
        x0 = min(x0, 0.0 if np.any(inside <= 0) else 5e-324)
    return np.array([_link1(pr, k, x0) for k in range(p - 1)])
