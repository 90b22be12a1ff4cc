"""pipecc.distributed: a compiled folder driven from a training script, one process per rank.

    pipe = pipecc.distributed.load("out")
    loss = pipe.step(x, target=y)

The object and its conventions: ``pipecc.runtime.distributed`` (``DistributedPipeline``).
"""

from pipecc.runtime.distributed import DistributedPipeline, load

__all__ = ["DistributedPipeline", "load"]
