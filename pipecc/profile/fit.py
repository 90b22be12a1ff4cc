"""Fitting measured times to a cost curve: t(x) = a + c*x with a >= 0 and c >= 0.

Used for both measurements of `pipecc profile`:
  * a node's time against the micro-batch size b: `a` is the per-call overhead (Python
    dispatch, kernel launch, a weight read that does not grow with b), `c` the time per
    sample. The curve is affine, not proportional: at small b the overhead dominates, so a
    planner that scaled the full-batch time linearly down would badly underestimate small
    micro-batches;
  * a link's time against the message size n: `a` is the latency, `c` is 1/bandwidth.

The fit minimises the squared *relative* residuals, sum(((a + c*x_i) - t_i) / t_i)^2: the
samples span orders of magnitude (4 B .. 16 MiB messages; b = 1 .. 64), and absolute least
squares would fit the largest sample and ignore the overhead the small ones measure.

Non-negativity (an overhead or a slope below zero means noise, not physics) is solved
exactly: with two unknowns the constrained optimum is the unconstrained one when that is
feasible, else it lies on the boundary a = 0 or c = 0, each a one-unknown problem. The
candidate with the smallest residual wins (`_candidates` lists them; ties keep the first).

Pure Python, no torch: tested against hand-made curves and brute force.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

__all__ = ["AffineFit", "fit_affine"]

# a sample below this fraction of the largest is weighted as if it were this large
# (a zero time, e.g. a node without backward mixed with real samples, must not get weight 1/0)
_FLOOR = 1e-9


@dataclass(frozen=True)
class AffineFit:
    """t(x) = a + c*x. `error` is the largest relative residual |t(x_i) - t_i| / t_i."""

    a: float
    c: float
    error: float

    def __call__(self, x: float) -> float:
        return self.a + self.c * x

    def to_json(self) -> dict[str, float]:
        return {"a": self.a, "c": self.c, "error": self.error}


def fit_affine(xs: Sequence[float], ts: Sequence[float]) -> AffineFit:
    """The non-negative affine curve closest to (xs, ts) in relative error.

    Preconditions: as many xs as ts, at least one sample, xs > 0, ts >= 0. All-zero ts give
    a = c = 0. A single distinct x cannot separate overhead from slope: the fit is then
    proportional (a = 0), the choice that extrapolates to larger x without a fixed cost.
    """
    if len(xs) != len(ts) or not xs:
        raise ValueError(f"fit_affine needs as many xs as ts and at least one: {len(xs)}, {len(ts)}")
    if min(xs) <= 0 or min(ts) < 0:
        raise ValueError("fit_affine needs xs > 0 and ts >= 0")
    top = max(ts)
    if top == 0:
        return AffineFit(0.0, 0.0, 0.0)
    floor = top * _FLOOR
    ws = [1.0 / max(t, floor) ** 2 for t in ts]
    best: tuple[float, float] | None = None
    best_sse = math.inf
    for a, c in _candidates(xs, ts, ws):
        sse = sum(w * (a + c * x - t) ** 2 for x, t, w in zip(xs, ts, ws))
        if sse < best_sse * (1 - 1e-12) or best is None:
            best, best_sse = (a, c), sse
    assert best is not None
    a, c = best
    error = max(abs(a + c * x - t) / max(t, floor) for x, t in zip(xs, ts))
    return AffineFit(a, c, error)


def _candidates(xs: Sequence[float], ts: Sequence[float], ws: Sequence[float]) -> list[tuple[float, float]]:
    """Feasible stationary points: unconstrained (if a, c >= 0), then a = 0, then c = 0
    (weighted normal equations of the 2x2 problem and of its two 1x1 boundary problems)."""
    sw = sum(ws)
    swx = sum(w * x for w, x in zip(ws, xs))
    swxx = sum(w * x * x for w, x in zip(ws, xs))
    swt = sum(w * t for w, t in zip(ws, ts))
    swxt = sum(w * x * t for w, x, t in zip(ws, xs, ts))
    proportional = (0.0, max(swxt / swxx, 0.0))
    det = sw * swxx - swx * swx
    # NOTE: det is ~0 (relative to its terms) when all xs are equal: overhead and slope are
    # then indistinguishable, and the proportional fit is the one answer
    if det <= 1e-12 * sw * swxx:
        return [proportional]
    out: list[tuple[float, float]] = []
    a = (swxx * swt - swx * swxt) / det
    c = (sw * swxt - swx * swt) / det
    if a >= 0 and c >= 0:
        out.append((a, c))
    out.append(proportional)
    out.append((max(swt / sw, 0.0), 0.0))
    return out
