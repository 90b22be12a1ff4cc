"""Pipeline partitioner: contiguous stages on heterogeneous devices, exact min-bottleneck.

Policy only: a pure function over numbers (no torch, no sympy), tested without a model; building
the PartitionProblem and cutting the graph at `Partition.bounds` live elsewhere.

Cost model. Stage k runs on device k and holds nodes a..e-1 (a = bounds[k], e = bounds[k+1]).
X[s] is the bytes crossing the boundary before node s: every tensor produced before s and
consumed at or after s, counted once per boundary it crosses (a skip over two cuts is relayed
through the middle stage and paid twice). X[0] = 0 (model input is not charged) and X[n] = 0
(outputs feed the loss on the last stage). Per micro-batch, stage k computes and link k
(stage k → k+1) carries one message each way (activation forward, its gradient back):
    T_k = Σ (fwd + bwd)[k][a:e] + c_k    t_k = link_time(k, X[e])   (t_{p-1} = 0, c_k: fixed)
Communication is modelled as the runtime runs it (`pipecc.runtime.wire`): a SEND is an
`isend`, so the sender computes on while the link carries the tensor; the link carries one
message at a time per direction; the receiver's RECV waits until the data has arrived. The
bottleneck is the steady-state time per micro-batch of that machine under 1F1B (what
`passes.simulate` measures; tests/test_comm_model.py checks them against each other):
    B = max over windows of consecutive stages k ≤ l of
            (Σ_{i=k..l} T_i + 2 Σ_{i=k..l-1} t_i) / (l - k + 1),   and max_k t_k.
Why windows: in 1F1B stage k's forward of micro-batch j and its backward of j are l-k+1
steady-state periods apart when the backward waits on stage l; in between the micro-batch
crosses every link of the window twice (activation down, gradient up) and every stage of it
computes once, and those transfers cannot overlap with that chain (a max-plus cycle of
weight Σ T + 2 Σ t over l-k+1 periods; the transfers only overlap with *other* micro-batches'
compute). l = k is T_k; max_k t_k is the link as a resource (already implied by the pair
window when training). Forward-only problems (`training=False`, inference) have no way back:
transfers stream fully overlapped, B = max(max_k T_k, max_k t_k) with t one way.
    M_k = Σ static_mem[a:e] + inflight[k] · (Σ act_mem[a:e] + X[a])
(static_mem and act_mem may differ per stage: [stage][node]; an FPGA stage counts its
on-chip memory, not the GPU-style weights/gradients/optimizer state.)
(received activations are stashed for backward as well). A stage fits if M_k ≤ mem_cap[k]
(the caps leave room for the running action's working set, `cap_margin`; docs/memory.md).
A recomputed stage (`recompute[k]`) stashes only what it received and re-runs its forward in
each backward: one micro-batch's internal activations live at once (GPipe's rematerialisation,
PAPERS-SPEC §1.4; Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"):
    M_k = Σ static_mem[a:e] + Σ act_mem[a:e] + inflight[k] · X[a]
(its backward time, which includes the second forward, is the caller's: `bwd` as given).
Blocked cuts: `blocked[k][s]` True forbids link k from lying at boundary s (the FPGA backend
takes one float32 tensor per boundary): it adds CANNOT_RUN_S (`pipecc.targets.timing`) to T of
both stages, a finite stand-in for "impossible" the bisection can handle, as is a node's cost on
a device that cannot run it: a result at or above it means no allowed placement exists.
"""
from __future__ import annotations

import hashlib
import itertools
import math
from collections import OrderedDict
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Sequence

import numpy as np

from pipecc.targets.timing import CANNOT_RUN_S

_MEM_RTOL = 1e-12  # NOTE: prefix and direct sums differ by ulps; never let that flip a fit
_T_RTOL = 1e-13    # bisection stops when the bracket on the bottleneck is this tight


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
    training: bool = True  # gradients travel back (1F1B windows); False: forward-only stream
    # "overlapped": transfers as the runtime runs them (module docstring); "charged": each added
    # to both its stages' compute (x2 when training), no link resource. Not a leftover: the
    # charged cuts win 22 of 172 zoo plans (TINY; up to 22%, GPT on 2xcpu, gpipe; issue 18).
    comm: str = "overlapped"
    # [stage] True: the stage recomputes its activations (module docstring, M_k); None: none do
    recompute: Sequence[bool] | None = None
    # Bi-Partition (`techniques.bipartition.search`) only: [node] saved-tensor bytes per micro-batch, shipped
    # when its FP and BP run on different workers (None: act_mem), or (lo, hi) -> the bytes that
    # nodes lo..hi-1 keep, each storage once (`segment_stash`, exact where given); [node] its
    # parameters' bytes, a forward worker's replica (None: static_mem, an over-estimate)
    stash_bytes: Sequence[float] | None = None
    segment_stash: Callable[[int, int], float] | None = None
    param_bytes: Sequence[float] | None = None
    # [stage] one micro-batch's fixed forward / backward seconds whatever the stage holds
    # (`pipecc.targets.fixed_costs`): T_k adds both (c_k); None: none
    fixed_fwd: Sequence[float] | None = None
    fixed_bwd: Sequence[float] | None = None
    # the simulator's memory terms beyond M_k (`passes.units.Units`: [node] the backward's largest
    # working set; [node] escaping output bytes no backward keeps); None: not counted
    work_mem: Sequence[float] | None = None
    held_out_mem: Sequence[float] | None = None
    # bytes each mem_cap was lowered by to bound those terms (plan_problem._with_working_sets):
    # a simulated peak is compared with mem_cap + cap_margin, the device's own figure
    cap_margin: float = 0.0

    def stage_fixed(self, k: int) -> tuple[float, float]:
        """Stage k's fixed forward and backward seconds per micro-batch (0, 0 without)."""
        return (float(self.fixed_fwd[k]) if self.fixed_fwd is not None else 0.0,
                float(self.fixed_bwd[k]) if self.fixed_bwd is not None else 0.0)


@dataclass(frozen=True)
class Partition:
    """A placement and its cost; stage k holds nodes bounds[k] .. bounds[k+1]-1."""

    bounds: tuple[int, ...]
    stage_time: tuple[float, ...]
    stage_memory: tuple[float, ...]
    cut_bytes: tuple[float, ...]  # one direction, per cut between consecutive stages
    bottleneck: float             # steady-state time per micro-batch (module docstring)
    fits: bool = True             # every stage within its mem_cap (baselines may not fit)
    link_time: tuple[float, ...] = ()  # t_k one way, per cut; stage_time is T_k (compute)


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
    # NOTE: a float sum loses small next to huge (1e20 + 0.1 - 1e20 = 0): int64 or exact rationals
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
    act_times: np.ndarray | None = None  # [stage] multiplier of Σ act: inflight, or 1 if recomputed
    fixed: np.ndarray | None = None      # [stage] c_k (module docstring); None: 0

    def act_factor(self, k: int) -> float:
        """How many micro-batches' internal activations stage k holds at its peak."""
        return float(self.inflight[k] if self.act_times is None else self.act_times[k])

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
    act_times = None
    if pr.recompute is not None:
        if len(pr.recompute) != p:
            raise ValueError(f"recompute needs one flag per stage ({p}), got {len(pr.recompute)}")
        act_times = np.where(np.asarray(pr.recompute, dtype=bool), np.minimum(inflight, 1.0), inflight)
    fixed = None if pr.fixed_fwd is None and pr.fixed_bwd is None else np.array([sum(pr.stage_fixed(k)) for k in range(p)])
    return _Arrays(n, p, cost, static, act, inflight, np.asarray(pr.mem_cap, dtype=float), X,
                   act_times, fixed)


def _link1(pr: PartitionProblem, k: int, nbytes: float) -> float:
    """One message over link k; no bytes, no message."""
    return 0.0 if nbytes <= 0 else float(pr.link_time(k, float(nbytes)))


def _penalty(pr: PartitionProblem, k: int, s: int, X: Sequence[float]) -> float:
    """What a cut of link k at boundary s adds to both its stages: CANNOT_RUN_S if blocked,
    plus, under comm="charged", the transfer itself."""
    pen = CANNOT_RUN_S if pr.blocked is not None and pr.blocked[k][s] else 0.0
    if pr.comm == "charged":
        pen += (2.0 if pr.training else 1.0) * _link1(pr, k, X[s])
    return pen


def _charged(pr: PartitionProblem) -> bool:
    if pr.comm not in ("overlapped", "charged"):
        raise ValueError(f"comm={pr.comm!r}: 'overlapped' or 'charged'")
    return pr.comm == "charged"


def _fits(mem: float, cap: float, tol: float = 0.0) -> bool:
    return mem <= cap + _MEM_RTOL * abs(cap) + tol


def bottleneck(stage_time: Sequence[float], link_time: Sequence[float], training: bool = True) -> float:
    """B of the module docstring from T_k (p stages) and one-way t_k (p-1 links). O(p²)."""
    T, t = np.asarray(stage_time, dtype=float), np.asarray(link_time, dtype=float)
    out = max(float(T.max(initial=0.0)), float(t.max(initial=0.0)))
    if not training or len(T) < 2:
        return out
    S = np.concatenate(([0.0], np.cumsum(T)))                 # S[l+1] - S[k] = Σ T[k..l]
    L = np.concatenate(([0.0], np.cumsum(2.0 * t)))           # L[l] - L[k] = 2 Σ t[k..l-1]
    k, l = np.triu_indices(len(T))
    windows = (S[l + 1] - S[k] + L[l] - L[k]) / (l - k + 1)
    return max(out, float(windows.max()))


def _evaluate(ar: _Arrays, pr: PartitionProblem, bounds: Sequence[int]) -> Partition:
    b = tuple(int(x) for x in bounds)
    if len(b) != ar.p + 1 or b[0] != 0 or b[-1] != ar.n or any(x >= y for x, y in zip(b, b[1:])):
        raise ValueError(f"bounds must rise strictly from 0 to {ar.n} in {ar.p} steps, got {b}")
    times, mems = [], []
    for k in range(ar.p):
        a, e = b[k], b[k + 1]
        t = float(ar.cost[k, a:e].sum()) + (float(ar.fixed[k]) if ar.fixed is not None else 0.0)
        t += _penalty(pr, k - 1, a, ar.X) if k > 0 else 0.0
        t += _penalty(pr, k, e, ar.X) if k < ar.p - 1 else 0.0
        times.append(t)
        mems.append(float(ar.static[k, a:e].sum() + ar.act_factor(k) * ar.act[k, a:e].sum()
                          + ar.inflight[k] * ar.X[a]))
    tol = ar.mem_tol
    fits = all(_fits(m, c, tol) for m, c in zip(mems, ar.caps))
    cuts = tuple(float(ar.X[s]) for s in b[1:-1])
    links = tuple(0.0 if _charged(pr) else _link1(pr, k, x) for k, x in enumerate(cuts))
    return Partition(b, tuple(times), tuple(mems), cuts, bottleneck(times, links, pr.training),
                     fits, links)


def evaluate(problem: PartitionProblem, bounds: Sequence[int]) -> Partition:
    """Cost of a given placement under the module's cost model. O(p·n + p²)."""
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
# B ≤ T iff every window sum Σ_{k..l} (T_i - T) + 2 Σ_{k..l-1} t_i ≤ 0 and every t_k ≤ T.
# Q_l, the largest window sum ending at stage l, obeys Q_l = (T_l - T) + carry_{l-1} with
# carry = max(0, Q + 2t) (0 when forward-only): the prefix matters to the rest only through
# its last boundary and Q, and Q_l is nondecreasing in Q_{l-1}. So for a bound T it suffices
# to know, per stage l and end e, the least Q_l over feasible prefixes (all their windows ≤ 0):
#     Q_l[e] = v_l[e] - max{w_l[a] : R_{l-1}[a], a < e ≤ hi_l[a]} - T,
#     w_l[a] = P_l[a] - pen_{l-1}[a] - carry_{l-1}[a],  v_l[e] = P_l[e] + pen_l[e]
# (P: prefix sums of stage l's device; pen: blocked-cut penalties), and R_l[e] ⇔ Q_l[e] ≤ 0
# and t_l[e] ≤ T. B ≤ T is monotone in T, so bisection on T with this exact test finds the
# optimum; any placement whose windows are ≤ 0 is found (exchange argument: replacing its
# prefix by the least-Q prefix to the same boundary keeps every later window ≤ 0).
# w depends on T through the carry, so it is rebuilt per probe. Stage l fits iff e ≤ hi_l[a]
# (memory grows with e for a fixed start; it is NOT monotone in a, because X[a] is arbitrary,
# so feasible starts for an end need not be an interval). The max over the intervals
# (a, hi_l[a]] covering e is painted with a doubling table: each interval is two power-of-two
# blocks, pushed down level by level — O(n log n) numpy per stage and probe.

@dataclass
class _Stage:
    w: np.ndarray              # P - incoming penalty (the carry is subtracted per probe)
    v: np.ndarray              # P + outgoing penalty
    t: np.ndarray              # [e] one-way time of the outgoing link at boundary e (0: last)
    hi: np.ndarray             # [a] last feasible end for start a; -1 if none
    src: np.ndarray | None     # start a of each painted block, grouped by cell; None: prefix max
    starts: np.ndarray | None  # first entry of each cell group
    cells: np.ndarray | None   # flat (level, position) index of each group
    levels: int
    starts_ok: np.ndarray | None = None  # kept per stage (issue 31): hi >= 0, 2.0 * t, hi.max(),
    two_t: np.ndarray | None = None      # and `_cover_max`'s doubling table
    top: int = 0
    table: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.starts_ok, self.two_t, self.top = self.hi >= 0, 2.0 * self.t, int(self.hi.max())


def _stage_hi(ar: _Arrays, k: int, caps: np.ndarray) -> tuple[np.ndarray, int]:
    """([start a] the last end stage k fits memory with, -1 if none; the last end it may have)."""
    n, p = ar.n, ar.p
    pos = np.arange(n + 1)
    f, last = ar.inflight[k], n - (p - 1 - k)  # later stages need a node each
    G = np.concatenate(([0.0], np.cumsum(ar.static[k] + ar.act_factor(k) * ar.act[k])))
    thr = G - f * ar.X + caps[k] + _MEM_RTOL * abs(caps[k]) + ar.mem_tol
    hi = np.minimum(np.searchsorted(G, thr, side="right") - 1, last)
    hi[(hi <= pos) | (pos < k) | ((k == 0) & (pos > 0))] = -1
    return hi, last


def memory_free(problem: PartitionProblem) -> bool:
    """True when memory rules out no contiguous placement: every stage fits from every start
    it may have to the last end it may have. `partition` then computes the very same thing
    whatever the in-flight counts and caps (the planner's schedules share such problems)."""
    ar = _arrays(problem)
    pos = np.arange(ar.n + 1)
    for k in range(ar.p):
        hi, last = _stage_hi(ar, k, ar.caps)
        valid = (pos >= k) & (pos < last) & ((k > 0) | (pos == 0))
        if not np.all(hi[valid] == last):
            return False
    return True


def _stages(ar: _Arrays, links: tuple[np.ndarray, np.ndarray], caps: np.ndarray) -> list[_Stage]:
    n, p = ar.n, ar.p
    t, pen = links
    zero = np.zeros(n + 1)
    stages = []
    for k in range(p):
        P = np.concatenate(([0.0], np.cumsum(ar.cost[k])))
        w, v = P - (pen[k - 1] if k > 0 else zero), P + (pen[k] if k < p - 1 else zero)
        v = v + (ar.fixed[k] if ar.fixed is not None else 0.0)  # c_k: every end pays it
        tk = t[k] if k < p - 1 else zero
        hi, last = _stage_hi(ar, k, caps)
        a = np.flatnonzero(hi >= 0)
        if np.all(hi[a] == last):
            stages.append(_Stage(w, v, tk, hi, None, None, None, 0))
            continue
        j = np.frexp((hi[a] - a).astype(float))[1] - 1  # floor(log2(interval length)), exact
        cell = np.concatenate((j * (n + 1) + a + 1, j * (n + 1) + hi[a] - np.left_shift(1, j) + 1))
        order = np.argsort(cell, kind="stable")
        cell, src = cell[order], np.concatenate((a, a))[order]
        starts = np.flatnonzero(np.r_[True, cell[1:] != cell[:-1]])
        stages.append(_Stage(w, v, tk, hi, src, starts, cell[starts], int(j.max()) + 1))
    return stages


def _cover_max(wm: np.ndarray, st: _Stage, n: int) -> np.ndarray:
    """W[e] = max wm[a] over starts a whose interval (a, hi[a]] contains e (-inf if none)."""
    if st.src is None:  # every interval runs to the same end: a prefix maximum
        W = np.full(n + 1, -np.inf)
        W[1:] = np.maximum.accumulate(wm[:-1])
        W[st.top + 1:] = -np.inf
        return W
    if st.table is None:  # NOTE: refilled per probe; W (a view) is read before the next (`_reach`)
        st.table = np.empty(st.levels * (n + 1))
    M = st.table
    M.fill(-np.inf)
    M[st.cells] = np.maximum.reduceat(wm[st.src], st.starts)
    M = M.reshape(st.levels, n + 1)
    for j in range(st.levels - 1, 0, -1):  # block (j, s) = halves (j-1, s) and (j-1, s + h)
        h = 1 << (j - 1)
        np.maximum(M[j - 1], M[j], out=M[j - 1])
        np.maximum(M[j - 1, h:], M[j, :-h], out=M[j - 1, h:])
    return M[0]


def _reach(stages: list[_Stage], T: float, n: int,
           training: bool) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """Per stage (R_l, w_l with the carry in): which ends are reachable within T."""
    R = np.zeros(n + 1, dtype=bool)
    R[0] = True
    carry = np.zeros(n + 1)
    out = []
    # NOTE (issue 31): one errstate, v - W once, each stage's masks and 2t kept (`_Stage`)
    with np.errstate(invalid="ignore"):  # inf - inf where nothing reaches e
        for st in stages:
            wm = np.where(R & st.starts_ok, st.w - carry, -np.inf)
            W = _cover_max(wm, st, n)
            load = st.v - W
            R = (W > -np.inf) & (load <= T) & (st.t <= T)
            carry = np.maximum(0.0, (load - T) + st.two_t) if training and T < math.inf else carry
            if not R.any():
                return None
            out.append((R, wm))
    return out if out[-1][0][n] else None


def _backtrack(stages: list[_Stage], R: list[tuple[np.ndarray, np.ndarray]], T: float,
               n: int) -> tuple[int, ...]:
    pos, e, bounds = np.arange(n + 1), n, [n]
    for k in range(len(stages) - 1, -1, -1):
        st, wm = stages[k], R[k][1]
        prev = R[k - 1][0] if k > 0 else pos == 0
        cand = np.flatnonzero(prev & (st.hi >= e) & (pos < e) & (st.v[e] - wm <= T))
        e = int(cand[np.argmax(wm[cand])])  # same arithmetic as _reach: one always exists
        bounds.append(e)
    return tuple(reversed(bounds))


def partition(problem: PartitionProblem) -> Partition:
    """Contiguous placement minimising the bottleneck B (module docstring) subject to memory.

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
    key = _digest(ar, links, problem)
    if key in _SOLVED:
        _SOLVED.move_to_end(key)
        found = _SOLVED[key]
        if isinstance(found, str):
            raise InfeasibleError(found)
        return found
    try:
        best = _solve(ar, problem, links)
    except InfeasibleError as exc:
        _remember(key, str(exc))
        raise
    _remember(key, best)
    return best


# NOTE: the planner partitions the same numbers again (same in-flight counts, BPipe's fits, the
# fewer-devices searches: 36 of 486 calls, GPT-2 48 layers, 8 devices): a solved problem is kept
# by the digest of all `_solve` reads; a repeat returns the same Partition or raises the same message
_SOLVED: OrderedDict[bytes, Partition | str] = OrderedDict()
_SOLVED_MAX = 1024


def forget() -> None:
    """Drop every remembered solution (a benchmark timing a cold search)."""
    _SOLVED.clear()


def _remember(key: bytes, value: Partition | str) -> None:
    _SOLVED[key] = value
    while len(_SOLVED) > _SOLVED_MAX:
        _SOLVED.popitem(last=False)


def _digest(ar: _Arrays, links: tuple[np.ndarray, np.ndarray], pr: PartitionProblem) -> bytes:
    """What `_solve` reads, hashed: every array of `ar`, the link and penalty tables (the
    link_time of every boundary's bytes on every link: all `_evaluate` asks of it), the
    flags and the device labels (the memory report names them)."""
    h = hashlib.blake2b(digest_size=32)
    h.update(repr((ar.n, ar.p, pr.training, pr.comm, tuple(pr.labels) if pr.labels is not None else None,
                   ar.act_times is None, ar.fixed is None)).encode())
    for arr in (ar.cost, ar.static, ar.act, ar.inflight, ar.caps, ar.X, links[0], links[1],
                ar.act_times, ar.fixed):
        if arr is not None:
            h.update(repr(arr.shape).encode())
            if arr.ndim == 2 and arr.shape[0] > 1 and arr.strides[0] == 0:  # one row for every stage
                h.update(b"row")
                arr = arr[0]
            h.update(np.ascontiguousarray(arr, dtype=float).tobytes())
    return h.digest()


def _solve(ar: _Arrays, problem: PartitionProblem, links: tuple[np.ndarray, np.ndarray]) -> Partition:
    """`partition`'s search (its docstring) on the problem's arrays and link table."""
    stages = _stages(ar, links, ar.caps)
    R = _reach(stages, math.inf, ar.n, problem.training)
    if R is None:
        raise InfeasibleError(_memory_report(ar, problem, links))
    best = _evaluate(ar, problem, _backtrack(stages, R, math.inf, ar.n))
    hi = best.bottleneck
    lo = min(hi, float(ar.cost.min(axis=0).sum()) / ar.p)  # fluid bound with equal weights
    while hi - lo > _T_RTOL * hi:
        mid = 0.5 * (lo + hi)
        R = _reach(stages, mid, ar.n, problem.training)
        if R is None:
            lo = mid
            continue
        cand = _evaluate(ar, problem, _backtrack(stages, R, mid, ar.n))
        best = cand if cand.bottleneck < best.bottleneck else best
        hi = min(mid, cand.bottleneck)
    return best


def _link_table(pr: PartitionProblem, ar: _Arrays) -> tuple[np.ndarray, np.ndarray]:
    """[link k, boundary s]: one-way link_time(k, X[s]) (one call per distinct byte count),
    and the blocked-cut penalty."""
    uniq, inv = np.unique(ar.X, return_inverse=True)
    table = np.zeros((max(ar.p - 1, 0), len(uniq)))
    for k in range(ar.p - 1):
        table[k] = [_link1(pr, k, x) for x in uniq]
    table = table[:, inv.ravel()]
    pen = np.zeros_like(table)
    if pr.blocked is not None and ar.p > 1:
        pen = CANNOT_RUN_S * np.asarray(pr.blocked, dtype=float)[: ar.p - 1]
    if _charged(pr):  # the transfer joins both stages' compute; the link is no resource
        pen, table = pen + (2.0 if pr.training else 1.0) * table, np.zeros_like(table)
    return table, pen


def _memory_report(ar: _Arrays, pr: PartitionProblem, links: tuple[np.ndarray, np.ndarray]) -> str:
    """Smallest extra memory per device that admits a placement, and who needs it most."""
    def bounds_with(extra: float) -> tuple[int, ...] | None:
        stages = _stages(ar, links, ar.caps + extra)
        R = _reach(stages, math.inf, ar.n, pr.training)
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
