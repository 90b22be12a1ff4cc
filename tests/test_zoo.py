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
ZOO = ["bert", "chargpt", "digits_cnn", "gnmt", "gpt", "mlp", "resnet50", "tiny_cnn", "vgg16"]
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


# ----------------------------------------------------------------------------- analysis is pure
def model_state(model: torch.nn.Module) -> dict:
    """Everything analysis could change: every parameter and buffer (non-persistent ones
    included) as raw bytes with its dtype, shape and identity, every module's train flag, and
    the RNG states."""
    import random
    tensors = {}
    for kind, named in (("param", model.named_parameters(remove_duplicate=False)),
                        ("buffer", model.named_buffers(remove_duplicate=False))):
        for name, t in named:
            raw = t.detach().contiguous().reshape(-1).view(torch.uint8).clone()
            tensors[f"{kind}:{name}"] = (id(t), t.dtype, tuple(t.shape), raw)
    return {"tensors": tensors,
            "training": [(name, m.training) for name, m in model.named_modules()],
            "rng": (torch.get_rng_state(), random.getstate())}


def assert_same_state(got: dict, want: dict) -> None:
    assert got["tensors"].keys() == want["tensors"].keys()
    for key, (ident, dtype, shape, raw) in want["tensors"].items():
        g_ident, g_dtype, g_shape, g_raw = got["tensors"][key]
        assert (g_ident, g_dtype, g_shape) == (ident, dtype, shape), key
        assert torch.equal(g_raw, raw), f"{key} changed"
    assert got["training"] == want["training"]
    assert torch.equal(got["rng"][0], want["rng"][0]) and got["rng"][1] == want["rng"][1]


@pytest.mark.parametrize("name", ZOO)
def test_analysis_and_compile_leave_the_model_as_they_found_it(name: str) -> None:
    """Issue #14 item 3: analysis runs forward several times (BatchNorm counted 0 -> 4 batches);
    the user's model must come back bit for bit, in train mode and with one submodule in eval
    mode, with its non-persistent buffers and its RNG state."""
    import pipecc
    from pipecc import driver
    zoo = load(name)
    model = build_tiny(zoo)
    model.register_buffer("pipecc_test_scratch", torch.arange(3.0), persistent=False)
    next(m for m in model.modules() if m is not model).eval()  # a mixed train/eval model
    inputs = zoo.example_inputs(2, **zoo.TINY)
    before = model_state(model)
    driver.analyze_module(model, inputs)
    assert_same_state(model_state(model), before)
    pipecc.compile(model, inputs, "cpu,cpu")
    assert_same_state(model_state(model), before)
