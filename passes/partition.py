"""Pipeline partitioner: contiguous stages on heterogeneous devices, exact min-bottleneck.

Policy only: a pure function over numbers (no torch, no sympy), so it is tested without a
model. The pass that builds a PartitionProblem from the annotated graph and the rewrite
that cuts the graph at `Partition.bounds` live elsewhere.

Cost model. Stage k runs on device k and holds nodes a..e-1 (a = bounds[k], e = bounds[k+1]).
X[s] is the bytes crossing the boundary before node s: every tensor produced before s and
consumed at or after s, counted once per boundary it crosses (a skip over two cuts is relayed
through the middle stage and paid twice). X[0] = 0 (model input is not charged) and X[n] = 0
(outputs feed the loss on the last stage).
    T_k = Σ (fwd + bwd)[k][a:e] + 2·link_time(k-1, X[a]) + 2·link_time(k, X[e])
The factor 2 is forward activations plus backward gradients of the same size. Communication
is charged on both the sending and the receiving stage and never overlapped with compute —
conservative on purpose. The first stage has no incoming term, the last no outgoing term.
    M_k = Σ static_mem[a:e] + inflight[k] · (Σ act_mem[a:e] + X[a])
(static_mem and act_mem may differ per stage: [stage][node]; an FPGA stage counts its
on-chip memory, not the GPU-style weights/gradients/optimizer state.)
(received activations are stashed for backward as well). A stage fits if M_k ≤ mem_cap[k].
Blocked cuts: `blocked[k][s]` True forbids link k (stage k → k+1) from lying at boundary s
(the FPGA backend takes one float32 tensor per stage boundary). A blocked cut costs
CANNOT_RUN_S (`pipecc.targets.timing`) on both stages, a finite stand-in for "impossible"
that the bisection can handle, as is a node's cost on a device that cannot run it: a result
at or above it means no allowed placement exists.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Sequence

import numpy as np

from pipecc.targets.timing import CANNOT_RUN_S

_MEM_RTOL = 1e-12  # NOTE: prefix and direct sums differ by ulps; never let that flip a fit
_T_RTOL = 1e-13    # bisection stops when the bracket on the bottleneck is this tight
_LB_STEPS = 200    # mirror-ascent steps for the fluid lower bound (every iterate is valid)
_LB_ETA = 0.5      # its step size, / sqrt(step); tuned on random heterogeneous instances


class InfeasibleError(ValueError):
    """No placement fits; the message is one line naming the short device."""


@dataclass(frozen=True)
class PartitionProblem:
    """Numeric costs of n topologically ordered nodes on D devices (stage i on device i)."""

    fwd: Sequence[Sequence[float]]  # [device][node] forward seconds per micro-batch
    bwd: Sequence[Sequence[float]]  # [device][node] backward seconds per micro-batch
    out_bytes: Sequence[float]      # [node] output bytes per micro-batch
    last_use: Sequence[int]         # [node] last consumer index (own index: none; n: graph output)
    static_mem: Sequence[float] | Sequence[Sequence[float]]  # [node] or [stage][node]: weights
                                                             # + grads + optimizer state bytes
    act_mem: Sequence[float] | Sequence[Sequence[float]]     # [node] or [stage][node]: bytes
                                                             # stashed per micro-batch in flight
    mem_cap: Sequence[float]        # [device] usable bytes (inf allowed)
    inflight: Sequence[int]         # [stage] micro-batches in flight on the stage
    link_time: Callable[[int, float], float]  # (k, nbytes) -> seconds between stage k and k+1
    input_bytes: float = 0.0        # model input bytes reaching stage 0 (not charged)
    blocked: Sequence[Sequence[bool]] | None = None  # [link k][boundary 0..n]: cut forbidden
    labels: Sequence[str] | None = None  # [stage] how messages name its device ("device k")


@dataclass(frozen=True)
class Partition:
    """A placement and its cost; stage k holds nodes bounds[k] .. bounds[k+1]-1."""

    bounds: tuple[int, ...]
    stage_time: tuple[float, ...]
    stage_memory: tuple[float, ...]
    cut_bytes: tuple[float, ...]  # one direction, per cut between consecutive stages
    bottleneck: float
    fits: bool = True             # every stage within its mem_cap (baselines may not fit)


def cut_bytes(out_bytes: Sequence[float], last_use: Sequence[int]) -> list[float]:
    """Bytes crossing each of the n-1 cuts; cut c lies between node c and node c+1.

    Node j's output crosses cuts j .. last_use[j]-1. Precondition: j ≤ last_use[j] ≤ n.
    O(n) with a difference array, summed exactly (a cut nothing crosses is exactly 0.0).
    """
    out = np.asarray(out_bytes, dtype=float)
    last = np.asarray(last_use, dtype=np.int64)
    n = len(out)
    idx = np.arange(n)
    if last.shape != (n,) or np.any(last < idx) or np.any(last > n):
        raise ValueError("last_use must have one entry per node with j <= last_use[j] <= n")
    if n < 2:
        return []
    end = np.minimum(last, n - 1)
    live = (end > idx) & (out > 0)
    # NOTE: a float running sum loses small tensors next to huge ones (1e20 + 0.1 - 1e20 = 0);
    # integer byte counts are summed exactly in int64, anything else in exact rationals.
    if np.all(out == np.round(out)) and out.sum() < 2.0**62:
        delta = np.zeros(n + 1, dtype=np.int64)
        np.add.at(delta, idx[live], out[live].astype(np.int64))
        np.subtract.at(delta, end[live], out[live].astype(np.int64))
        return np.cumsum(delta)[: n - 1].astype(float).tolist()
    exact = [Fraction(0)] * n
    for j in np.flatnonzero(live):
        exact[j] += Fraction(float(out[j]))
        exact[end[j]] -= Fraction(float(out[j]))
    return [float(x) for x in itertools.accumulate(exact[: n - 1])]


@dataclass
class _Arrays:
    n: int
    p: int
    cost: np.ndarray      # [device, node] fwd + bwd
    static: np.ndarray    # [device, node]
    act: np.ndarray       # [device, node]
    inflight: np.ndarray
    caps: np.ndarray
    X: np.ndarray         # [boundary 0..n] bytes crossing it

    @property
    def mem_tol(self) -> float:
        """Absolute slack for memory comparisons: prefix sums and direct sums of the same
        terms differ by ulps of the largest sum, so the slack scales with it (not with the
        cap, which may be 0)."""
        scale = self.static.max(axis=0).sum() + \
            self.inflight.max(initial=0.0) * (self.act.max(axis=0).sum() + self.X.max())
        return _MEM_RTOL * float(scale)


def _arrays(pr: PartitionProblem) -> _Arrays:
    n, p = len(pr.out_bytes), len(pr.mem_cap)
    cost = np.asarray(pr.fwd, dtype=float) + np.asarray(pr.bwd, dtype=float)
    static, act = np.asarray(pr.static_mem, dtype=float), np.asarray(pr.act_mem, dtype=float)
    inflight = np.asarray(pr.inflight, dtype=float)
    shapes = (cost.shape, static.shape[-1:], act.shape[-1:], inflight.shape)
    if p < 1 or shapes != ((p, n), (n,), (n,), (p,)) or static.ndim > 1 and static.shape != (p, n) \
            or act.ndim > 1 and act.shape != (p, n):
        raise ValueError(f"need fwd/bwd [{p} devices][{n} nodes], node lists of {n}, inflight of {p}")
    arrays = (cost, static, act, inflight, np.asarray(pr.out_bytes, dtype=float))
    if min(x.min(initial=0.0) for x in arrays) < 0:
        raise ValueError("times, bytes and in-flight counts must be non-negative")
    X = np.zeros(n + 1)
    X[1:n] = cut_bytes(pr.out_bytes, pr.last_use)
    static, act = np.broadcast_to(static, (p, n)), np.broadcast_to(act, (p, n))
    return _Arrays(n, p, cost, static, act, inflight, np.asarray(pr.mem_cap, dtype=float), X)


def _link2(pr: PartitionProblem, k: int, nbytes: float) -> float:
    """Forward send + backward send over link k; no bytes, no message."""
    return 0.0 if nbytes <= 0 else 2.0 * float(pr.link_time(k, float(nbytes)))


def _penalty(pr: PartitionProblem, k: int, s: int) -> float:
    return CANNOT_RUN_S if pr.blocked is not None and pr.blocked[k][s] else 0.0


def _fits(mem: float, cap: float, tol: float = 0.0) -> bool:
    return mem <= cap + _MEM_RTOL * abs(cap) + tol


def _evaluate(ar: _Arrays, pr: PartitionProblem, bounds: Sequence[int]) -> Partition:
    b = tuple(int(x) for x in bounds)
    if len(b) != ar.p + 1 or b[0] != 0 or b[-1] != ar.n or any(x >= y for x, y in zip(b, b[1:])):
        raise ValueError(f"bounds must rise strictly from 0 to {ar.n} in {ar.p} steps, got {b}")
    times, mems = [], []
    for k in range(ar.p):
        a, e = b[k], b[k + 1]
        t = float(ar.cost[k, a:e].sum())
        t += _link2(pr, k - 1, ar.X[a]) + _penalty(pr, k - 1, a) if k > 0 else 0.0
        t += _link2(pr, k, ar.X[e]) + _penalty(pr, k, e) if k < ar.p - 1 else 0.0
        times.append(t)
        mems.append(float(ar.static[k, a:e].sum() + ar.inflight[k] * (ar.act[k, a:e].sum() + ar.X[a])))
    tol = ar.mem_tol
    fits = all(_fits(m, c, tol) for m, c in zip(mems, ar.caps))
    cuts = tuple(float(ar.X[s]) for s in b[1:-1])
    return Partition(b, tuple(times), tuple(mems), cuts, max(times), fits)


def evaluate(problem: PartitionProblem, bounds: Sequence[int]) -> Partition:
    """Cost of a given placement under the module's cost model. O(p·n)."""
    return _evaluate(_arrays(problem), problem, bounds)


def brute_force(problem: PartitionProblem) -> Partition:
    """Reference optimum by enumerating all C(n-1, p-1) cut sets (tests only, n ≲ 12)."""
    ar = _arrays(problem)
    best = None
    for cuts in itertools.combinations(range(1, ar.n), ar.p - 1):
        part = _evaluate(ar, problem, (0, *cuts, ar.n))
        if part.fits and (best is None or part.bottleneck < best.bottleneck):
            best = part
    if best is None:
        raise InfeasibleError(f"no placement of {ar.n} nodes on {ar.p} devices fits memory")
    return best


# ---- exact partitioner -------------------------------------------------------------------
# Stage k from a to e costs v_k[e] - w_k[a] with w = P - c_in, v = P + c_out (P: prefix sums),
# and fits iff e ≤ hi_k[a] (memory grows with e for a fixed start; it is NOT monotone in a,
# because X[a] is arbitrary, so feasible starts for an end need not be an interval).
# Reachability for a bound T: R_k[e] ⇔ max{w_k[a] : R_{k-1}[a], a < e ≤ hi_k[a]} ≥ v_k[e] - T.
# The max over the intervals (a, hi_k[a]] covering e is painted with a doubling table:
# each interval is two power-of-two blocks, pushed down level by level — O(n log n) numpy.

@dataclass
class _Stage:
    w: np.ndarray
    v: np.ndarray
    hi: np.ndarray             # [a] last feasible end for start a; -1 if none
    src: np.ndarray | None     # start a of each painted block, grouped by cell; None: prefix max
    starts: np.ndarray | None  # first entry of each cell group
    cells: np.ndarray | None   # flat (level, position) index of each group
    levels: int


def _stages(ar: _Arrays, links: np.ndarray, caps: np.ndarray) -> list[_Stage]:
    n, p = ar.n, ar.p
    pos, zero = np.arange(n + 1), np.zeros(n + 1)
    stages = []
    for k in range(p):
        P = np.concatenate(([0.0], np.cumsum(ar.cost[k])))
        w, v = P - (links[k - 1] if k > 0 else zero), P + (links[k] if k < p - 1 else zero)
        f, last = ar.inflight[k], n - (p - 1 - k)  # later stages need a node each
        G = np.concatenate(([0.0], np.cumsum(ar.static[k] + f * ar.act[k])))
        thr = G - f * ar.X + caps[k] + _MEM_RTOL * abs(caps[k]) + ar.mem_tol
        hi = np.minimum(np.searchsorted(G, thr, side="right") - 1, last)
        hi[(hi <= pos) | (pos < k) | ((k == 0) & (pos > 0))] = -1
        a = np.flatnonzero(hi >= 0)
        if np.all(hi[a] == last):
            stages.append(_Stage(w, v, hi, None, None, None, 0))
            continue
        j = np.frexp((hi[a] - a).astype(float))[1] - 1  # floor(log2(interval length)), exact
        cell = np.concatenate((j * (n + 1) + a + 1, j * (n + 1) + hi[a] - np.left_shift(1, j) + 1))
        order = np.argsort(cell, kind="stable")
        cell, src = cell[order], np.concatenate((a, a))[order]
        starts = np.flatnonzero(np.r_[True, cell[1:] != cell[:-1]])
        stages.append(_Stage(w, v, hi, src, starts, cell[starts], int(j.max()) + 1))
    return stages


def _cover_max(wm: np.ndarray, st: _Stage, n: int) -> np.ndarray:
    """W[e] = max wm[a] over starts a whose interval (a, hi[a]] contains e (-inf if none)."""
    if st.src is None:  # every interval runs to the same end: a prefix maximum
        W = np.full(n + 1, -np.inf)
        W[1:] = np.maximum.accumulate(wm[:-1])
        W[st.hi.max() + 1:] = -np.inf
        return W
    M = np.full(st.levels * (n + 1), -np.inf)
    M[st.cells] = np.maximum.reduceat(wm[st.src], st.starts)
    M = M.reshape(st.levels, n + 1)
    for j in range(st.levels - 1, 0, -1):  # block (j, s) = halves (j-1, s) and (j-1, s + h)
        h = 1 << (j - 1)
        np.maximum(M[j - 1], M[j], out=M[j - 1])
        np.maximum(M[j - 1, h:], M[j, :-h], out=M[j - 1, h:])
    return M[0]


def _reach(stages: list[_Stage], T: float, n: int) -> list[np.ndarray] | None:
    R = np.zeros(n + 1, dtype=bool)
    R[0] = True
    out = []
    for st in stages:
        W = _cover_max(np.where(R & (st.hi >= 0), st.w, -np.inf), st, n)
        R = (W > -np.inf) & (st.v - W <= T)
        if not R.any():
            return None
        out.append(R)
    return out if out[-1][n] else None


def _backtrack(stages: list[_Stage], R: list[np.ndarray], T: float, n: int) -> tuple[int, ...]:
    pos, e, bounds = np.arange(n + 1), n, [n]
    for k in range(len(stages) - 1, -1, -1):
        st = stages[k]
        prev = R[k - 1] if k > 0 else pos == 0
        cand = np.flatnonzero(prev & (st.hi >= e) & (pos < e) & (st.v[e] - st.w <= T))
        e = int(cand[np.argmax(st.w[cand])])  # same arithmetic as _reach: one always exists
        bounds.append(e)
    return tuple(reversed(bounds))


def partition(problem: PartitionProblem) -> Partition:
    """Contiguous placement minimising the bottleneck max_k T_k subject to memory.

    Preconditions: non-negative costs; j ≤ last_use[j] ≤ n; p = len(mem_cap) ≤ n.
    Bisection on the bottleneck T with an exact feasibility test (reachability above);
    each feasible probe is reconstructed and T drops to its real bottleneck, so the result
    is a real placement within relative 1e-13 of the optimum (checked against brute_force).
    Complexity: O(p·n·log n) per probe in numpy, ~45 probes; O(p·n) link_time calls.
    Raises InfeasibleError (one line: which device is short, by how much) if nothing fits.
    """
    ar = _arrays(problem)
    if ar.n < ar.p:
        raise InfeasibleError(f"{ar.n} nodes cannot fill {ar.p} non-empty stages; "
                              f"use ≤ {ar.n} devices")
    links = _link_table(problem, ar)
    stages = _stages(ar, links, ar.caps)
    R = _reach(stages, math.inf, ar.n)
    if R is None:
        raise InfeasibleError(_memory_report(ar, problem, links))
    best = _evaluate(ar, problem, _backtrack(stages, R, math.inf, ar.n))
    hi = best.bottleneck
    lo = min(hi, float(ar.cost.min(axis=0).sum()) / ar.p)  # fluid bound with equal weights
    while hi - lo > _T_RTOL * hi:
        mid = 0.5 * (lo + hi)
        R = _reach(stages, mid, ar.n)
        if R is None:
            lo = mid
            continue
        cand = _evaluate(ar, problem, _backtrack(stages, R, mid, ar.n))
        best = cand if cand.bottleneck < best.bottleneck else best
        hi = min(mid, cand.bottleneck)
    return best


def _link_table(pr: PartitionProblem, ar: _Arrays) -> np.ndarray:
    """[link k, boundary s] = 2·link_time(k, X[s]); one call per distinct byte count."""
    uniq, inv = np.unique(ar.X, return_inverse=True)
    table = np.zeros((max(ar.p - 1, 0), len(uniq)))
    for k in range(ar.p - 1):
        table[k] = [_link2(pr, k, x) for x in uniq]
    table = table[:, inv.ravel()]
    if pr.blocked is not None and ar.p > 1:
        table = table + CANNOT_RUN_S * np.asarray(pr.blocked, dtype=bool)[: ar.p - 1]
    return table


def _memory_report(ar: _Arrays, pr: PartitionProblem, links: np.ndarray) -> str:
    """Smallest extra memory per device that admits a placement, and who needs it most."""
    def bounds_with(extra: float) -> tuple[int, ...] | None:
        stages = _stages(ar, links, ar.caps + extra)
        R = _reach(stages, math.inf, ar.n)
        return None if R is None else _backtrack(stages, R, math.inf, ar.n)

    even = tuple(k * ar.n // ar.p for k in range(ar.p + 1))
    hi = max(m - c for m, c in zip(_evaluate(ar, pr, even).stage_memory, ar.caps))
    lo, best = 0.0, None
    while best is None:  # NOTE: rounding can leave `even` a hair short at exactly `hi`
        hi = hi * 2 + 1.0
        best = bounds_with(hi)
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        got = bounds_with(mid)
        lo, hi, best = (lo, mid, got) if got else (mid, hi, best)
    part = _evaluate(ar, pr, best)
    over = [m - c for m, c in zip(part.stage_memory, ar.caps)]
    k = int(np.argmax(over))
    gb = lambda x: f"{x / 1e9:.3g} GB"  # noqa: E731
    where = pr.labels[k] if pr.labels is not None else f"device {k}"
    return (f"no split fits memory: needs ≥ {gb(part.stage_memory[k])} on {where} "
            f"(has {gb(ar.caps[k])}, every split overflows some device by ≥ {gb(lo)}); "
            f"try more devices or fewer micro-batches")


def lower_bound(problem: PartitionProblem, splittable: Sequence[bool] | None = None) -> float:
    """A bottleneck no placement on these devices can beat, even with intra-layer splits.

    Let c[d][i] = fwd + bwd of node i on device d, and suppose node i may be sharded with
    fraction x[d][i] ≥ 0 on device d (Σ_d x[d][i] = 1) at cost ≥ x[d][i]·c[d][i] (no
    superlinear speedup from splitting). Any placement with bottleneck T has per-device
    compute loads L_d ≤ T (stage time ≥ compute; communication is ignored, so this only
    helps the adversary). (1) Fluid bound, by weak duality: for any λ ≥ 0 with Σ λ_d = 1,
        T = Σ_d λ_d T ≥ Σ_d λ_d L_d = Σ_i Σ_d x[d][i] λ_d c[d][i] ≥ Σ_i min_d λ_d c[d][i].
    Every λ gives a valid bound; we start from λ_d ∝ 1/Σ_i c[d][i] (exact for identical
    devices) and take mirror-ascent steps along the supergradient (per-device loads of the
    cheapest assignment), keeping the best value seen. (2) A node that may not be split
    (splittable None: none may) runs whole on one device: T ≥ min_d c[d][i].
    Costs ≥ CANNOT_RUN_S mean the device cannot run the node (x[d][i] = 0 is forced): they
    are left out of both the fluid sum and the device's starting weight.
    Returns max of (1) and (2). O(steps · D · n) with steps = 200.
    """
    c = np.asarray(problem.fwd, dtype=float) + np.asarray(problem.bwd, dtype=float)
    if c.size == 0:
        return 0.0
    c = np.where(c >= CANNOT_RUN_S, np.inf, c)  # "cannot run here": x[d][i] = 0 is forced
    whole = np.ones(c.shape[1], bool) if splittable is None else ~np.asarray(splittable, bool)
    item = float(c.min(axis=0)[whole].max(initial=0.0))
    usable = np.isfinite(c)
    total = np.where(usable, c, 0.0).sum(axis=1)
    runs_some = usable.any(axis=1)
    if np.any(runs_some & (total <= 0)):  # a free device absorbs every splittable node
        return item
    inv = np.where(runs_some, 1.0 / np.where(total > 0, total, 1.0), 0.0)
    cols, lam, best = np.arange(c.shape[1]), inv / inv.sum(), 0.0
    for t in range(1, _LB_STEPS + 1):
        scaled = np.where(usable, lam[:, None] * np.where(usable, c, 0.0), np.inf)
        arg = scaled.argmin(axis=0)
        best = max(best, float(scaled[arg, cols].sum()))
        load = np.bincount(arg, weights=c[arg, cols], minlength=len(lam))
        if load.max() <= 0:
            break
        lam = lam * np.exp(_LB_ETA * load / load.max() / math.sqrt(t))  # raise the price of busy devices
        lam /= lam.sum()
    return max(item, best)


def best_device_order(
    problem_for_order: Callable[[tuple[int, ...]], PartitionProblem],
    device_types: Sequence[str],
    max_orders: int = 20_000,
) -> tuple[tuple[int, ...], Partition]:
    """Best pipeline order of the devices, and its partition.

    Devices of one type are interchangeable, so only distinct orderings of the multiset of
    types are tried: D! / (m_1! · … · m_r!) of them (multinomial; m_t devices of type t,
    e.g. 4 GPU + 2 FPGA → 15, 8 + 8 → 12,870), each a full `partition` call. An order maps
    stage i to device order[i]; devices of a type keep their relative order. Ties go to the
    given order (0, 1, …, D-1). Raises ValueError past max_orders, InfeasibleError if no
    order fits (the given order's message).
    """
    types = list(device_types)
    count = math.factorial(len(types)) // math.prod(math.factorial(types.count(t)) for t in set(types))
    if count > max_orders:
        raise ValueError(f"{count} distinct device orders exceed max_orders={max_orders}")
    given, errors, best = tuple(range(len(types))), [], None
    pools = {t: [d for d in given if types[d] == t] for t in set(types)}
    seqs = itertools.chain([tuple(types)], (s for s in _type_orders(types) if s != tuple(types)))
    for seq in seqs:
        taken = {t: iter(pools[t]) for t in pools}
        order = tuple(next(taken[t]) for t in seq)
        try:
            part = partition(problem_for_order(order))
        except InfeasibleError as err:
            errors.append(err)
            continue
        if best is None or part.bottleneck < best[1].bottleneck * (1 - 1e-12):
            best = (order, part)
    if best is None:
        raise errors[0]
    return best


def _type_orders(types: list[str], prefix: tuple[str, ...] = ()):
    """Distinct permutations of a multiset, each once: branch on distinct remaining types."""
    if not types:
        yield prefix
    for t in dict.fromkeys(types):
        rest = list(types)
        rest.remove(t)
        yield from _type_orders(rest, prefix + (t,))
