"""The kinds of loss reduction (``LossReduction``: "mean", "sum", "mixed") and the one-line
refusals of a split batch, without torch: ``pipecc run``'s launcher checks a folder with them
before any process starts; the analysis that finds a ``loss_fn``'s kind is
``pipecc.runtime.loss_reduction`` (which re-exports these names).

Imports ``pipecc.errors`` only."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipecc.errors import PipeccError

__all__ = ["KINDS", "MEAN", "MEAN_LOSS", "MIXED", "SUM", "LossReduction", "check_run", "check_split", "split_words"]

MEAN, SUM, MIXED = "mean", "sum", "mixed"
KINDS = (MEAN, SUM, MIXED)


@dataclass(frozen=True)
class LossReduction:
    """``kind``: "mean", "sum" or "mixed"; ``why``: for "mixed", what was found (one phrase)."""
    kind: str
    why: str = ""

    def to_json(self) -> dict[str, str]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> LossReduction:
        """The marker's ``loss_reduction``; absent (a folder compiled before it): "mean", what
        the runtime always did."""
        if isinstance(data, dict) and data.get("kind") in KINDS:
            return cls(str(data["kind"]), str(data.get("why") or ""))
        return cls(MEAN)

    def message(self, split: str, file: str = "the model file") -> str:
        """The one line refusing a run that splits the batch (``split``: "4 micro-batches", ...)."""
        return (f"loss_fn in {file} is neither a mean nor a sum over the samples ({self.why}), so the "
                f"losses of {split} do not combine into the batch's loss; give --microbatches 1 --replicas 1, "
                "or reduce it with .mean() or .sum() over the samples")


MEAN_LOSS = LossReduction(MEAN)


def split_words(microbatches: int, replicas: int = 1) -> str:
    """How a run splits the batch, in words ("2 micro-batches and 2 replicas"); "" when it does not."""
    parts = [f"{microbatches} micro-batches"] if microbatches > 1 else []
    parts += [f"{replicas} replicas"] if replicas > 1 else []
    return " and ".join(parts)


def check_split(reduction: LossReduction | None, microbatches: int, replicas: int, file: str) -> None:
    """Refuse (one line) a training plan that splits the batch when ``loss_fn`` mixes samples
    (``reduction`` as the analysis found it; None: no loss_fn analysed)."""
    split = split_words(microbatches, replicas)
    if reduction is not None and reduction.kind == MIXED and split:
        raise PipeccError(reduction.message(split, file))


def check_run(marker: dict[str, Any], microbatches: int, replicas: int) -> None:
    """A run of a compiled folder (``pipecc.json``) that would split the batch of a model whose
    loss_fn mixes samples: refused in one line (before any process starts)."""
    reduction = LossReduction.from_json(marker.get("loss_reduction"))
    split = split_words(microbatches, replicas)
    if reduction.kind == MIXED and split:
        raise PipeccError(reduction.message(split, Path(str(marker.get("model_path") or "the model file")).name))
