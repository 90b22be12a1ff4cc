"""The optimizer step's working memory: bytes a rank's optimizer step holds for a moment on top
of the parameters, gradients and optimizer state (`StageMemory.static`), after the iteration's
last backward, when no activation is stashed any more. The simulator's peak of a rank is its
static bytes plus the larger of its most stashed activation bytes and this
(`StageCosts.step_bytes`).

torch.optim.Adam and AdamW, the optimizer the planner's two states per weight stand for
(`PlanOptions.optimizer_states` = 2), update in one of two ways (torch/optim/adam.py):

* single-tensor (`_single_tensor_adam`; the default for CPU tensors, foreach is the default only
  on CUDA): per parameter ``denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)``, two
  temporaries the size of that parameter alive together for a moment: **2 x the rank's largest
  parameter tensor**. Measured by bench/bench_memory.py: the MLP (hidden 512) peaks in its
  optimizer step at static + 2.10 MB = 2 x its 512 x 512 float32 weight (bench/RESULTS.md);
* foreach (`_multi_tensor_adam`; the default on CUDA): ``torch._foreach_sqrt(exp_avg_sqs)``, one
  temporary for every parameter at once, then updated in place: **1 x the rank's parameter
  bytes** (not yet measured on a GPU here: `pipecc run --json --memory` reports the CUDA
  allocator's peak to check it with).

SGD (no state) and momentum SGD (one) update in place: nothing. FPGA stages never train.
"""

from __future__ import annotations

__all__ = ["step_bytes"]


def step_bytes(kind: str, largest_param: float, param_bytes: float, optimizer_states: int) -> float:
    """Bytes the optimizer step of one rank holds beyond its static bytes (module docstring);
    `kind` is the rank's device kind ("cpu", "gpu", "fpga"), `largest_param` the bytes of its
    largest parameter tensor, `param_bytes` those of all its parameters."""
    if optimizer_states < 2 or kind == "fpga":
        return 0.0
    return float(param_bytes) if kind == "gpu" else 2.0 * float(largest_param)
