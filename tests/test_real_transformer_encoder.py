"""PyTorch's own transformer as its docs teach it (issue 30): `nn.TransformerEncoder` of
`nn.TransformerEncoderLayer(batch_first=True)`, a causal mask from
`nn.Transformer.generate_square_subsequent_mask`, the default dropout 0.1.

- the -inf additive mask kept as a buffer is accepted (only NaN is refused in a buffer);
- with the mask built in forward the model is captured by torch.export, whose multi-head
  attention merges the batch inside other dims ((T, B·H, d), then (T·B, D) for the output
  projection); the batch analysis follows where the batch lies through those views, so plans
  with micro-batches and replicas are not refused, and the pipeline equals the model;
- `run --verify` turns off `nn.MultiheadAttention`'s own dropout as it does other dropouts.

Beside it, hand-written seq-first attention over merged dims (separable: equal) and models that
do mix samples through a merged dim (refused in one line naming the node).
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import pipecc
from pipecc.errors import PipeccError
from helpers import pipecc_here

LM_FILE = '''\
import torch
import torch.nn.functional as F
from torch import nn

SEQ = 16


class CausalLM(nn.Module):
    def __init__(self, vocab=64, d=32, heads=4, layers=4, mask_in_forward=False, dropout=0.1):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(SEQ, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(d, vocab)
        self.mask_in_forward = mask_in_forward
        if not mask_in_forward:
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ))

    def forward(self, tokens):
        h = self.tok(tokens) + self.pos
        if self.mask_in_forward:
            mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        else:
            mask = self.mask
        return self.head(self.encoder(h, mask=mask, is_causal=True))


def build_model():
    torch.manual_seed(0)
    return CausalLM(mask_in_forward={in_forward})


def example_inputs(batch_size=1):
    return (torch.randint(0, 64, (batch_size, SEQ), generator=torch.Generator().manual_seed(1)),)


def example_target(batch_size=1):
    return torch.randint(0, 64, (batch_size, SEQ), generator=torch.Generator().manual_seed(2))


def loss_fn(outputs, target):
    return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), target.reshape(-1))
'''


def _lm(in_forward: bool, dropout: float):
    ns: dict = {}
    exec(compile(LM_FILE.format(in_forward=in_forward), "lm", "exec"), ns)
    torch.manual_seed(0)
    return ns["CausalLM"](mask_in_forward=in_forward, dropout=dropout), ns["example_inputs"]


class SeqFirstHeads(nn.Module):
    """Attention written seq-first by hand, as nn.MultiheadAttention does inside: (T, B, D) ->
    (T, B·H, d) -> (B·H, T, d) bmm -> (T·B, D) -> linear -> (T, B, D)."""

    def __init__(self, d: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.d, self.h = d, heads
        self.qkv, self.out, self.head = nn.Linear(d, 3 * d), nn.Linear(d, d), nn.Linear(d, 3)

    def forward(self, x):  # x: (B, T, D)
        b, t, _ = x.shape
        q, k, v = self.qkv(x.transpose(0, 1)).chunk(3, -1)  # (T, B, D) each
        q, k, v = (z.reshape(t, b * self.h, self.d // self.h).transpose(0, 1) for z in (q, k, v))
        a = torch.softmax(q @ k.transpose(1, 2), -1) @ v  # (B·H, T, d)
        o = self.out(a.transpose(0, 1).reshape(t * b, self.d))  # (T·B, D): the batch inside
        o = torch.relu(o).view(t, b, self.d).transpose(0, 1)
        return self.head(o)


class MergedSoftmax(nn.Module):
    """Softmax over a (T·B) dim: every sample's scores share one normaliser (mixes)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):  # (B, T, 4)
        b, t, _ = x.shape
        h = self.a(x).transpose(0, 1).reshape(t * b, 4).softmax(0)
        return self.b(h.view(t, b, 4).transpose(0, 1))


class MergedWrongBack(nn.Module):
    """(T, B) merged, then read back as (B, T): samples swap rows (mixes)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):  # (B, T, 4)
        b, t, _ = x.shape
        h = self.a(x).transpose(0, 1).reshape(t * b, 4)
        return self.b(torch.relu(h).view(b, t, 4))


def _steps(model, x, steps: int = 2):
    outs = []
    for _ in range(steps):
        out = model(x)
        (out.float() ** 2).mean().backward()
        outs.append(out.detach())
    return outs


def _equal(pm, model, ref, x):
    torch.testing.assert_close(_steps(pm, x), _steps(ref, x))
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, n=name: f"gradient of {n}: {m}")


@pytest.mark.parametrize("in_forward", [False, True], ids=["mask_buffer", "mask_in_forward"])
def test_transformer_encoder_lm_microbatches_equal(in_forward, one_thread):
    """2 micro-batches over 2 stages (the -inf mask as a buffer or built in forward): outputs
    and gradients equal the model's (dropout 0 here: with it every value differs by design)."""
    model, inputs = _lm(in_forward, dropout=0.0)
    ref, (x,) = copy.deepcopy(model), inputs(8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = pipecc.compile(model, (x,), "2xcpu", microbatches=2)
    assert len(pm.plan.stages) >= 2 and pm.plan.microbatches == 2
    _equal(pm, model, ref, x)


def test_hand_written_seq_first_heads_equal(one_thread):
    """A batch merged inside (T·B) and (B·H) dims, worked on per row and viewed back: separable."""
    torch.manual_seed(0)
    model = SeqFirstHeads()
    ref, x = copy.deepcopy(model), torch.randn(6, 5, 8, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = pipecc.compile(model, (x,), "2xcpu", microbatches=2)
    assert pm.plan.microbatches == 2
    _equal(pm, model, ref, x)


@pytest.mark.parametrize("cls,node", [(MergedSoftmax, "softmax"), (MergedWrongBack, "b")])
def test_merged_batch_that_mixes_is_refused(cls, node, one_thread):
    torch.manual_seed(0)
    x = torch.randn(6, 5, 4, generator=torch.Generator().manual_seed(1))
    with pytest.raises(PipeccError) as info:
        pipecc.compile(cls(), (x,), "2xcpu", microbatches=2)
    line = str(info.value)
    assert "\n" not in line and line.startswith(f"node {node} ") and "microbatches=1" in line, line
    pipecc.compile(cls(), (x,), "2xcpu", microbatches=1)  # one micro-batch: nothing is split


@pytest.mark.slow
@pytest.mark.parametrize("in_forward", [False, True], ids=["mask_buffer", "mask_in_forward"])
def test_transformer_encoder_lm_cli_verify(in_forward, tmp_path):
    """`pipecc compile` with micro-batches and replicas (default dropout 0.1), then
    `pipecc run --verify`: outputs, loss and gradients match with dropout off in both runs."""
    path = tmp_path / "lm.py"
    path.write_text(LM_FILE.format(in_forward=in_forward))
    out = tmp_path / "out"
    done = pipecc_here("compile", str(path), "--devices", "4xcpu", "--batch-size", "8", "-m", "2",
                       "--replicas", "2", "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert "x 2 replicas" in done.stdout and "2 micro-batches" in done.stdout, done.stdout
    run = pipecc_here("run", str(out), "--steps", "1", "--verify")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "gradients match the single-process run" in run.stdout
    assert "dropout off in both runs" in run.stdout


class BufferMask(nn.Module):
    def __init__(self, fill: float) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.register_buffer("mask", torch.triu(torch.full((4, 4), fill), 1))

    def forward(self, x):
        return self.a(x) + (self.a(x) + self.mask).softmax(-1)


def test_an_inf_buffer_is_accepted_and_nan_refused(one_thread):
    """An additive -inf mask is the standard way to mask attention (finite losses); a NaN in a
    buffer still makes every loss NaN and is refused in one line."""
    x = torch.randn(8, 4, 4)  # (B, queries, keys)
    model = BufferMask(float("-inf"))
    pm = pipecc.compile(model, (x,), "2xcpu", microbatches=2)
    torch.testing.assert_close(pm(x), model(x))
    with pytest.raises(PipeccError, match="^buffer 'mask' holds NaN"):
        pipecc.compile(BufferMask(float("nan")), (x,), "2xcpu")
