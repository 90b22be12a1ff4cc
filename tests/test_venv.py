"""The environment `make` builds imports the libraries the docs invite people to use, with no shim.

`.venv/bin/python` (the interpreter `make test` runs; the one running this file where `.venv` is
absent) is started isolated (`-I`: no PYTHONPATH, no user site, no current folder on sys.path)
and with an environment that names nothing of the suite, so nothing from tests/ can stand in for
a library: torchvision's own C ops load beside torch, transformers' and timm's model classes
import (both import torchvision when it is installed) and their models run a forward pass.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV_PYTHON = ROOT / ".venv" / "bin" / "python"

SCRIPT = """
import torch, torchvision, transformers, timm
assert torchvision.extension._has_ops(), "torchvision's C extension did not load"
keep = torchvision.ops.nms(torch.tensor([[0., 0., 2., 2.], [0., 0., 2., 2.1]]), torch.tensor([1., .5]), .5)
assert keep.tolist() == [0], keep
torch.manual_seed(0)
net = torchvision.models.resnet18(num_classes=10).eval()
assert net(torch.rand(2, 3, 32, 32)).shape == (2, 10)
from transformers import GPT2Config, GPT2LMHeadModel
gpt = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, bos_token_id=0,
                                 eos_token_id=0)).eval()
assert gpt(torch.zeros(1, 5, dtype=torch.long)).logits.shape == (1, 5, 64)
vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, num_classes=10).eval()
assert vit(torch.rand(1, 3, 32, 32)).shape == (1, 10)
print("versions", torch.__version__, torchvision.__version__, transformers.__version__, timm.__version__)
"""


def test_venv_imports_torchvision_transformers_and_timm_models_without_any_shim() -> None:
    python = VENV_PYTHON if VENV_PYTHON.exists() else Path(sys.executable)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONSTARTUP", "PYTHONHOME", "PYTHONSAFEPATH")}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run([str(python), "-I", "-c", SCRIPT], cwd="/", env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("versions "), done.stdout
