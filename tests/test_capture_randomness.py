"""Random numbers and non-tensor outputs at capture (`pipecc.frontend.host_random`,
`capture_errors.foreign_output`/`random_branch_refusal`): a draw from numpy or Python's `random`
in forward would be frozen into the graph, so it is refused in one line that names the call (or
confined to the mode that does not draw); a Python branch on a torch random draw and a
returned cache object are refused naming that construct, not as "data-dependent control flow"."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

import pipecc
from pipecc import driver
from pipecc.errors import CaptureError, PipeccError
from pipecc.ir.train_flag import META_BY_MODE, META_ONE_MODE


def _skip_rows(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Stochastic depth's signature (`stochastic_depth(x, p, mode, self.training)`) at p = 1:
    every row dropped in training, the identity in eval: which mode ran is visible."""
    return x * (1.0 - p) if training else x


torch.fx.wrap("_skip_rows")


class _NumpyMask(nn.Module):
    """SpecAugment's pattern: in training, a mask drawn with numpy over the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.out = nn.Linear(4, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.training:
            keep = np.random.rand(*h.shape) > 0.5
            h = h * torch.tensor(keep, dtype=h.dtype)
        return self.out(torch.relu(h))


class _PyRandom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * random.uniform(0.5, 1.5)


def test_numpy_draw_in_forward_is_refused_naming_the_call_and_rng_state_is_kept() -> None:
    np.random.seed(3)
    before = np.random.rand(4)
    np.random.seed(3)
    with pytest.raises(CaptureError) as err:
        driver.analyze_module(_NumpyMask().train(), (torch.randn(2, 4),))
    message = str(err.value)
    assert "\n" not in message
    assert "draws random numbers with numpy (np.random.rand) at test_capture_randomness.py:" in message
    assert "(`keep = np.random.rand(*h.shape) > 0.5`)" in message and "in train mode" in message
    assert "torch.rand" in message  # the way out
    torch.testing.assert_close(np.random.rand(4), before)  # the capture's draws were undone


def test_python_random_draw_is_refused() -> None:
    with pytest.raises(CaptureError, match=r"draws random numbers with random\.uniform at test_capture_randomness"):
        driver.analyze_module(_PyRandom(), (torch.randn(2, 4),))


def test_model_that_draws_only_in_train_mode_compiles_for_eval_only() -> None:
    """Eval mode draws nothing: the graph keeps eval mode alone, and running it in train mode is
    an error rather than a frozen mask."""
    model = _NumpyMask().eval()
    graph = driver.analyze_module(model, (torch.randn(2, 4),))
    training, why = graph.gm.meta[META_ONE_MODE]
    assert training is False and "train-mode forward draws random numbers with numpy" in why
    x = torch.randn(4, 4)
    pm = pipecc.compile(model, (x,), "2xcpu")
    pm.eval()
    torch.testing.assert_close(pm(x), model(x))
    pm.train()
    with pytest.raises((PipeccError, AssertionError, RuntimeError), match="eval mode"):
        pm(x)


class _Cache:
    """A key/value cache object, as transformers returns with use_cache=True."""

    def __init__(self, k: torch.Tensor) -> None:
        self.k = k


class _ReturnsCache(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> dict:
        h = self.lin(x)
        return {"logits": h, "past": _Cache(h)}


def test_non_tensor_output_is_named() -> None:
    with pytest.raises(CaptureError) as err:
        driver.analyze_module(_ReturnsCache(), (torch.randn(2, 4),))
    message = str(err.value)
    assert "\n" not in message
    assert f"forward returns a _Cache ({__name__}) in its output's past" in message
    assert "use_cache=False" in message and "data-dependent" not in message


class _LayerDrop(nn.Module):
    """Layerdrop: skip a layer on a torch random draw read in Python."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = torch.rand([])
        if self.training and p < 0.1:
            return x
        return self.lin(x)


def test_branch_on_a_torch_random_draw_names_the_draw() -> None:
    with pytest.raises(CaptureError) as err:
        driver.analyze_module(_LayerDrop().train(), (torch.randn(2, 4),))
    message = str(err.value)
    assert "\n" not in message
    assert "forward branches in Python on a random draw (torch.rand at test_capture_randomness.py:" in message
    assert "(`if self.training and p < 0.1:`)" in message and "layerdrop=0.0" in message


class _Noise(nn.Module):
    """A draw no input flows into: torch.fx would run it once while tracing."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + torch.randn(4)


def test_a_draw_no_input_flows_into_stays_random() -> None:
    """fx would bake the trace's draw into the graph; the capture keeps it an operator."""
    graph = driver.analyze_module(_Noise(), (torch.randn(2, 4),))
    assert any("randn" in str(n.target) for n in graph.gm.graph.nodes), graph.gm.code


class _FixedBatch(nn.Module):
    """Uses the batch size as a Python number: torch.export fixes the batch at the example's."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = int(x.shape[0])
        return self.b(torch.relu(self.a(x))) + torch.arange(n * 4, dtype=x.dtype).view(n, 4)


def test_dropin_of_a_fixed_batch_refuses_other_batches() -> None:
    """A batch of 1 would broadcast against the fixed [4, 4] constant and return 4 rows of
    something else: refused in one line; the captured batch equals the model."""
    model, x = _FixedBatch(), torch.randn(4, 4)
    pm = pipecc.compile(model, (x,), "2xcpu")
    torch.testing.assert_close(pm(x), model(x))
    for b in (1, 2, 6):
        with pytest.raises(PipeccError) as err:
            pm(torch.randn(b, 4))
        assert "\n" not in str(err.value)
        assert f"input 'x' is [{b}, 4], but the captured graph only runs at [4, 4]" in str(err.value)


class _Depth(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        return x + _skip_rows(self.b(h), 1.0, self.training)


def test_a_wrapped_function_gets_the_training_flag_of_the_mode_it_runs_in() -> None:
    """A wrapped function that takes `self.training` (torchvision's stochastic_depth) receives
    the module's flag, not the capture's: train drops the branch, eval keeps it."""
    model, x = _Depth().train(), torch.randn(4, 4)
    graph = driver.analyze_module(model, (x,))
    node = next(n for n in graph.gm.graph.nodes if n.target is _skip_rows)
    assert node.meta[META_BY_MODE] == {2: (True, False)}
    pm = pipecc.compile(model, (x,), "2xcpu")
    pm.train()
    torch.testing.assert_close(pm(x), x)
    pm.eval()
    model.eval()
    torch.testing.assert_close(pm(x), model(x))
    assert not torch.allclose(model(x), x)
