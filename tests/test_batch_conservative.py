"""The batch analysis is conservative (issue 33): an op whose batch behaviour pipecc does not know
is taken to mix samples, and the ops that mix along an argument are checked on it: each class of
issue 33's list is refused in one line naming the node when the batch is split (drop-in and
command line alike), and its per-sample twin pipelines equal to the model.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pipecc
from pipecc.errors import PipeccError
from helpers import pipecc_here


class _Two(nn.Module):
    """Two linears around `mid(h)` (h: (B, 4))."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("ids", torch.tensor([0, 2, 1, 3]))

    def mid(self, h):
        return h

    def forward(self, x):
        return self.b(self.mid(self.a(x)))


def _mid(fn):
    return type(fn.__name__, (_Two,), {"mid": lambda self, h: fn(self, h)})


# mixes samples: (model, the node the refusal names)
MIXING = {
    "normalize_dim0": (_mid(lambda s, h: F.normalize(h, dim=0)), "normalize"),
    "fft_dim0": (_mid(lambda s, h: torch.fft.fft(h, dim=0).real), "fft_fft"),
    "fft2_default": (_mid(lambda s, h: torch.fft.fft2(h).real), "fft_fft2"),
    "layer_norm_whole_shape": (_mid(lambda s, h: F.layer_norm(h, h.shape)), "layer_norm"),
    "pad_batch": (_mid(lambda s, h: F.pad(h, (0, 0, 1, 1))[1:-1] * 2), "pad"),
    "renorm_across": (_mid(lambda s, h: torch.renorm(h, 2, 1, 1.0)), "renorm"),
    "softmin_dim0": (_mid(lambda s, h: F.softmin(h, 0)), "softmin"),
    "embedding_table": (_mid(lambda s, h: F.embedding(h.argmax(-1), h) + h), "embedding"),
    "unknown_op_qr": (_mid(lambda s, h: torch.linalg.qr(h)[0]), "linalg_qr"),
    "drops_a_sample": (_mid(lambda s, h: h[1:].sum(0, keepdim=True) + h), "getitem"),
}
# keeps samples apart: equal to the model with 2 micro-batches
SEPARABLE = {
    "normalize_last": _mid(lambda s, h: F.normalize(h, dim=-1)),
    "fft_last": _mid(lambda s, h: torch.fft.fft(h, dim=-1).abs()),
    "layer_norm_sample_shape": _mid(lambda s, h: F.layer_norm(h, h.shape[1:])),
    "pad_features": _mid(lambda s, h: F.pad(h, (1, 1))[:, 1:-1] * 2),
    "renorm_per_sample": _mid(lambda s, h: torch.renorm(h, 2, 0, 1.0)),
    "softmin_last": _mid(lambda s, h: F.softmin(h, -1)),
    "embedding_of_ids": _mid(lambda s, h: h + F.embedding(s.ids, s.a.weight).sum()),
}


def _x() -> torch.Tensor:
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", sorted(MIXING))
def test_mixing_is_refused_when_the_batch_is_split(name, one_thread):
    cls, node = MIXING[name]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(PipeccError) as info:
            pipecc.compile(cls(), (_x(),), "2xcpu", microbatches=2)
        line = str(info.value)
        assert "\n" not in line and line.startswith(f"node {node} ") and "microbatches=1" in line, line
        pipecc.compile(cls(), (_x(),), "2xcpu", microbatches=1, replicas=1)  # nothing split


@pytest.mark.parametrize("name", sorted(SEPARABLE))
def test_per_sample_twin_equals_the_model(name, one_thread):
    torch.manual_seed(0)
    model = SEPARABLE[name]()
    ref, x = copy.deepcopy(model), _x()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = pipecc.compile(model, (x,), "2xcpu", microbatches=2)
    assert pm.plan.microbatches == 2
    for module in (pm, ref):
        (module(x) ** 2).sum().backward()
    torch.testing.assert_close(pm(x), ref(x))
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, n=n: f"gradient of {n}: {m}")


class PadModule(nn.Module):
    """nn.ZeroPad2d pads H and W of (B, C, H, W): per sample; of a (C, H, W)-ranked view where
    the batch is H, it pads the batch."""

    def __init__(self, over_batch: bool) -> None:
        super().__init__()
        self.c, self.pad, self.over_batch = nn.Conv2d(1, 2, 3), nn.ZeroPad2d(1), over_batch

    def forward(self, x):
        h = self.c(x)
        if self.over_batch:
            return self.pad(h.permute(1, 0, 2, 3)).permute(1, 0, 2, 3)[1:-1]
        return self.pad(h)


def test_padding_module_along_the_batch_is_refused(one_thread):
    x = torch.randn(6, 1, 6, 6)
    with pytest.raises(PipeccError, match="^node "):
        pipecc.compile(PadModule(True), (x,), "2xcpu", microbatches=2)
    model = PadModule(False)
    pm = pipecc.compile(model, (x,), "2xcpu", microbatches=2)
    torch.testing.assert_close(pm(x), model(x))


UNKNOWN_FILE = '''\
import torch
import torch.nn.functional as F
from torch import nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(torch.linalg.qr(self.a(x))[0])


def build_model():
    torch.manual_seed(0)
    return Model()


def example_inputs(batch_size=1):
    return (torch.randn(batch_size, 4, generator=torch.Generator().manual_seed(1)),)
'''


@pytest.mark.slow
def test_command_line_refuses_an_unknown_op_too(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(UNKNOWN_FILE)
    out = tmp_path / "out"
    done = pipecc_here("compile", str(path), "--devices", "2xcpu", "--batch-size", "8", "-m", "2",
                       "--replicas", "1", "-o", str(out))
    assert done.returncode == 1 and not out.exists(), done.stderr
    assert done.stderr.startswith("pipecc: error: node linalg_qr "), done.stderr
    assert "does not know to keep samples apart" in done.stderr
