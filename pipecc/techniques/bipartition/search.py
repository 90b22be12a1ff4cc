"""Bi-Partition: separate forward (FP) and backward (BP) cuts, exact inside a window.

Policy only, like `passes.partition` (pure numbers, no torch): PAPERS-SPEC §3. Units
1..n in topological order, p workers in pipeline order; forward cuts 0 = a_0 < … < a_p = n
and backward cuts 0 = c_0 < … < c_p = n: worker j runs FP of (a_{j-1}, a_j] and BP of
(c_{j-1}, c_j] (1-based units; node index i is unit i+1). At boundary j the **segment**
(min(a_j, c_j), max(a_j, c_j)] is misplaced: a_j > c_j runs its FP on j and its BP on j+1,
c_j > a_j the other way round. Worker j's **core** (max(a_{j-1}, c_{j-1}), min(a_j, c_j)]
must be non-empty (v1; this also keeps the last unit, the loss, in the last worker's core).

Cost model: `passes.partition`'s (read its docstring first), with per boundary two messages
instead of one symmetric one.
    T_j = Σ fwd[j][a_{j-1}:a_j] + Σ bwd[j][c_{j-1}:c_j] + c_j  (+ Σ fwd[j] of the units it BPs
          but does not FP, mode "recompute": it re-runs their forward before their backward;
          c_j: the worker's fixed cost per micro-batch, `PartitionProblem.fixed_fwd/fixed_bwd`)
    forward message  XF_j = X[a_j] + (a_j > c_j ? S(c_j, a_j) : 0)
    backward message XB_j = X[c_j] + (c_j > a_j ? S(a_j, c_j) : 0)
S is the segment's saved tensors per micro-batch ("ship", spec §3.3: `stash_bytes` per node,
default `act_mem`; or `segment_stash(lo, hi)`, the storages the segment's backward keeps, each
once, its input among them: what the runtime ships). In mode "recompute" (spec §3.6
option B) nothing is stashed: a_j > c_j sends the segment's input X[c_j] forward instead, and
c_j > a_j needs nothing extra (worker j sent X[a_j] itself). With tf_j, tb_j the one-way link
times of XF_j, XB_j, the 1F1B steady state generalises `partition.bottleneck`: a micro-batch
crossing the window k..l goes down every link with its forward message and up with its
gradient message, so
    B = max( max_j T_j, max_j max(tf_j, tb_j), max_{k<l} (Σ_{k..l} T + Σ_{k..l-1} (tf + tb)) / (l-k+1) )
which is `partition.bottleneck` when a = c (tf = tb = t). comm="charged" adds tf + tb to both
ends' T instead (no link resource), as `partition` does.
Memory (spec §3.5): the BP range holds weights, gradients and optimizer state (`static_mem`);
the FP-only units hold a replica of their weights (`param_bytes`, default `static_mem`, an
over-estimate). Stashes: worker j holds its core's from F to B, and the segment at its left
boundary in either direction (a_{j-1} > c_{j-1}: received with the forward message, kept to
its B; c_{j-1} > a_{j-1}: its own forward's, kept until its B ships them back); the segment at
its right boundary leaves at once (a_j > c_j) or arrives just before its B (c_j > a_j):
    M_j = Σ static[j][BP range] + Σ param[FP range minus BP range]
          + act_factor_j · Σ act[j][(min(a_{j-1}, c_{j-1}), min(a_j, c_j)]] + inflight_j · X[a_{j-1}]
Weights: the BP worker owns a segment; after every optimizer step it refreshes the FP
worker's replica, Σ param_bytes of the segment per iteration per boundary
(`weight_sync_bytes`, a tail after the step: `sync_time`).

Search (spec §3.4): `bipartition()` takes the exact single-cut bounds b of `partition()` and
lets a_j, c_j range over [b_j − window, b_j + window]. A DP over boundaries with state
(a_j, c_j) keeps, per state, the least carried window sum Q (the argument of `partition`'s
"exact partitioner" comment carries over: Q_l = T_l − T + max(0, Q_{l-1} + tf_{l-1} + tb_{l-1})
is nondecreasing in Q_{l-1}); bisection on T. Exact inside the window (tested against
`brute_force_bi` with a window covering everything). a = c = b is always in the window, so
the result is never worse than the single cut under this model.
Lower bound: `bound.lower_bound(..., bipartition=True)`.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from pipecc.passes.partition import (
    CANNOT_RUN_S, InfeasibleError, Partition, PartitionProblem, _arrays, _charged, _fits,
    _link1, _T_RTOL, partition)

MODES = ("ship", "recompute")


@dataclass(frozen=True)
class BiPartition:
    """FP/BP cut pair and its cost (module docstring); worker j: FP (a_{j-1}, a_j],
    BP (c_{j-1}, c_j] in unit counts, i.e. node indices a_{j-1} .. a_j - 1."""

    fwd_bounds: tuple[int, ...]
    bwd_bounds: tuple[int, ...]
    stage_time: tuple[float, ...]          # T_j (compute, + charged transfers)
    stage_memory: tuple[float, ...]
    fwd_cut_bytes: tuple[float, ...]       # XF_j per boundary (one micro-batch)
    bwd_cut_bytes: tuple[float, ...]       # XB_j per boundary
    misplaced_stash_bytes: tuple[float, ...]  # the extra bytes in XF_j or XB_j per boundary
    weight_sync_bytes: tuple[float, ...]   # replica refresh per boundary per iteration
    fwd_link_time: tuple[float, ...]
    bwd_link_time: tuple[float, ...]
    sync_time: tuple[float, ...]           # one-way time of the weight refresh per boundary
    bottleneck: float
    mode: str = "ship"
    fits: bool = True

    @property
    def is_split(self) -> bool:
        """True when some forward cut differs from its backward cut."""
        return self.fwd_bounds != self.bwd_bounds


def _check(n: int, p: int, a: Sequence[int], c: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    a, c = tuple(int(x) for x in a), tuple(int(x) for x in c)
    for name, b in (("forward", a), ("backward", c)):
        if len(b) != p + 1 or b[0] != 0 or b[-1] != n or any(x >= y for x, y in zip(b, b[1:])):
            raise ValueError(f"{name} bounds must rise strictly from 0 to {n} in {p} steps, got {b}")
    for j in range(p):
        if max(a[j], c[j]) >= min(a[j + 1], c[j + 1]):
            raise ValueError(f"worker {j} has an empty core with forward {a} and backward {c}")
    return a, c


def _prefix(x: np.ndarray) -> np.ndarray:
    """Prefix sums along the last axis with a leading 0: P[..., e] - P[..., a] = Σ x[..., a:e]."""
    zeros = np.zeros(x.shape[:-1] + (1,))
    return np.concatenate((zeros, np.cumsum(x, axis=-1)), axis=-1)


class _Costs:
    """Prefix sums shared by evaluate_bi and the DP."""

    def __init__(self, pr: PartitionProblem, mode: str):
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: one of {MODES}")
        if not pr.training:
            raise ValueError("Bi-Partition needs a training problem (inference has no backward)")
        ar = _arrays(pr)
        self.pr, self.ar, self.mode, self.n, self.p = pr, ar, mode, ar.n, ar.p
        self.charged = _charged(pr)
        self.PF = _prefix(np.asarray(pr.fwd, dtype=float))
        self.PB = _prefix(np.asarray(pr.bwd, dtype=float))
        self.PS = _prefix(ar.static)
        self.fixed = ar.fixed if ar.fixed is not None else np.zeros(ar.p)  # [worker] c_j
        self.PA = _prefix(ar.act)
        stash = pr.stash_bytes if pr.stash_bytes is not None else np.asarray(ar.act).max(axis=0)
        params = pr.param_bytes if pr.param_bytes is not None else np.asarray(ar.static).max(axis=0)
        self.PSt = _prefix(np.asarray(stash, dtype=float))
        self.PPar = _prefix(np.asarray(params, dtype=float))

    def link(self, k: int, nbytes: float) -> float:
        return _link1(self.pr, k, nbytes)

    def messages(self, j: int, a: int, c: int) -> tuple[float, float, float]:
        """XF_j, XB_j and the extra bytes among them at boundary j with cuts a, c."""
        X = self.ar.X
        if self.mode == "ship":
            lo, hi = min(a, c), max(a, c)
            if self.pr.segment_stash is not None:
                extra = float(self.pr.segment_stash(lo, hi)) if hi > lo else 0.0
            else:
                extra = float(self.PSt[hi] - self.PSt[lo])
        else:
            extra = float(X[c]) if a > c else 0.0
        xf = float(X[a]) + (extra if a > c else 0.0)
        xb = float(X[c]) + (extra if c > a else 0.0)
        return xf, xb, extra

    def blocked(self, j: int, s: int) -> float:
        b = self.pr.blocked
        return CANNOT_RUN_S if b is not None and b[j][s] else 0.0


def evaluate_bi(problem: PartitionProblem, a: Sequence[int], c: Sequence[int],
                mode: str = "ship") -> BiPartition:
    """Cost of an FP/BP cut pair under the module's model. O(p² + p)."""
    return _evaluate(_Costs(problem, mode), a, c)


def _evaluate(cs: _Costs, a: Sequence[int], c: Sequence[int]) -> BiPartition:
    ar, n, p = cs.ar, cs.n, cs.p
    a, c = _check(n, p, a, c)
    xf, xb, extra, sync = [], [], [], []
    for j in range(1, p):
        f, b, e = cs.messages(j - 1, a[j], c[j])
        xf.append(f), xb.append(b), extra.append(e)
        sync.append(float(abs(cs.PPar[a[j]] - cs.PPar[c[j]])))
    tf = [cs.link(k, x) for k, x in enumerate(xf)]
    tb = [cs.link(k, x) for k, x in enumerate(xb)]
    times, mems = [], []
    for j in range(p):
        t = float(cs.PF[j, a[j + 1]] - cs.PF[j, a[j]] + cs.PB[j, c[j + 1]] - cs.PB[j, c[j]]) \
            + float(cs.fixed[j])
        if cs.mode == "recompute":  # BP-only units: the forward once more
            t += float(max(0.0, cs.PF[j, a[j]] - cs.PF[j, c[j]])
                       + max(0.0, cs.PF[j, c[j + 1]] - cs.PF[j, a[j + 1]]))
        for k in (j - 1, j):
            if 0 <= k < p - 1:
                t += cs.blocked(k, a[k + 1]) + (cs.blocked(k, c[k + 1]) if c[k + 1] != a[k + 1] else 0.0)
                t += tf[k] + tb[k] if cs.charged else 0.0
        times.append(t)
        replica = max(0.0, cs.PPar[c[j]] - cs.PPar[a[j]]) + max(0.0, cs.PPar[a[j + 1]] - cs.PPar[c[j + 1]])
        held = cs.PA[j, min(a[j + 1], c[j + 1])] - cs.PA[j, min(a[j], c[j])]
        mems.append(float(cs.PS[j, c[j + 1]] - cs.PS[j, c[j]] + replica
                          + ar.act_factor(j) * held + ar.inflight[j] * ar.X[a[j]]))
    tol = ar.mem_tol
    fits = all(_fits(m, cap, tol) for m, cap in zip(mems, ar.caps))
    if cs.charged:
        tf_res, tb_res = [0.0] * len(tf), [0.0] * len(tb)
    else:
        tf_res, tb_res = tf, tb
    return BiPartition(a, c, tuple(times), tuple(mems), tuple(xf), tuple(xb), tuple(extra),
                       tuple(sync), tuple(tf), tuple(tb),
                       tuple(cs.link(k, x) for k, x in enumerate(sync)),
                       bottleneck_bi(times, tf_res, tb_res), cs.mode, fits)


def bottleneck_bi(stage_time: Sequence[float], fwd_link: Sequence[float],
                  bwd_link: Sequence[float]) -> float:
    """B of the module docstring from T_j and one-way tf_j, tb_j. O(p²)."""
    T = np.asarray(stage_time, dtype=float)
    tf, tb = np.asarray(fwd_link, dtype=float), np.asarray(bwd_link, dtype=float)
    out = max(float(T.max(initial=0.0)), float(tf.max(initial=0.0)), float(tb.max(initial=0.0)))
    if len(T) < 2:
        return out
    S = np.concatenate(([0.0], np.cumsum(T)))
    L = np.concatenate(([0.0], np.cumsum(tf + tb)))
    k, l = np.triu_indices(len(T))
    return max(out, float(((S[l + 1] - S[k] + L[l] - L[k]) / (l - k + 1)).max()))


def brute_force_bi(problem: PartitionProblem, mode: str = "ship") -> BiPartition:
    """Reference optimum over all FP/BP cut pairs with non-empty cores (tests only, n ≲ 9)."""
    cs = _Costs(problem, mode)
    n, p = cs.n, cs.p
    seqs = [(0, *x, n) for x in itertools.combinations(range(1, n), p - 1)]
    best = None
    for a in seqs:
        for c in seqs:
            if any(max(a[j], c[j]) >= min(a[j + 1], c[j + 1]) for j in range(p)):
                continue
            cand = _evaluate(cs, a, c)
            if cand.fits and (best is None or cand.bottleneck < best.bottleneck):
                best = cand
    if best is None:
        raise InfeasibleError(f"no FP/BP placement of {n} nodes on {p} devices fits memory")
    return best


# ---- windowed exact DP ----------------------------------------------------------------------
# State of boundary j: the pair (a_j, c_j) from the window's candidates (a_0 = c_0 = 0,
# a_p = c_p = n are single states). For each transition (prev state -> state) of worker j the
# compute T_j, the memory fit and the core test are fixed: built once as matrices. Per probe T
# only the carry Q moves along the boundaries (module docstring).

@dataclass
class _Step:
    T: np.ndarray      # [prev, cur] T_j (inf: transition not allowed: empty core, no memory fit)
    states: list[tuple[int, int]]
    tsum: np.ndarray   # [cur] tf + tb of the link after worker j at that state (0: last worker)
    tmax: np.ndarray   # [cur] max(tf, tb), the link as a resource


def _steps(cs: _Costs, cands: list[list[int]], no_segment: np.ndarray | None) -> list[_Step]:
    n, p = cs.n, cs.p
    bad = None if no_segment is None else np.concatenate(([0], np.cumsum(no_segment.astype(int))))
    layers: list[list[tuple[int, int]]] = [[(0, 0)]]
    for j in range(1, p):
        layer = [(a, c) for a in cands[j - 1] for c in cands[j - 1]
                 if bad is None or bad[max(a, c)] == bad[min(a, c)]]
        layers.append(layer)
    layers.append([(n, n)])
    # link costs per state
    info = []
    for j in range(1, p):
        tsum, tmax = [], []
        for a, c in layers[j]:
            xf, xb, _ = cs.messages(j - 1, a, c)
            tf, tb = cs.link(j - 1, xf), cs.link(j - 1, xb)
            pen = cs.blocked(j - 1, a) + (cs.blocked(j - 1, c) if a != c else 0.0)
            tsum.append((tf, tb, pen))
        info.append(tsum)
    ar = cs.ar
    steps = []
    tol = ar.mem_tol
    for j in range(p):
        prev, cur = np.array(layers[j]), np.array(layers[j + 1])
        pa, pc = prev[:, 0][:, None], prev[:, 1][:, None]
        ca, cc = cur[:, 0][None, :], cur[:, 1][None, :]
        T = cs.PF[j][ca] - cs.PF[j][pa] + cs.PB[j][cc] - cs.PB[j][pc] + cs.fixed[j]
        if cs.mode == "recompute":
            T = T + np.maximum(0.0, cs.PF[j][pa] - cs.PF[j][pc]) + np.maximum(0.0, cs.PF[j][cc] - cs.PF[j][ca])
        tf_in = np.array([[x[0] for x in info[j - 1]]]).T if j > 0 else np.zeros((1, 1))
        tb_in = np.array([[x[1] for x in info[j - 1]]]).T if j > 0 else np.zeros((1, 1))
        pen_in = np.array([[x[2] for x in info[j - 1]]]).T if j > 0 else np.zeros((1, 1))
        T = T + pen_in
        if j < p - 1:
            out = info[j]
            T = T + np.array([[x[2] for x in out]])
        if cs.charged:
            T = T + tf_in + tb_in
            if j < p - 1:
                T = T + np.array([[x[0] + x[1] for x in info[j]]])
        replica = np.maximum(0.0, cs.PPar[pc] - cs.PPar[pa]) + np.maximum(0.0, cs.PPar[ca] - cs.PPar[cc])
        held = cs.PA[j][np.minimum(ca, cc)] - cs.PA[j][np.minimum(pa, pc)]
        mem = (cs.PS[j][cc] - cs.PS[j][pc] + replica + ar.act_factor(j) * held
               + ar.inflight[j] * ar.X[pa])
        ok = (np.maximum(pa, pc) < np.minimum(ca, cc)) & (pa < ca) & (pc < cc)
        ok &= mem <= ar.caps[j] + 1e-12 * abs(ar.caps[j]) + tol
        T = np.where(ok, T, np.inf)
        if j < p - 1 and not cs.charged:
            tsum = np.array([x[0] + x[1] for x in info[j]])
            tmax = np.array([max(x[0], x[1]) for x in info[j]])
        else:
            tsum = tmax = np.zeros(len(layers[j + 1]))
        steps.append(_Step(T, layers[j + 1], tsum, tmax))
    return steps


def _probe(steps: list[_Step], T: float) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """Per worker (Q at each state, best previous state); None if (n, n) is not reached."""
    T = min(T, 1e300)  # NOTE: a finite "no bound" keeps inf - inf (nan) out of argmin
    carry = np.zeros(1)  # before worker 0: carry 0 at the single state (0, 0)
    out = []
    for st in steps:
        with np.errstate(invalid="ignore"):
            cand = st.T - T + carry[:, None]
        arg = np.argmin(cand, axis=0)
        Q = cand[arg, np.arange(cand.shape[1])]
        reach = np.isfinite(Q) & (Q <= 0) & (st.tmax <= T)
        Q = np.where(reach, Q, np.inf)
        if not reach.any():
            return None
        carry = np.where(reach, np.maximum(0.0, Q + st.tsum), np.inf)
        out.append((Q, arg))
    return out


def _path(steps: list[_Step], R: list[tuple[np.ndarray, np.ndarray]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    idx, a, c = 0, [], []
    for j in range(len(steps) - 1, -1, -1):
        s = steps[j].states[idx]
        a.append(s[0]), c.append(s[1])
        idx = int(R[j][1][idx])
    a.append(0), c.append(0)
    return tuple(reversed(a)), tuple(reversed(c))


def bipartition(problem: PartitionProblem, window: int = 8, mode: str = "ship",
                single: Partition | None = None,
                no_segment: Sequence[bool] | None = None,
                no_cut: Sequence[bool] | None = None, widen_to: int = 0) -> BiPartition:
    """Best FP/BP cut pair with every cut within `window` units of the single cut (§3.4).

    `single`: the exact single-cut partition (computed with `partition()` if None).
    `no_segment[i]` True: node i may not lie in a misplaced segment (a module whose buffers
    training mutates, object ports: the runtime cannot run its FP and BP apart).
    `no_cut[s]` True (s = 0..n): neither a forward nor a backward cut may lie at boundary s
    (nodes sharing a weight stay in one piece); the single cut's own bounds stay allowed.
    `widen_to` > window: while the best pair has a cut at the window's edge and improved on
    the last window, double the window, up to `widen_to` (spec §3.4: "widen Δ while the result
    keeps improving"; the DP's matrices grow as window^4, so keep it ≲ 16).
    Bisection on T with the exact DP test; each feasible probe is rebuilt and evaluated, so
    the result is a real cut pair within relative 1e-13 of the window's optimum.
    Cost: O(p · (2·window+1)^4) numpy per probe, ~45 probes. Raises InfeasibleError as
    `partition` does.
    """
    base = single if single is not None else partition(problem)
    best = _search(problem, window, mode, base, no_segment, no_cut)
    while window < widen_to and best.is_split:
        edge = any(abs(x - b) >= window for bounds in (best.fwd_bounds, best.bwd_bounds)
                   for x, b in zip(bounds[1:-1], base.bounds[1:-1]))
        if not edge:
            break
        window = min(2 * window, widen_to)
        wider = _search(problem, window, mode, base, no_segment, no_cut)
        if wider.bottleneck >= best.bottleneck * (1 - 1e-12):
            break
        best = wider
    return best


def _search(problem: PartitionProblem, window: int, mode: str, base: Partition,
            no_segment: Sequence[bool] | None, no_cut: Sequence[bool] | None) -> BiPartition:
    cs = _Costs(problem, mode)
    n, p = cs.n, cs.p
    cands = [sorted({x for x in range(b - window, b + window + 1) if 1 <= x <= n - 1
                     and (x == b or no_cut is None or not no_cut[x])})
             for b in base.bounds[1:-1]]
    mask = None if no_segment is None else np.asarray(no_segment, dtype=bool)
    steps = _steps(cs, cands, mask)
    best = _evaluate(cs, base.bounds, base.bounds)
    R = _probe(steps, math.inf)
    if R is None:  # the single cut fits, so this cannot happen unless its memory was over
        if best.fits:
            return best
        raise InfeasibleError(f"no FP/BP placement of {n} nodes on {p} devices fits memory")
    cand = _evaluate(cs, *_path(steps, R))
    best = cand if cand.bottleneck < best.bottleneck or not best.fits else best
    hi, lo = best.bottleneck, 0.0
    while hi - lo > _T_RTOL * hi:
        mid = 0.5 * (lo + hi)
        R = _probe(steps, mid)
        if R is None:
            lo = mid
            continue
        cand = _evaluate(cs, *_path(steps, R))
        best = cand if cand.bottleneck < best.bottleneck else best
        hi = min(mid, cand.bottleneck)
    return best
