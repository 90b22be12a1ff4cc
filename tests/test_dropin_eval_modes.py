"""The drop-in module in the model's mode (issue 30's two silent wrong answers).

- A model already in eval() when compiled gives an eval-mode module: every stage runs in eval
  mode, a stage wrapped in `ClonesInputs` (it writes a received input in place) included, so
  eval outputs equal the model's (before, the wrapped stage ran its dropout).
- A split layer (passes.split_search clones the graph) keeps what the graph module records about
  itself: a model captured in one mode only keeps its guard, so running it in the other mode is
  an error, not the captured mode's outputs.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pipecc
from pipecc import driver


class CutBeforeWrite(nn.Module):
    """Stage 1 starts with `relu_` on what it receives, then a functional dropout that follows
    the module's flag (stage.py: `training=self.training`)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = self.a(x).relu_()
        return self.c(self.b(F.dropout(h, 0.5, self.training)))


class HeavyLayer(nn.Module):
    """One layer too heavy for a stage (the planner splits it), dropout after it."""

    def __init__(self, aux_in_train: bool = False) -> None:
        super().__init__()
        self.big, self.small, self.aux = nn.Linear(256, 4096), nn.Linear(4096, 4), nn.Linear(4096, 4)
        self.aux_in_train = aux_in_train

    def forward(self, x):
        h = F.dropout(torch.relu(self.big(x)), 0.3, self.training)
        out = self.small(h)
        if self.aux_in_train and self.training:  # train mode returns an aux head too
            return out, self.aux(h)
        return out


def _x(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1))


def test_eval_model_with_a_stage_that_clones_its_inputs(one_thread):
    """Cut right before `relu_`: stage 1 is a ClonesInputs; compiled from an eval() model, the
    module is in eval mode and its outputs equal the model's, again after .train().eval()."""
    torch.manual_seed(0)
    model = CutBeforeWrite().eval()
    x = _x(8, 8)
    graph = driver.analyze_module(model, (x,))
    plan, graph = driver.plan(graph, "cpu,cpu", batch_size=8, microbatches=2, schedule="1f1b",
                              replicas=1, split_layers=False)
    plan.stages[0].nodes, plan.stages[1].nodes = ["a"], ["relu_", "dropout", "b", "c"]
    pm = driver.compile_module(model, graph, plan, (x,))
    assert "ClonesInputs" in [type(s).__name__ for s in pm._pipecc_stages]
    assert not pm.training
    with torch.no_grad():
        want = model(x)
        torch.testing.assert_close(pm(x), want)
        pm.train()
        pm.eval()
        torch.testing.assert_close(pm(x), want)


def test_eval_model_with_a_split_layer_equals_the_model(one_thread):
    torch.manual_seed(0)
    model = HeavyLayer().eval()
    x = _x(8, 256)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = pipecc.compile(model, (x,), "2xcpu", microbatches=2)
    assert any("shard" in n for s in pm.plan.stages for n in s.nodes), pm.plan.stages
    assert not pm.training
    with torch.no_grad():
        torch.testing.assert_close(pm(x), model(x))


def test_split_layer_keeps_the_one_mode_guard(one_thread):
    """Captured in train mode only (eval drops the aux head): with a split layer every stage
    still refuses eval mode, instead of returning train mode's (out, aux)."""
    torch.manual_seed(0)
    model = HeavyLayer(aux_in_train=True)
    x = _x(8, 256)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = pipecc.compile(model, (x,), "2xcpu", microbatches=2)
    assert any("shard" in n for s in pm.plan.stages for n in s.nodes), pm.plan.stages
    out = pm(x)
    assert isinstance(out, tuple) and len(out) == 2  # train mode: the graph it was captured in
    pm.eval()
    with pytest.raises(AssertionError, match="captured in train mode only"):
        pm(x)
    pm.train()
    assert isinstance(pm(x), tuple)
