"""UMPIPE: unequal micro-batch sizes per stage under GPipe or 1F1B row order (tied mode).

    per-stage cost curves f_s(b), g_s(b), link times ─► end-time recurrence (loop and
    vectorised over a population) ─► search: TiDGAP-style GA seeded with every equal split
    (EDP), plus the local-greedy and greedy-DP baselines ─► the fastest split that fits memory

Design reference: /work/shared/PAPERS-SPEC.md §1 (UMPIPE, IEEE TPDS 2024/25). Everything here
is a pipecc reconstruction ([D] in the spec): the paper's abstract names the recurrence, the
dual-chromosome GA, its "two-level" vectorisation and the two greedy baselines, not their
details.

Decisions (shared with the runtime):
- *Tied mode*: each stage s has one size list ``sizes[s]`` (positive ints summing to B) for its
  forward and its backward chunks; chunks are contiguous sample intervals in order. (A
  backward chunk that cuts through a forward chunk's autograd graph would cost that whole
  chunk's backward, spec §1.8 pitfall 1; free backward sizes need recompute.)
- *Schedule*: GPipe row order (every stage: all forward chunks in sample order, then all
  backward chunks in sample order, ``schedule.gpipe_uneven``), priced by the
  recurrence below; or 1F1B's (``one_f_one_b_uneven``), which has none: the search then prices
  each split with the event simulator (``SimulatedPricing``, spec §1.3), whose peak memory
  depends on the split (spec §1.8, pitfall 6).

Time model (spec §1.3), the model of ``passes.simulate`` for that order — one FIFO transfer at a
time per directed link, transfers overlap compute, a consumer chunk waits for every producer
chunk that overlaps its samples (FIFO: for the one holding its last sample, ``π``)::

    EF[s,k] = max(EF[s,k-1], CF[s-1, π(s,k)]) + f_s(b[s,k])
    CF[s,k] = max(CF[s,k-1], EF[s,k]) + l_s(b[s,k])                 (s < p-1)
    EB[s,l] = max(EB[s,l-1], EF[s,K_s], CB[s,l]) + g_s(b[s,l])      (EB[p-1,l]: CB = EF[p-1,l])
    CB[s,l] = max(CB[s,l-1], EB[s+1, κ(s,l)]) + r_{s+1}(b[s,l])       (s < p-1)
    T = max_s EB[s, K_s]     (with per-stage tails: max_s (end_s + tail_s), end_s the later of
                             EB[s, K_s] and its last gradient message CB[s-1, K_{s-1}])

Gradient messages carry whole chunks of the *upstream* stage, as forward messages do (the
runtime's convention, ``pipecc.ir.schedule``): stage s+1 sends the gradient of stage s's chunk
l once its own chunk κ(s,l) (the one holding that chunk's last sample) has run its backward,
so stage s needs no re-slicing of gradients. (Spec §1.3 keys gradient messages by the
sender's backward chunks instead; ``end_times(..., backward_sizes=...)`` keeps that form for
free backward sizes, the spec's worked example.)

``x_j = max(x_{j-1}, e_j) + c_j`` is ``C_j + max_{i<=j}(e_i - C_{i-1})`` with ``C`` the cumulative
sum of ``c``: one cumulative maximum per stage and pass, for a whole population at once
(``population_times``). Chunks are padded to K_max with size 0, which costs 0 (masked).

Memory (spec §1.4, GPipe without recompute): a stage stashes every chunk of the iteration, so
``M_s = static_s + Σ_k act_s(b_k)``; with activations linear in b that is the same for every
split. pipecc's memory model has no per-chunk workspace term, so b_max does not enter it.
Pure numpy; no torch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipecc.ir.schedule.registry import schedule_for
from pipecc.passes.simulate import StageCosts, simulate

__all__ = ["stage_costs", "Curves", "GPipePricing", "Recurrence", "SearchResult", "SimulatedPricing", "equal_splits",
           "end_times", "greedy_dp",
           "local_greedy", "population_times", "search", "parse_sizes", "check_sizes"]


@dataclass(frozen=True)
class Curves:
    """Per-stage cost tables indexed by chunk size b = 0..B (entry 0 is 0: padding is free).

    ``f[s][b]``/``g[s][b]``: forward/backward seconds of stage s on a chunk of b samples;
    ``send_f[s][b]``: stage s's activations of b samples to stage s+1 (0 for the last stage);
    ``send_b[s][b]``: stage s's input gradient of b samples to stage s-1 (0 for stage 0);
    ``mem[s][b]``: activation bytes stage s stashes for a chunk of b samples;
    ``static[s]``: its static bytes; ``cap[s]``: what it may hold (inf: no limit);
    ``tail[s]``: seconds stage s still spends after its last action (the cost model's
    per-iteration fixed cost, the optimizer step; ``StageCosts.tail_s``), None: none.
    """

    f: np.ndarray
    g: np.ndarray
    send_f: np.ndarray
    send_b: np.ndarray
    mem: np.ndarray | None = None
    static: np.ndarray | None = None
    cap: np.ndarray | None = None
    tail: np.ndarray | None = None

    @property
    def stages(self) -> int:
        return self.f.shape[0]

    @property
    def batch(self) -> int:
        return self.f.shape[1] - 1

    @classmethod
    def from_functions(cls, p: int, batch: int, f, g, send_f=None, send_b=None) -> Curves:
        """Tables from callables ``f(s, b)`` etc. (tests, synthetic chains); sends default to 0;
        ``send_f`` of the last stage and ``send_b`` of stage 0 are forced to 0."""
        def table(fn, skip: int | None) -> np.ndarray:
            out = np.zeros((p, batch + 1))
            for s in range(p):
                if fn is None or s == skip:
                    continue
                out[s, 1:] = [float(fn(s, b)) for b in range(1, batch + 1)]
            return out
        return cls(table(f, None), table(g, None), table(send_f, p - 1), table(send_b, 0))

    def memory(self, sizes: Sequence[Sequence[int]]) -> list[float]:
        """[stage] bytes held at the peak under GPipe: static plus every chunk's stash."""
        if self.mem is None:
            return [0.0] * self.stages
        static = self.static if self.static is not None else np.zeros(self.stages)
        return [float(static[s] + sum(self.mem[s][b] for b in row)) for s, row in enumerate(sizes)]


def stage_costs(sizes: Sequence[Sequence[int]], curves: Curves) -> StageCosts:
    """The simulator's ragged costs of `sizes` (``passes.simulate``: ``send_backward_s[s]``
    has one entry per chunk of stage s-1), for ``simulate(gpipe_uneven(sizes), ...)``."""
    p = len(sizes)
    static = curves.static if curves.static is not None else np.zeros(p)
    mem = curves.mem if curves.mem is not None else np.zeros_like(curves.f)
    costs = StageCosts(
        [[float(curves.f[s][b]) for b in sizes[s]] for s in range(p)],
        [[float(curves.g[s][b]) for b in sizes[s]] for s in range(p)],
        [[float(curves.send_f[s][b]) for b in sizes[s]] for s in range(p)],
        [[float(curves.send_b[s][b]) for b in sizes[max(s - 1, 0)]] if s > 0 else [0.0] * len(sizes[0])
         for s in range(p)],
        [[float(mem[s][b]) for b in sizes[s]] for s in range(p)],
        [float(x) for x in static])
    if curves.tail is not None and any(curves.tail):
        costs.tail_s = [float(x) for x in curves.tail]
    return costs


def check_sizes(sizes: Sequence[Sequence[int]], batch: int, stages: int) -> None:
    """Raise ValueError unless every stage's list is positive ints summing to ``batch``."""
    if len(sizes) != stages:
        raise ValueError(f"{len(sizes)} size lists for {stages} stages")
    for s, row in enumerate(sizes):
        if not row or any(int(b) != b or b <= 0 for b in row) or sum(row) != batch:
            raise ValueError(f"stage {s} sizes {list(row)} must be positive integers summing to {batch}")


def parse_sizes(text: str) -> list[int]:
    """``"3,5"`` -> [3, 5]; ValueError naming the bad entry."""
    out = []
    for part in text.split(","):
        part = part.strip()
        try:
            out.append(int(part))
        except ValueError:
            raise ValueError(f"expected positive integers like 4,4 or auto or equal, got {text!r}") from None
    return out


# ----------------------------------------------------------------------------- recurrence
@dataclass
class Recurrence:
    """End times of the loop form: ``ef[s][k]``, ``cf[s][k]`` (s < p-1), ``eb[s][l]``, and
    ``cb[s][l]``: when the gradient of stage s's chunk l has arrived (s < p-1; with free
    ``backward_sizes``, the spec's form: when stage s's chunk l's input gradient is sent, s > 0)."""

    ef: list[list[float]]
    cf: list[list[float]]
    eb: list[list[float]]
    cb: list[list[float]]
    T: float


def _producer(prefix_prev: Sequence[int], upto: int) -> int:
    """min{j : prefix_prev[j] >= upto}: the producer chunk holding sample upto-1."""
    for j, edge in enumerate(prefix_prev):
        if edge >= upto:
            return j
    raise ValueError("size lists of neighbouring stages sum to different batches")


def end_times(sizes: Sequence[Sequence[int]], curves: Curves,
              backward_sizes: Sequence[Sequence[int]] | None = None) -> Recurrence:
    """The recurrence of the module docstring, one chunk at a time (the reference form).

    ``backward_sizes`` (default: ``sizes``, tied mode) only exists for the spec's worked
    example; pipecc plans and runs tied sizes.
    """
    bsz = sizes if backward_sizes is None else backward_sizes
    p = len(sizes)
    fp = [np.cumsum(row).tolist() for row in sizes]
    bp = [np.cumsum(row).tolist() for row in bsz]
    ef: list[list[float]] = [[] for _ in range(p)]
    cf: list[list[float]] = [[] for _ in range(p)]
    for s in range(p):
        last_e = last_c = 0.0
        for k, b in enumerate(sizes[s]):
            arrive = 0.0 if s == 0 else cf[s - 1][_producer(fp[s - 1], fp[s][k])]
            last_e = float(max(last_e, arrive) + curves.f[s][b])
            ef[s].append(last_e)
            if s < p - 1:
                last_c = float(max(last_c, last_e) + curves.send_f[s][b])
                cf[s].append(last_c)
    eb: list[list[float]] = [[] for _ in range(p)]
    cb: list[list[float]] = [[] for _ in range(p)]
    if backward_sizes is None:  # tied: gradient messages carry upstream chunks (docstring)
        for s in reversed(range(p)):
            ready = ef[s][-1]
            last_e = last_c = 0.0
            for l, b in enumerate(sizes[s]):
                if s == p - 1:
                    need = ef[s][l]
                else:
                    done = eb[s + 1][_producer(fp[s + 1], fp[s][l])]
                    last_c = float(max(last_c, done) + curves.send_b[s + 1][b])
                    cb[s].append(last_c)
                    need = last_c
                last_e = float(max(last_e, ready, need) + curves.g[s][b])
                eb[s].append(last_e)
        return Recurrence(ef, cf, eb, cb, _with_tail(eb, cb, curves.tail))
    for s in reversed(range(p)):
        ready = ef[s][-1]
        last_e = last_c = 0.0
        for l, b in enumerate(bsz[s]):
            if s == p - 1:
                need = ef[s][_producer(fp[s], bp[s][l])]
            else:
                need = cb[s + 1][_producer(bp[s + 1], bp[s][l])]
            last_e = float(max(last_e, ready, need) + curves.g[s][b])
            eb[s].append(last_e)
            if s > 0:
                last_c = float(max(last_c, last_e) + curves.send_b[s][b])
                cb[s].append(last_c)
    return Recurrence(ef, cf, eb, cb, max(row[-1] for row in eb))


def _with_tail(eb: list[list[float]], cb: list[list[float]], tail: np.ndarray | None) -> float:
    """T: the last backward's end, or with tails, max over stages of the stage's end (its last
    backward, or its last gradient message to stage s-1, which ends at cb[s-1][-1]) + tail."""
    if tail is None:
        return max(row[-1] for row in eb)
    ends = [max([eb[s][-1]] + ([cb[s - 1][-1]] if s > 0 and cb[s - 1] else [])) for s in range(len(eb))]
    return max(e + float(t) for e, t in zip(ends, tail))


def _scan(ready: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """x_j = max(x_{j-1}, ready_j) + cost_j (x_{-1} = 0) along the last axis, as
    C_j + cummax(ready_j - C_{j-1}); ready >= 0."""
    c = np.cumsum(cost, axis=-1)
    shifted = np.concatenate([np.zeros_like(c[..., :1]), c[..., :-1]], axis=-1)
    return c + np.maximum.accumulate(np.maximum(ready - shifted, 0.0), axis=-1)


def _pad(population: Sequence[Sequence[Sequence[int]]], p: int) -> np.ndarray:
    """[individual][stage][chunk] sizes, zero-padded to the longest list."""
    k_max = max(len(row) for ind in population for row in ind)
    out = np.zeros((len(population), p, k_max), dtype=np.int64)
    for i, ind in enumerate(population):
        for s, row in enumerate(ind):
            out[i, s, :len(row)] = row
    return out


def _gather_producer(prefix_prev: np.ndarray, prefix: np.ndarray, values: np.ndarray) -> np.ndarray:
    """values[i, π(i, k)] with π(i, k) = min{j : prefix_prev[i, j] >= prefix[i, k]}."""
    idx = (prefix_prev[:, None, :] < prefix[:, :, None]).sum(axis=2)
    idx = np.minimum(idx, prefix_prev.shape[1] - 1)
    return np.take_along_axis(values, idx, axis=1)


def population_times(sizes: np.ndarray | Sequence[Sequence[Sequence[int]]], curves: Curves) -> np.ndarray:
    """T of every individual of a population ([individual][stage][chunk] sizes, tied mode,
    ragged lists allowed): the recurrence with one cummax per stage and pass (TiDGAP's two
    levels: individuals and chunks at once)."""
    arr = np.asarray(sizes) if isinstance(sizes, np.ndarray) else _pad(sizes, curves.stages)
    _, p, _ = arr.shape
    prefix = np.cumsum(arr, axis=2)
    ef, cf = [None] * p, [None] * p
    for s in range(p):
        ready = np.zeros(arr[:, s].shape) if s == 0 else _gather_producer(prefix[:, s - 1], prefix[:, s], cf[s - 1])
        ef[s] = _scan(ready, curves.f[s][arr[:, s]])
        if s < p - 1:
            cf[s] = _scan(ef[s], curves.send_f[s][arr[:, s]])
    total = np.zeros(arr.shape[0])
    tail = curves.tail if curves.tail is not None else np.zeros(p)
    eb_next = None
    end_next = np.zeros(arr.shape[0])  # stage s+1's end: its last backward or gradient message
    for s in reversed(range(p)):
        if s == p - 1:
            need = ef[s]  # tied: backward chunk l needs forward chunk l
        else:  # the gradient of chunk l arrives after stage s+1's chunk κ(s,l) and the link
            done = _gather_producer(prefix[:, s + 1], prefix[:, s], eb_next)
            need = _scan(done, curves.send_b[s + 1][arr[:, s]])
            end_next = np.maximum(end_next, need[:, -1])
            total = np.maximum(total, end_next + tail[s + 1])
        eb_next = _scan(np.maximum(need, ef[s][:, -1:]), curves.g[s][arr[:, s]])
        end_next = eb_next[:, -1]
    return np.maximum(total, end_next + tail[0])


# ----------------------------------------------------------------------------- search
class GPipePricing:
    """What a split costs under GPipe row order: the recurrence (``population_times``) and
    every chunk stashed at once (``Curves.memory``). The search's default."""

    def __init__(self, curves: Curves) -> None:
        self.curves = curves

    def times(self, population: Sequence[Sequence[Sequence[int]]]) -> np.ndarray:
        return population_times(population, self.curves)

    def memory(self, sizes: Sequence[Sequence[int]]) -> list[float]:
        return self.curves.memory(sizes)


class SimulatedPricing:
    """What a split costs under another row order with no recurrence (1F1B, PAPERS-SPEC.md
    §1.3: "generate the action rows and run the event simulator"): ``passes.simulate`` over
    ``schedule_for(schedule, ..., microbatch_sizes=sizes)``, whose peak memory counts the
    samples each stage holds in flight (§1.4). Each split is simulated once (a cache)."""

    def __init__(self, curves: Curves, schedule: str) -> None:
        self.curves, self.schedule = curves, schedule
        self._seen: dict[tuple[tuple[int, ...], ...], tuple[float, list[float]]] = {}

    def _run(self, sizes: Sequence[Sequence[int]]) -> tuple[float, list[float]]:
        key = tuple(tuple(int(b) for b in row) for row in sizes)
        if key not in self._seen:
            timeline = simulate(schedule_for(self.schedule, len(key), max(len(r) for r in key),
                                             microbatch_sizes=key), stage_costs(key, self.curves))
            self._seen[key] = (float(timeline.iteration_s), [float(x) for x in timeline.peak_memory_bytes])
        return self._seen[key]

    def times(self, population: Sequence[Sequence[Sequence[int]]]) -> np.ndarray:
        return np.array([self._run(ind)[0] for ind in population])

    def memory(self, sizes: Sequence[Sequence[int]]) -> list[float]:
        return self._run(sizes)[1] if self.curves.mem is not None else [0.0] * self.curves.stages


def equal_splits(batch: int, most: int | None = None) -> list[list[int]]:
    """The EDP records: [B/m] * m for every m dividing B (m <= most)."""
    return [[batch // m] * m for m in range(1, batch + 1)
            if batch % m == 0 and (most is None or m <= most)]


def _uniform(batch: int, b: int) -> list[int]:
    """[b, b, ..., remainder]."""
    return [b] * (batch // b) + ([batch % b] if batch % b else [])


def _fitness(population: list[list[list[int]]], curves: Curves, penalty: float,
             price: GPipePricing | SimulatedPricing) -> np.ndarray:
    t = price.times(population)
    if curves.cap is None or curves.mem is None:
        return t
    over = np.array([sum(max(0.0, m - c) / c for m, c in zip(price.memory(ind), curves.cap)
                         if math.isfinite(c) and c > 0) for ind in population])
    return t + penalty * over


def local_greedy(curves: Curves) -> list[list[int]]:
    """Each stage alone takes b* = argmin_b (f_s(b) + g_s(b)) / b (ties: the smaller b)
    and splits [b*, ..., b*, remainder] (spec §1.5)."""
    B = curves.batch
    out = []
    for s in range(curves.stages):
        per = [(curves.f[s][b] + curves.g[s][b]) / b for b in range(1, B + 1)]
        out.append(_uniform(B, 1 + int(np.argmin(per))))
    return out


def greedy_dp(curves: Curves, candidates: Sequence[int] | None = None, beam: int = 8,
              price: GPipePricing | SimulatedPricing | None = None) -> list[list[int]]:
    """Global greedy-based DP (spec §1.5): every stage a uniform size from `candidates`;
    stages visited 0..p-1, each choice scored by T with later stages given the same size;
    the best `beam` prefixes kept."""
    B, p = curves.batch, curves.stages
    sizes = sorted(set(candidates or range(1, B + 1)))
    prefixes: list[list[int]] = [[]]
    for s in range(p):
        options = [pre + [b] for pre in prefixes for b in sizes]
        pop = [[_uniform(B, x) for x in opt] + [_uniform(B, opt[-1])] * (p - s - 1) for opt in options]
        scores = (price or GPipePricing(curves)).times(pop)
        order = np.argsort(scores, kind="stable")[:beam]
        prefixes = [options[i] for i in order]
    return [_uniform(B, b) for b in prefixes[0]]


@dataclass
class SearchResult:
    """The GA's best split and what it was compared with (seconds per iteration)."""

    sizes: list[list[int]]
    T: float
    edp_sizes: list[int]              # the best equal split (same for every stage)
    edp_T: float
    baselines: dict[str, tuple[list[list[int]], float]] = field(default_factory=dict)
    generations: int = 0
    seconds: float = 0.0
    stopped: str = ""                 # "converged", "generations" or "budget"
    fits: bool = True                 # every stage within its memory cap

    @property
    def unequal(self) -> bool:
        return any(list(row) != list(self.sizes[0]) for row in self.sizes) or \
            len(set(self.sizes[0])) > 1

    @property
    def gain(self) -> float:
        """edp_T / T - 1."""
        return self.edp_T / self.T - 1 if self.T > 0 else 0.0


def _cuts(sizes: Sequence[int]) -> list[int]:
    return [int(c) for c in np.cumsum(sizes)[:-1]]


def _sizes(cuts: Sequence[int], batch: int) -> list[int]:
    edges = [0] + sorted(cuts) + [batch]
    return [int(b - a) for a, b in zip(edges, edges[1:])]


class _Ops:
    """The GA's variation operators on cut sets (spec §1.5); every result is a valid split."""

    def __init__(self, batch: int, q: int, k_max: int, rng: np.random.Generator) -> None:
        self.B, self.q, self.k_max, self.rng = batch, q, k_max, rng

    def random_gene(self) -> list[int]:
        grid = list(range(self.q, self.B, self.q))
        k = int(self.rng.integers(1, min(self.k_max, len(grid) + 1) + 1))
        return sorted(int(c) for c in self.rng.choice(grid, size=k - 1, replace=False)) if k > 1 else []

    def mutate(self, genes: list[list[int]], s: int) -> None:
        cuts = list(genes[s])
        op = int(self.rng.integers(4))
        if op == 0 and cuts:                      # move one cut by ±q
            i = int(self.rng.integers(len(cuts)))
            cuts[i] += self.q if self.rng.random() < 0.5 else -self.q
        elif op == 1 and len(cuts) + 1 < self.k_max:  # split a chunk in two
            edges = [0] + cuts + [self.B]
            i = int(self.rng.integers(len(edges) - 1))
            if edges[i + 1] - edges[i] >= 2:
                cuts.append(int(self.rng.integers(edges[i] + 1, edges[i + 1])))
        elif op == 2 and cuts:                    # merge two adjacent chunks
            cuts.pop(int(self.rng.integers(len(cuts))))
        elif op == 3 and len(genes) > 1:          # copy the neighbouring stage's gene
            n = s - 1 if s > 0 and (s == len(genes) - 1 or self.rng.random() < 0.5) else s + 1
            cuts = list(genes[n])
        genes[s] = sorted({c for c in cuts if 0 < c < self.B})

    def crossover(self, a: list[list[int]], b: list[list[int]]) -> list[list[int]]:
        p = len(a)
        if self.rng.random() < 0.5:               # stage-wise uniform
            return [list(a[s] if self.rng.random() < 0.5 else b[s]) for s in range(p)]
        point = int(self.rng.integers(p + 1))     # one point over the stage index
        return [list(x) for x in a[:point] + b[point:]]


def search(curves: Curves, *, quantum: int | None = None, population: int = 64,
           generations: int = 300, patience: int = 40, budget_s: float = 10.0,
           seed: int = 0, most_chunks: int | None = None,
           price: GPipePricing | SimulatedPricing | None = None) -> SearchResult:
    """TiDGAP-style GA (tied mode: one chromosome, a cut set per stage) over `curves`.

    The initial population holds every equal split (EDP) with at most `most_chunks` chunks,
    the local-greedy and greedy-DP solutions, then random splits; the best 2 survive each
    generation unchanged, so the result is never worse than the best equal split. Tournament of
    3, crossover 0.9, mutation 1/p per gene. Stops after `generations`, `patience` generations
    without a relative improvement of 1e-6, or `budget_s` seconds. A fixed `seed`: the same
    input gives the same answer, unless the wall-clock budget stops it (then a slower or busier
    machine may stop a few generations earlier). `price` (default ``GPipePricing``): what a
    split costs, in seconds and bytes per stage (``SimulatedPricing`` for 1F1B).
    """
    start = time.perf_counter()
    price = price or GPipePricing(curves)
    B, p = curves.batch, curves.stages
    q = quantum or max(1, B // 64)
    k_max = max(64, len(equal_splits(B, most_chunks)[-1]))
    rng = np.random.default_rng(seed)
    ops = _Ops(B, q, k_max, rng)

    edps = equal_splits(B, most_chunks)
    edp_pop = [[list(e)] * p for e in edps]
    edp_t = price.times(edp_pop)
    penalty = 10.0 * float(edp_t.min())  # λ of spec §1.5: overflowing splits lose to any fitting one
    edp_fit = _fitness(edp_pop, curves, penalty, price)
    best_edp = int(np.argmin(edp_fit))

    greedy = local_greedy(curves)
    dp = greedy_dp(curves, candidates=sorted({b for e in edps for b in e} | set(range(q, B + 1, q))), price=price)
    seeds = [[_cuts(r) for r in ind] for ind in edp_pop + [greedy, dp]]
    pop = seeds[:population] if len(seeds) >= population else seeds
    while len(pop) < population:
        pop.append([ops.random_gene() for _ in range(p)])
    # NOTE: every EDP record is scored even when the population cannot hold them all
    fit = _fitness([[_sizes(g, B) for g in ind] for ind in pop], curves, penalty, price)
    best_i = int(np.argmin(fit))
    best, best_fit = pop[best_i], float(fit[best_i])
    if float(edp_fit[best_edp]) < best_fit:
        best, best_fit = seeds[best_edp], float(edp_fit[best_edp])
    stale, gen, stopped = 0, 0, "generations"
    while gen < generations:
        if time.perf_counter() - start > budget_s:
            stopped = "budget"
            break
        gen += 1
        elite = [pop[i] for i in np.argsort(fit, kind="stable")[:2]]
        children = [list(map(list, e)) for e in elite]
        while len(children) < population:
            a, b = (pop[min(rng.integers(len(pop), size=3), key=lambda i: fit[i])] for _ in range(2))
            child = ops.crossover(a, b) if rng.random() < 0.9 else [list(x) for x in a]
            for s in range(p):
                if rng.random() < 1.0 / p:
                    ops.mutate(child, s)
            children.append(child)
        pop = children
        fit = _fitness([[_sizes(g, B) for g in ind] for ind in pop], curves, penalty, price)
        i = int(np.argmin(fit))
        if fit[i] < best_fit * (1 - 1e-6):
            best, best_fit, stale = pop[i], float(fit[i]), 0
        else:
            stale += 1
            if stale >= patience:
                stopped = "converged"
                break
    sizes = [_sizes(g, B) for g in best]
    result = SearchResult(sizes, float(price.times([sizes])[0]), list(edps[best_edp]),
                          float(edp_t[best_edp]), generations=gen,
                          seconds=time.perf_counter() - start, stopped=stopped)
    for name, ind in (("local-greedy", greedy), ("greedy-dp", dp)):
        result.baselines[name] = (ind, float(price.times([ind])[0]))
    result.fits = curves.cap is None or all(
        m <= c for m, c in zip(price.memory(sizes), curves.cap))
    return result


def all_devices(options: Any) -> bool:
    """The planner's hook on `fewer devices` (`passes.device_count.applies`): explicit
    per-stage micro-batch sizes (`--microbatch-sizes S1,S2,...`) ask for a pipeline over the
    devices as given."""
    return options.microbatch_sizes not in ("equal", "auto", "off")
