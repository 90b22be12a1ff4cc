"""Bi-Partition's side data in the plan (`pipecc.ir.plan_data`): its search's record and the
timeline's seconds, written by its planner step (`pipecc.techniques.bipartition.plan.apply`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from pipecc.ir.plan_data import json_object

__all__ = ["BipartitionCosts", "BipartitionSearch"]


@dataclass(frozen=True)
class BipartitionSearch:
    """What the Bi-Partition search weighed, used or not: its window (units each cut may move)
    and mode, the single cut's simulated iteration and bottleneck, the best recomputing cut
    pair's (None: none fits) and the best shipping bottleneck; with `used`, the cut pair kept
    (`fwd_bounds`/`bwd_bounds` in unit counts, 0 .. n), its iteration and bottleneck, and per
    boundary its segment's stash and replica-refresh bytes. plan.json's `options["bipartition"]`."""

    KEY: ClassVar[str] = "bipartition"
    used: bool
    window: int
    mode: str
    single_iteration_s: float
    single_bottleneck_s: float
    recompute_bottleneck_s: float | None
    recompute_iteration_s: float
    best_ship_bottleneck_s: float
    fwd_bounds: tuple[int, ...] | None = None
    bwd_bounds: tuple[int, ...] | None = None
    iteration_s: float | None = None
    bottleneck_s: float | None = None
    stash_bytes: tuple[float, ...] | None = None
    weight_sync_bytes: tuple[float, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        """The JSON object: every weighed figure, then the kept cut pair's when there is one."""
        out = {k: getattr(self, k) for k in _SEARCH_KEYS}
        for k in _CUT_KEYS:
            value = getattr(self, k)
            if value is not None:
                out[k] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_json(cls, raw: Any) -> "BipartitionSearch":
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in json_object(raw, cls).items()})


@dataclass(frozen=True)
class BipartitionCosts:
    """A Bi-Partition plan's per-stage seconds the report's timeline needs and the stage figures
    cannot tell apart (`comm_s` sums both directions): the forward and backward message send
    times and each worker's tail after its last action (optimizer step, replica refresh).
    plan.json's `options["bipartition_costs"]`."""

    KEY: ClassVar[str] = "bipartition_costs"
    send_forward_s: tuple[float, ...]
    send_backward_s: tuple[float, ...]
    tail_s: tuple[float, ...]

    def to_json(self) -> dict[str, Any]:
        return {"send_forward_s": list(self.send_forward_s), "send_backward_s": list(self.send_backward_s),
                "tail_s": list(self.tail_s)}

    @classmethod
    def from_json(cls, raw: Any) -> "BipartitionCosts":
        return cls(**{k: tuple(v) for k, v in json_object(raw, cls).items()})


_SEARCH_KEYS = ("used", "window", "mode", "single_iteration_s", "single_bottleneck_s", "recompute_bottleneck_s",
                "recompute_iteration_s", "best_ship_bottleneck_s")
_CUT_KEYS = ("fwd_bounds", "bwd_bounds", "iteration_s", "bottleneck_s", "stash_bytes", "weight_sync_bytes")
