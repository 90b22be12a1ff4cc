"""UMPIPE's side data in the plan (`pipecc.ir.plan_data`): its search's record and the per-chunk
costs of its prediction, written by its planner step (`pipecc.techniques.umpipe.plan.apply`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from pipecc.ir.plan_data import json_object

__all__ = ["UmpipeChunkCosts", "UmpipeSearch"]


@dataclass(frozen=True)
class UmpipeSearch:
    """UMPIPE's search under ``--microbatch-sizes auto``: the GA's ``generations``, ``seconds``
    and why it ``stopped``, the best equal split's predicted ``edp_s`` and its ``edp_sizes``, and
    per baseline ("local-greedy", "greedy-dp") its ``{"sizes", "iteration_s"}``.
    plan.json: ``options["umpipe"]``."""

    KEY: ClassVar[str] = "umpipe"
    generations: int
    seconds: float
    stopped: str
    edp_s: float
    edp_sizes: list[int]
    baselines: dict[str, dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls, raw: Any) -> "UmpipeSearch":
        return cls(**json_object(raw, cls))


@dataclass(frozen=True)
class UmpipeChunkCosts:
    """The per-chunk seconds and bytes UMPIPE's prediction used (``StageCosts``'s fields,
    ``x[stage][chunk]``; reports rebuild the timeline from them: `pipecc.report.artifacts`),
    and the micro-batch the stage table's figures are at (``stage_figures_microbatch``: the
    planner's equal one). ``tail_s`` is None without tails; ``has_tail`` False in a plan written
    before the one cost model (its plan.json has no ``tail_s``).
    plan.json: ``options["umpipe_chunk_costs"]``."""

    KEY: ClassVar[str] = "umpipe_chunk_costs"
    stage_figures_microbatch: int
    forward_s: list[list[float]]
    backward_s: list[list[float]]
    send_forward_s: list[list[float]]
    send_backward_s: list[list[float]]
    activation_bytes: list[list[float]]
    static_bytes: list[float]
    tail_s: list[float] | None = None
    has_tail: bool = True

    def costs(self) -> dict[str, Any]:
        """The simulator's `StageCosts` fields (``tail_s`` only where the plan saved one)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("stage_figures_microbatch", "has_tail")}
        if not self.has_tail:
            del out["tail_s"]
        return out

    def to_json(self) -> dict[str, Any]:
        return {"stage_figures_microbatch": self.stage_figures_microbatch, **self.costs()}

    @classmethod
    def from_json(cls, raw: Any) -> "UmpipeChunkCosts":
        fields = dict(json_object(raw, cls))
        if "has_tail" in fields:
            raise TypeError("has_tail is not a plan.json key")
        return cls(**fields, has_tail="tail_s" in fields)
