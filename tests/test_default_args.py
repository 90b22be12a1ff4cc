"""Forward arguments the example inputs do not give keep their defaults (issue #19 item 5).

timm's ViT has `forward(x, attn_mask=None)`: torch.fx made `attn_mask` a placeholder, so the
compiled model required it ("missing input 'attn_mask'") and a `mask is not None` test took the
wrong branch. Both capture routes must see the model as `model(x)` calls it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pipecc
from helpers import run_cli
from pipecc import driver


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class Branching(nn.Module):
    """`if mask is not None`: a proxy for the default would take the wrong branch."""

    def __init__(self, shape_test: bool = False) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.shape_test = shape_test

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 2.0,
                *, act: str = "tanh") -> torch.Tensor:
        h = self.a(x) * scale
        h = torch.tanh(h) if act == "tanh" else torch.relu(h)
        if self.shape_test and x.shape[0] > 1:  # torch.fx cannot trace it: torch.export does
            h = h + 1
        if mask is not None:
            h = h * mask
        return self.c(torch.relu(self.b(h)))


class Attention(nn.Module):
    """The mask goes straight into attention, as in timm's ViT: fx traced it as an input."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(16, 48), nn.Linear(16, 16)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        h = x + self.proj(F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask))
        return h + self.mlp(h)


def placeholders(model: nn.Module, inputs: tuple, source: str) -> list[str]:
    graph = driver.analyze_module(model, inputs)
    assert graph.source == source
    return [str(n.target) for n in graph.gm.graph.nodes if n.op == "placeholder"]


def check_pipelined(model: nn.Module, x: torch.Tensor) -> None:
    """Two stages, two micro-batches, called as the model is: outputs and gradients."""
    pm = pipecc.compile(model, (x,), "cpu,cpu", microbatches=2, split_layers=False)
    assert len(pm.plan.stages) == 2
    out = pm(x)
    out.square().mean().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    want = model(x)
    want.square().mean().backward()
    torch.testing.assert_close(out, want)
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, msg=n)


@pytest.mark.parametrize("shape_test, source", [(False, "fx"), (True, "export")])
def test_defaults_not_given_are_no_inputs(shape_test: bool, source: str) -> None:
    torch.manual_seed(0)
    model, x = Branching(shape_test), torch.randn(4, 8)
    assert placeholders(model, (x,), source) == ["x"]
    check_pipelined(model, x)


def test_a_mask_passed_into_attention_keeps_its_default() -> None:
    torch.manual_seed(0)
    model, x = Attention(), torch.randn(4, 5, 16)
    assert placeholders(model, (x,), "fx") == ["x"]
    check_pipelined(model, x)


def test_given_arguments_stay_inputs() -> None:
    """A mask the example inputs give is an input; the rest keep their defaults."""
    torch.manual_seed(0)
    model, x, mask = Branching(), torch.randn(4, 8), (torch.rand(4, 16) > 0.5).float()
    assert placeholders(model, (x, mask), "fx") == ["x", "mask"]
    pm = pipecc.compile(model, (x, mask), "cpu,cpu", microbatches=2, split_layers=False)
    torch.testing.assert_close(pm(x, mask), model(x, mask))


def test_untaken_defaults_are_the_plain_ones_after_the_given() -> None:
    from pipecc.frontend.fx_tracer import untaken_defaults

    class Odd(nn.Module):
        def forward(self, x, y=None, w=torch.ones(2), sizes=(1, 2), *, k=3, **extra):  # noqa: B008
            return x

    class Star(nn.Module):
        def forward(self, *xs, flag=False):
            return xs[0]

    assert untaken_defaults(Branching(), 1) == {"mask": None, "scale": 2.0, "act": "tanh"}
    assert untaken_defaults(Branching(), 2) == {"scale": 2.0, "act": "tanh"}
    assert untaken_defaults(Odd(), 1) == {"y": None, "k": 3}  # a tensor or tuple stays an input
    assert untaken_defaults(Star(), 1) == {}


def test_compiled_folder_takes_only_the_given_inputs(tmp_path: Path, capsys) -> None:
    """`pipecc run` feeds example_inputs() to ports.json's model_inputs: one input here."""
    path = tmp_path / "vit_like.py"
    path.write_text(
        "import torch\nfrom torch import nn\nimport torch.nn.functional as F\n\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.qkv, self.proj = nn.Linear(16, 48), nn.Linear(16, 16)\n"
        "    def forward(self, x, attn_mask=None):\n"
        "        q, k, v = self.qkv(x).chunk(3, dim=-1)\n"
        "        return x + self.proj(F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask))\n\n"
        "def build_model():\n    return M()\n\n"
        "def example_inputs(batch_size=2):\n    return (torch.randn(batch_size, 5, 16),)\n")
    out = tmp_path / "out"
    code, _, err = run_cli(["compile", str(path), "--devices", "2xcpu", "--replicas", "1", "-b", "2",
                            "-o", str(out), "-q"], capsys)
    assert code == 0, err
    ports = json.loads((out / "stage_0" / "ports.json").read_text())
    assert [d["arg"] for d in ports["model_inputs"]] == ["x"]
