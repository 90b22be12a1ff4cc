"""The model zoo: every `models/*.py` keeps the model-file contract (CONTRACT.md §2), trains
at its TINY size, traces with torch.fx to the same numbers, and the full-size configs have
the parameter counts of their reference implementations."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.fx

MODELS_DIR = Path(__file__).resolve().parents[1] / "models"
ZOO = ["bert", "gnmt", "gpt", "mlp", "resnet50", "tiny_cnn", "vgg16"]
CONTRACT_NAMES = ["build_model", "example_inputs", "loss_fn", "example_target"]


def load(name: str) -> ModuleType:
    """Import `models/<name>.py` by path, as a user's model file would be."""
    path = MODELS_DIR / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"zoo_{name}", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_tiny(zoo: ModuleType) -> torch.nn.Module:
    torch.manual_seed(0)
    return zoo.build_model(**zoo.TINY)


def test_zoo_lists_every_model_file() -> None:
    on_disk = sorted(p.stem for p in MODELS_DIR.glob("*.py") if p.stem != "__init__")
    assert on_disk == ZOO


@pytest.mark.parametrize("name", ZOO)
def test_contract_names(name: str) -> None:
    zoo = load(name)
    missing = [n for n in CONTRACT_NAMES + ["TINY"] if not hasattr(zoo, n)]
    assert not missing, f"models/{name}.py lacks {missing}"
    assert zoo.__doc__, f"models/{name}.py has no module docstring"


@pytest.mark.parametrize("name", ZOO)
def test_tiny_forward_backward(name: str) -> None:
    zoo = load(name)
    model = build_tiny(zoo)
    out = model(*zoo.example_inputs(2, **zoo.TINY))
    assert isinstance(out, torch.Tensor) and out.shape[0] == 2
    assert torch.isfinite(out).all()
    loss = zoo.loss_fn(out, zoo.example_target(2, **zoo.TINY))
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, f"{pname} got no gradient"
        assert torch.isfinite(p.grad).all(), f"{pname} has a non-finite gradient"


@pytest.mark.parametrize("name", ZOO)
def test_tiny_traces_to_same_output(name: str) -> None:
    zoo = load(name)
    model = build_tiny(zoo)
    inputs = zoo.example_inputs(2, **zoo.TINY)
    traced = torch.fx.symbolic_trace(model)
    traced.graph.lint()
    torch.testing.assert_close(traced(*inputs), model(*inputs))


@pytest.mark.parametrize("name", ZOO)
def test_examples_are_deterministic_and_leave_global_rng_alone(name: str) -> None:
    zoo = load(name)
    rng = torch.get_rng_state()
    first = (zoo.example_inputs(3, **zoo.TINY), zoo.example_target(3, **zoo.TINY))
    second = (zoo.example_inputs(3, **zoo.TINY), zoo.example_target(3, **zoo.TINY))
    torch.testing.assert_close(first, second)
    assert torch.equal(rng, torch.get_rng_state())


@pytest.mark.parametrize("name", ZOO)
def test_build_does_not_seed_globally(name: str) -> None:
    zoo = load(name)
    torch.manual_seed(0)
    a, b = zoo.build_model(**zoo.TINY), zoo.build_model(**zoo.TINY)
    torch.manual_seed(0)
    c = zoo.build_model(**zoo.TINY)
    assert any(not torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))


# Reference counts: torchvision vgg16 / resnet50, Hugging Face bert-base-uncased (109,482,240)
# plus the 2-label classifier, GPT-2 (124,439,808 with the head tied to the token embedding;
# the zoo unties it by default, adding 50257 * 768).
FULL_PARAMS = [
    ("vgg16", {}, 138_357_544),
    ("resnet50", {}, 25_557_032),
    ("bert", {}, 109_482_240 + 768 * 2 + 2),
    ("gpt", {}, 124_439_808 + 50257 * 768),
    ("gpt", {"tie_weights": True}, 124_439_808),
    ("gpt", {"preset": "gpt2-xl", "tie_weights": True}, 1_557_611_200),
]


@pytest.mark.parametrize("name,kwargs,expected", FULL_PARAMS)
def test_full_size_parameter_counts(name: str, kwargs: dict, expected: int) -> None:
    zoo = load(name)
    with torch.device("meta"):
        model = zoo.build_model(**kwargs)
    assert sum(p.numel() for p in model.parameters()) == expected


def test_gpt_explicit_kwargs_override_preset() -> None:
    gpt = load("gpt")
    with torch.device("meta"):
        model = gpt.build_model(preset="gpt2-xl", n_layer=2)
    assert len(model.blocks) == 2 and model.wte.embedding_dim == 1600
    assert gpt.example_inputs(1, block_size=16)[0].shape == (1, 16)
    with pytest.raises(ValueError, match="seq_len"):
        gpt.example_inputs(1, block_size=16, seq_len=32)
