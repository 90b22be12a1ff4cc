"""How a batch splits over replicas, in the launcher's words: ``replica_problem`` (torch-free, so
`pipecc run` checks a folder before any process starts; `pipecc.techniques.replicas.runtime`,
the replicas' runtime part, re-exports it)."""

from __future__ import annotations

__all__ = ["replica_problem"]


def replica_problem(batch: int, microbatches: int, replicas: int) -> str | None:
    """Why a batch of ``batch`` rows cannot run as ``microbatches`` micro-batches over
    ``replicas`` replicas (None when it can: equal micro-batches of at least ``replicas`` rows)."""
    if replicas <= 1 or not batch:
        return None
    if batch % microbatches == 0 and batch // microbatches >= replicas:
        return None
    fits = [k for k in range(1, batch // replicas + 1) if batch % k == 0]
    use = f"use --microbatches {', '.join(map(str, fits[:8]))}" + (" ..." if len(fits) > 8 else "")
    if batch % microbatches:
        return (f"with {replicas} replicas per stage the batch of {batch} must split into {microbatches} equal "
                f"micro-batches; {use}")
    mb = batch // microbatches
    return (f"{replicas} replicas leave a replica without rows: a micro-batch of {mb} splits over at most {mb} "
            f"replica{'s' if mb > 1 else ''}; {use}")
