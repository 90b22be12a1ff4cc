"""Library models as people write them (issue 30), beyond tests/real_zoo.py's table:

- torchvision MNASNet's `run --verify`: the stage weights are loaded into the reference model
  with the model's own module versions (with the stages' version-1 metadata MNASNet took them
  for an old checkpoint and migrated its layout: "size mismatch for layers.8.0.layers.6.weight");
- MaxViT's relative-position attention (torchvision's own block here; maxvit_t itself runs at
  0.5 samples/s on a CPU): forward reads `relative_position_index.view(-1)`, which the capture
  keeps as a constant, so no stage holds the buffer under its name; verify keeps the model's own
  (equal) values instead of refusing ("the compiled stages hold no tensor for ...");
- torchvision GoogLeNet returns a namedtuple (logits and two aux heads) in train mode: verify
  compares it leaf by leaf, each leaf cut to a replica's rows (before: "Boolean value of Tensor
  with more than one value is ambiguous", and with the default replicas "The size of tensor a
  (4) must match the size of tensor b (2)");
- CLIP's batch x batch similarity mixes samples and stays refused with micro-batches.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import pipecc
from pipecc.errors import PipeccError
from helpers import pipecc_here

MNASNET_FILE = '''\
import torch
import torch.nn.functional as F
import torchvision


def build_model():
    torch.manual_seed(0)
    return torchvision.models.mnasnet0_5(num_classes=10)


def example_inputs(batch_size=1):
    return (torch.randn(batch_size, 3, 32, 32, generator=torch.Generator().manual_seed(1)),)


def example_target(batch_size=1):
    return torch.randint(0, 10, (batch_size,), generator=torch.Generator().manual_seed(2))


def loss_fn(outputs, target):
    return F.cross_entropy(outputs, target)
'''


RELPOS_FILE = '''\
import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models.maxvit import RelativePositionalMultiHeadAttention


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.attn = RelativePositionalMultiHeadAttention(16, 8, 16)
        self.head = nn.Linear(16, 10)

    def forward(self, x):  # (B, windows, 16 positions, 8)
        return self.head(self.attn(self.inp(x)).mean((1, 2)))


def build_model():
    torch.manual_seed(0)
    return Model()


def example_inputs(batch_size=1):
    return (torch.randn(batch_size, 2, 16, 8, generator=torch.Generator().manual_seed(1)),)


def example_target(batch_size=1):
    return torch.randint(0, 10, (batch_size,), generator=torch.Generator().manual_seed(2))


def loss_fn(outputs, target):
    return F.cross_entropy(outputs, target)
'''


GOOGLENET_FILE = MNASNET_FILE.replace(
    "torchvision.models.mnasnet0_5(num_classes=10)",
    "torchvision.models.googlenet(num_classes=10, aux_logits=True, init_weights=False)").replace(
    "3, 32, 32", "3, 64, 64").replace(
    "return F.cross_entropy(outputs, target)", "return F.cross_entropy(outputs.logits, target)")
FILES = {"mnasnet": (MNASNET_FILE, "1"), "maxvit_relpos": (RELPOS_FILE, "1"),
         "googlenet": (GOOGLENET_FILE, "1"), "googlenet_replicas": (GOOGLENET_FILE, "auto")}


@pytest.mark.real
@pytest.mark.parametrize("name", sorted(FILES))
def test_run_verify(name: str, tmp_path: Path) -> None:
    text, replicas = FILES[name]
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    out = tmp_path / "out"
    done = pipecc_here("compile", str(path), "--devices", "2xcpu", "--batch-size", "4", "--replicas", replicas,
                       "-o", str(out))
    assert done.returncode == 0, done.stderr
    run = pipecc_here("run", str(out), "--steps", "1", "--verify")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "gradients match the single-process run" in run.stdout


@pytest.mark.real
def test_clip_similarity_stays_refused(one_thread) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.CLIPConfig(
        text_config=dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=16, bos_token_id=0,
                         eos_token_id=1, pad_token_id=1),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, image_size=32, patch_size=8), projection_dim=16)
    torch.manual_seed(0)
    model = transformers.CLIPModel(cfg)
    x = (torch.randint(2, 100, (4, 8)), torch.randn(4, 3, 32, 32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(PipeccError, match="pairs every sample with every other") as info:
            pipecc.compile(model, x, "2xcpu", microbatches=2)
    assert "\n" not in str(info.value) and "microbatches=1" in str(info.value)
