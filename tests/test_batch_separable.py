"""Micro-batches split the batch along dim 0: a table of models that mix samples (refused in one
line naming the node) and that keep them apart (outputs, gradients and buffers equal the
model's), through the drop-in `pipecc.compile` and, for a few, `pipecc compile` + `pipecc run`.

Every case runs twice: with 2 micro-batches, where it is either refused (`REFUSED`, naming the
node) or equal to the model; and with 1 micro-batch, where nothing is split, so nothing is
refused and everything is equal, buffers written in forward (a step counter, an EMA, a counter
in a `torch.no_grad()` block, InstanceNorm's running statistics) and the gradients of a
`no_grad` scale included (issue 22, items 1 and 2).
"""
from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from torch import nn

import pipecc
from pipecc.errors import PipeccError
from helpers import pipecc_here


class _Two(nn.Module):
    """Two linears around `mid(h)`; subclasses write `mid` (or forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def mid(self, h: torch.Tensor) -> torch.Tensor:
        return h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.mid(self.a(x)))


class Center(_Two):
    def mid(self, h):
        return h - h.mean(0)


class HandBatchNorm(_Two):
    def mid(self, h):
        return (h - h.mean(0, keepdim=True)) / (h.var(0, keepdim=True) + 1e-5).sqrt()


class CumsumBatch(_Two):
    def mid(self, h):
        return h.cumsum(0)


class MeanOut(_Two):
    def forward(self, x):
        return self.b(self.a(x)).mean(0)


class TransposedOut(_Two):
    def forward(self, x):
        return self.b(self.a(x)).t()


class BatchSizeValue(_Two):
    def forward(self, x):
        return self.b(self.a(x)) * x.shape[0]


class BatchSizeReturned(_Two):
    def forward(self, x):
        return self.b(self.a(x)), x.shape[0]


class MergedView(_Two):
    def forward(self, x):  # the batch ends up inside dim 0, not outermost
        return self.b(self.a(x)).t().reshape(-1).view(x.shape[0], 4)


class SeqFirstGRU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.g, self.b = nn.Linear(4, 4), nn.GRU(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.g(self.a(x))[0])


class InstanceNormStats(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.n, self.b = nn.Linear(4, 4), nn.InstanceNorm1d(4, track_running_stats=True), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.n(self.a(x).transpose(1, 2)).transpose(1, 2))


class StepCounter(_Two):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.steps += 1
        return super().forward(x)


class EMABuffer(_Two):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ema", torch.zeros(4))

    def mid(self, h):
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * h.mean(0))
        return h


class NoGradCounter(_Two):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))

    def mid(self, h):
        with torch.no_grad():
            self.seen += h.shape[0]
        return h


class NoGradBatchScale(_Two):
    def mid(self, h):
        with torch.no_grad():  # a max over the whole batch, used as a constant scale
            scale = h.abs().max()
        return h / scale


class Gram(_Two):
    def mid(self, h):
        return h @ (h.t() @ h)


class FlipBatch(_Two):
    def mid(self, h):
        return h.flip(0)


class CatBatch(_Two):
    def forward(self, x):
        h = self.a(x)
        return self.b(torch.cat([h, h], 0))


class FirstSample(_Two):
    def mid(self, h):
        return h + h[0]


class FullOfBatchSize(_Two):
    def mid(self, h):
        return h + torch.full((4,), h.shape[0])


class SeqFirstAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.m, self.b = nn.Linear(4, 4), nn.MultiheadAttention(4, 2), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        return self.b(self.m(h, h, h, need_weights=False)[0])


# separable controls: equal to the model with 2 micro-batches
class FullOfBatchShape(_Two):
    def mid(self, h):
        return h + torch.full((h.shape[0], 4), 2.0)

class NoGradSampleScale(_Two):
    def mid(self, h):
        with torch.no_grad():  # per sample: micro-batches keep it
            scale = h.abs().amax(-1, keepdim=True) + 1.0
        return h / scale


class OtherDims(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.n, self.b = nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.n(self.a(x))
        h = (h - h.mean(-1, keepdim=True)).softmax(-1).cumsum(1)
        return self.b(h).flatten(1).view(x.shape[0], -1, 4)


class BatchFirstGRU(SeqFirstGRU):
    def __init__(self) -> None:
        super().__init__()
        self.g = nn.GRU(4, 4, batch_first=True)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.e = nn.Embedding(10, 8)
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, tokens):
        return self.head(self.layer(self.e(tokens)))


class Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c, self.p, self.f = nn.Conv2d(1, 2, 3), nn.MaxPool2d(2), nn.Linear(2 * 3 * 3, 3)

    def forward(self, x):
        h = self.p(torch.relu(self.c(x)))
        return self.f(h.reshape(x.size(0), -1))


def _x(*shape):
    return lambda: torch.randn(*shape, generator=torch.Generator().manual_seed(1))


# name -> (model class, inputs, the node the refusal names at 2 micro-batches, or None: equal)
CASES = {
    "center": (Center, _x(8, 4), "mean"),
    "hand_batchnorm": (HandBatchNorm, _x(8, 4), "mean"),
    "cumsum_batch": (CumsumBatch, _x(8, 4), "cumsum"),
    "mean_output": (MeanOut, _x(8, 4), "mean"),
    "transposed_output": (TransposedOut, _x(8, 4), "t"),
    "batch_size_value": (BatchSizeValue, _x(8, 4), "mul"),
    "batch_size_returned": (BatchSizeReturned, _x(8, 4), "getitem"),
    "merged_view": (MergedView, _x(8, 4), "view"),
    "seq_first_gru_t_eq_b": (SeqFirstGRU, _x(6, 6, 4), "g"),
    "instance_norm_stats": (InstanceNormStats, _x(6, 5, 4), "n"),
    "step_counter": (StepCounter, _x(8, 4), "add_"),
    "ema_buffer": (EMABuffer, _x(8, 4), "mul_"),
    "no_grad_counter": (NoGradCounter, _x(8, 4), "add_"),
    "no_grad_batch_scale": (NoGradBatchScale, _x(8, 4), "max"),
    "gram_over_batch": (Gram, _x(8, 4), "matmul"),
    "flip_batch": (FlipBatch, _x(8, 4), "flip"),
    "cat_along_batch": (CatBatch, _x(8, 4), "cat"),
    "first_sample": (FirstSample, _x(8, 4), "getitem"),
    "full_of_batch_size": (FullOfBatchSize, _x(8, 4), "full"),
    "seq_first_attention": (SeqFirstAttention, _x(6, 5, 4), "m"),
    "no_grad_sample_scale": (NoGradSampleScale, _x(8, 4), None),
    "full_of_batch_shape": (FullOfBatchShape, _x(8, 4), None),
    "other_dims": (OtherDims, _x(8, 3, 4), None),
    "batch_first_gru": (BatchFirstGRU, _x(6, 5, 4), None),
    "attention": (Attention, lambda: torch.randint(0, 10, (6, 5), generator=torch.Generator().manual_seed(1)), None),
    "conv": (Conv, _x(6, 1, 8, 8), None),
}


def _run(model: nn.Module, x: torch.Tensor, steps: int = 2) -> list:
    """Outputs of `steps` forward/backward passes (gradients accumulate on the parameters)."""
    outs = []
    for _ in range(steps):
        out = model(x)
        first = out[0] if isinstance(out, tuple) else out
        (first.float() ** 2).sum().backward()
        outs.append(out)
    return outs


def _equal(pm: nn.Module, model: nn.Module, ref: nn.Module, x: torch.Tensor) -> None:
    got, want = _run(pm, x), _run(ref, x)
    torch.testing.assert_close(got, want)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, n=name: f"gradient of {n}: {m}")
    for (name, b), (_, c) in zip(model.named_buffers(), ref.named_buffers()):
        torch.testing.assert_close(b, c, msg=lambda m, n=name: f"buffer {n}: {m}")


def _build(name: str) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    cls, inputs, _ = CASES[name]
    torch.manual_seed(0)
    model = cls()
    return model, copy.deepcopy(model), inputs()


@pytest.mark.parametrize("name", sorted(CASES))
def test_two_microbatches_refuse_or_equal(name, one_thread):
    """2 micro-batches: the mixing node is named in one line, or the pipeline equals the model."""
    model, ref, x = _build(name)
    node = CASES[name][2]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if node is not None:
            with pytest.raises(PipeccError) as info:
                pipecc.compile(model, (x,), "2xcpu", microbatches=2)
            line = str(info.value)
            assert "\n" not in line and line.startswith(f"node {node} "), line
            assert "microbatches=1" in line
            return
        pm = pipecc.compile(model, (x,), "2xcpu", microbatches=2)
    assert len(pm.plan.stages) == 2 and pm.plan.microbatches == 2
    _equal(pm, model, ref, x)


@pytest.mark.parametrize("name", sorted(CASES))
def test_one_microbatch_never_refused_and_equal(name, one_thread):
    """1 micro-batch, no replicas: nothing is split, so nothing is refused; outputs, gradients
    and the buffers forward wrote equal the model's after two steps."""
    model, ref, x = _build(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = pipecc.compile(model, (x,), "2xcpu", microbatches=1)
    assert len(pm.plan.stages) == 2
    _equal(pm, model, ref, x)


MODEL_FILE = '''\
import torch
import torch.nn.functional as F
from torch import nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x):
        self.steps += 1
        h = self.a(x)
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * h.mean(0))
            scale = h.abs().max()
        return self.b(h / scale)


def build_model():
    torch.manual_seed(0)
    return Model()


def example_inputs(batch_size=1):
    return (torch.randn(batch_size, 4, generator=torch.Generator().manual_seed(1)),)


def example_target(batch_size=1):
    return torch.randn(batch_size, 4, generator=torch.Generator().manual_seed(2))


def loss_fn(outputs, target):
    return F.mse_loss(outputs, target)
'''


@pytest.mark.slow
def test_compiled_folder_buffers_and_no_grad(tmp_path):
    """`pipecc compile -m 2` refuses the model in one line naming the node; at -m 1 the folder
    records why, `pipecc run --verify` matches outputs, gradients (the no_grad scale) and the
    buffers forward wrote (step counter, EMA), and `pipecc run -m 2` refuses."""
    path = tmp_path / "model.py"
    path.write_text(MODEL_FILE)
    common = ["compile", str(path), "--devices", "2xcpu", "--batch-size", "8", "--replicas", "1"]
    refused = pipecc_here(*common, "-m", "2", "-o", str(tmp_path / "m2"))
    assert refused.returncode == 1 and not (tmp_path / "m2").exists()
    assert refused.stderr.startswith("pipecc: error: node add_ writes the buffer steps"), refused.stderr
    out = tmp_path / "m1"
    done = pipecc_here(*common, "-m", "1", "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert json.loads((out / "pipecc.json").read_text())["batch_mixing"]["node"] == "add_"
    run = pipecc_here("run", str(out), "--steps", "1", "--verify")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "verify: outputs, loss and 4 gradients match" in run.stdout
    again = pipecc_here("run", str(out), "--steps", "1", "-m", "2")
    assert again.returncode == 1 and "node add_ writes the buffer steps" in again.stderr
    with pytest.raises(PipeccError, match="^node add_ writes the buffer steps"):
        pipecc.load(out, microbatches=2)
    loaded = pipecc.load(out)  # one micro-batch: the step counter counts the call once
    loaded(torch.randn(8, 4))
    assert int(loaded.state_dict()["steps"]) == 1


class ReadsScale(_Two):
    def __init__(self) -> None:
        super().__init__()
        self.scale = 2.0

    def mid(self, h):
        return h * self.scale


def test_frozen_attribute_is_named(one_thread):
    """A Python attribute forward reads is captured as a constant: the analysis says so, naming
    it and its value; a model that reads none gets no such note."""
    from pipecc import driver
    from pipecc.frontend.constants import NOTE_PREFIX
    x = torch.randn(4, 4)
    graph = driver.analyze_module(ReadsScale(), (x,))
    notes = [w for w in graph.warnings if w.startswith(NOTE_PREFIX)]
    assert len(notes) == 1 and "scale (= 2.0)" in notes[0] and "as a constant" in notes[0]
    assert not [w for w in driver.analyze_module(Center(), (x,)).warnings if w.startswith(NOTE_PREFIX)]


class WritesParameter(_Two):
    def mid(self, h):
        with torch.no_grad():
            self.a.weight.mul_(0.99)
        return h


def test_parameter_written_in_forward_is_refused(one_thread):
    """A forward that changes a parameter in place cannot be pipelined (at -m 1 it gave other
    numbers): refused at capture in one line naming the parameter."""
    with pytest.raises(PipeccError, match=r"^the model's forward writes parameter 'a\.weight' in place"):
        pipecc.compile(WritesParameter(), (torch.randn(8, 4),), "2xcpu", microbatches=1)
