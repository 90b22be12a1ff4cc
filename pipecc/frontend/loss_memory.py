"""What the model file's loss keeps for the backward, per sample: memory the graph never shows.

The last stage computes `loss_fn(outputs, target)` after the captured graph, and keeps the loss
until its backward; autograd keeps what the loss's backward needs with it (cross-entropy: the
log-softmax of the logits, as large as the logits: GPT's vocabulary-wide rows). The capture sees
only the model, so this is measured here once: the model and `loss_fn` run on fake tensors
(shapes, no memory) at the example batch, and the distinct storages handed to
`torch.autograd.graph.saved_tensors_hooks` during `loss_fn` are counted, the target's left out
(the runtime holds the step's targets anyway). The planner charges bytes / batch per sample of a
micro-batch to the last unit's stash (`passes.units`), so partitioner, simulator and plan.json
all see it.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable

import torch

LOSS_STASH_META = "pipecc.loss_stash_per_sample"  # graph.gm.meta key: bytes per sample (float)


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def loss_stash_per_sample(model: torch.nn.Module, inputs: tuple, batch: int, loss_fn: Callable | None,
                          make_target: Callable[[int], Any] | None) -> float:
    """Bytes the loss keeps for its backward per sample (module docstring); 0.0 without a loss
    or where fake tensors cannot run the model or the loss (the check that runs first reports
    a loss that fails for real)."""
    if not callable(loss_fn) or make_target is None or batch < 1:
        return 0.0
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pipecc.frontend.model_state import fake_weights, preserved_state
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        target = make_target(batch)
        fake_inputs = tuple(mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in inputs)
        fake_target = torch.utils._pytree.tree_map(
            lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, target)
    except Exception:  # NOTE: check_loss has run and reported a target that fails
        return 0.0
    left_out = {t.untyped_storage()._cdata for t in _tensors(fake_target)}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st._cdata not in left_out:
            kept.setdefault(st._cdata, int(st.nbytes()))
        return t
    with preserved_state(model), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with fake_weights(model, mode), mode, torch.enable_grad():
                outputs = model(*fake_inputs)
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    loss_fn(outputs, fake_target)
        except Exception:
            return 0.0
    return sum(kept.values()) / batch


__all__ = ["LOSS_STASH_META", "loss_stash_per_sample"]
