"""The precisions a plan and a run may use (no torch here: the command line checks them before
importing it). ``fp32`` is plain float32; ``bf16`` and ``fp16`` run every stage's forward and
loss under ``torch.autocast`` in that dtype (`pipecc.runtime.engine`), and the cost model counts
their bytes as `pipecc.cost_precision` says."""

PRECISIONS = ("fp32", "bf16", "fp16")
MIXED = PRECISIONS[1:]  # the autocast dtypes

__all__ = ["MIXED", "PRECISIONS"]
