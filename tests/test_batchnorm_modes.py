"""BatchNorm and micro-batches follow the drop-in model's train/eval mode (issue #19 item 7).

In eval mode BatchNorm normalises with its running statistics, so micro-batching changes
nothing: `pipecc.compile` of an eval-mode model neither warns nor (with `strict_batchnorm`)
refuses, and matches the model. Switching that pipeline to `train()` is where per-micro-batch
statistics begin: it warns then, or refuses under `strict_batchnorm`.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import pipecc
from helpers import zoo_module
from pipecc.errors import PipeccError


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def tiny_cnn(train: bool) -> tuple[torch.nn.Module, torch.Tensor]:
    zoo = zoo_module("tiny_cnn")
    torch.manual_seed(0)
    model = zoo.build_model(**zoo.TINY).train(train)
    (x,) = zoo.example_inputs(4, **zoo.TINY)
    return model, x


@pytest.mark.parametrize("strict", [False, True])
def test_eval_mode_model_compiles_quietly_and_matches(strict: bool) -> None:
    model, x = tiny_cnn(train=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pm = pipecc.compile(model, (x,), "cpu,cpu", microbatches=2, strict_batchnorm=strict)
    assert pm.plan.microbatches == 2 and not pm.training
    out = pm(x)
    out.square().mean().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    want = model(x)
    want.square().mean().backward()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)
    pm.eval()  # staying in eval mode says nothing


def test_switching_an_eval_compiled_pipeline_to_train_warns() -> None:
    model, x = tiny_cnn(train=False)
    pm = pipecc.compile(model, (x,), "cpu,cpu", microbatches=2)
    with pytest.warns(UserWarning, match="normalises each of the 2 micro-batches with its own statistics"):
        pm.train()
    assert pm.training and model.training


def test_strict_refuses_the_switch_to_train() -> None:
    model, x = tiny_cnn(train=False)
    pm = pipecc.compile(model, (x,), "cpu,cpu", microbatches=2, strict_batchnorm=True)
    with pytest.raises(PipeccError, match="strict_batchnorm: BatchNorm .* micro-batches"):
        pm.train()
    assert not pm.training and not model.training  # refused before anything switched


def test_train_mode_model_still_warns_and_strict_still_refuses() -> None:
    model, x = tiny_cnn(train=True)
    with pytest.warns(UserWarning, match="own statistics"):
        pipecc.compile(model, (x,), "cpu,cpu", microbatches=2)
    with pytest.raises(PipeccError, match="strict_batchnorm"):
        pipecc.compile(model, (x,), "cpu,cpu", microbatches=2, strict_batchnorm=True)
