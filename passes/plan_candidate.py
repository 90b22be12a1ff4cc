"""`Candidate`: one evaluated plan of the search, before it is written as a `Plan`.

Its own module because every technique pass reads candidates while the evaluator that makes
them (`passes.plan_evaluate`) imports some of those passes (`techniques.replicas.search`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipecc.passes.partition import Partition, PartitionProblem
from pipecc.passes.simulate import Timeline
from pipecc.passes.units import Units

__all__ = ["Candidate"]


@dataclass
class Candidate:
    """One evaluated plan before it is written: its cuts, problem and simulated timeline."""

    schedule: str
    microbatches: int
    order: tuple[int, ...]
    part: Partition
    problem: PartitionProblem
    units: Units
    timeline: Timeline
    virtual: int = 1
    notes: list[str] = field(default_factory=list)
    raw: PartitionProblem | None = None   # before stages were re-costed (for baselines)
    recompute: tuple[bool, ...] = ()      # [stage] recomputes its activations; (): none does
    replicas: int = 1                     # d: every stage on a group of d devices
    allreduce: list[float] = field(default_factory=list)  # [stage] group all-reduce seconds
    thresholds: tuple[int | None, ...] = ()  # BPipe: [stage] evictor threshold K or None; (): none

    @property
    def ranks(self) -> int:
        """Pipeline ranks P (replica groups)."""
        return len(self.order) // self.replicas
