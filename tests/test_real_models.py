"""Real library models through the path the README teaches (issue 19, item 8).

Hugging Face transformers (GPT-2, BERT, T5, Llama, ViT, Wav2Vec2), torchvision (ResNet-18,
MobileNetV3-small, EfficientNet-B0, ConvNeXt-tiny, Swin-T, ViT-B/16) and timm (ViT-tiny), each
built as its library builds it at a small config (tests/real_zoo.py says how and why), and per
model: FLOPs against FlopCounterMode, `pipecc compile` for 2xcpu with the defaults and with
`--replicas 1`, `pipecc run --verify` in train and eval mode, and the drop-in `pipecc.compile`.
bench/real_models.py prints the same matrix as a table.

Marked `real` (`-m "not real"` leaves them out; `make test` runs them). A model's checks share
one scratch folder and run in one xdist group, so each model is compiled three times and run
twice, whatever order the checks are collected in.

REFUSED lists the (model, check) pairs whose refusal is the right answer, with what its one line
must name. KNOWN lists the (model, check) pairs that fail today, each with the part of its error
line that must still appear: the test is then `xfail(strict=True)` and only that failure counts
as expected. A fix makes it pass, which strict turns into a failure until its entry is removed;
a different error fails too (so a fix that moves the failure elsewhere is seen).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import real_zoo
from helpers import GROUPED_CONV_FIX, reference_flops
from pipecc import cost, driver

# (model, check) -> a stable part of its current error line (bench/real_models.py's table).
KNOWN: dict[tuple[str, str], str] = {
    # empty today; efficientnet_b0 runs at 64x64 (tests/real_zoo.py says why)
}

# (model, check) -> the construct its one-line refusal must name. These are the library's
# defaults that no pipeline can run as written: the check must fail, in one line that names what
# forward does and the way out (asserted, not xfailed: a refusal that changes wording or turns
# into a silent answer fails the test).
REFUSED: dict[tuple[str, str], tuple[str, ...]] = {
    **{("gpt2_use_cache", c): ("forward returns a DynamicCache (transformers.cache_utils)",
                               "use_cache=False") for c in ("cost", "compile")},
    **{("wav2vec2_layerdrop", c): ("branches in Python on a random draw (torch.rand at modeling_wav2vec2.py",
                                   "config.layerdrop=0.0") for c in ("cost", "compile")},
    **{("wav2vec2_specaugment", c): ("draws random numbers with numpy (np.random.rand)",
                                     "_compute_mask_indices", "config.mask_time_prob=0.0")
       for c in ("cost", "compile")},
}


class KnownFailure(AssertionError):
    """The failure KNOWN expects for this (model, check)."""


_RUNS: dict[str, real_zoo.ModelRun] = {}


def model_run(name: str, root: Path) -> real_zoo.ModelRun:
    """The model's checks over one folder, shared by its tests in this process."""
    if name not in _RUNS:
        folder = root / name
        folder.mkdir()
        _RUNS[name] = real_zoo.ModelRun(real_zoo.BY_NAME[name], folder)
    return _RUNS[name]


def cases() -> list:
    out = []
    for model in real_zoo.MODELS:
        for check in real_zoo.checks_of(model):
            marks = [pytest.mark.real, pytest.mark.xdist_group(f"real-{model.name}")]
            if (model.name, check) in KNOWN:
                marks.append(pytest.mark.xfail(strict=True, raises=KnownFailure,
                                               reason=KNOWN[model.name, check]))
            out.append(pytest.param(model.name, check, id=f"{model.name}-{check}", marks=marks))
    return out


@pytest.fixture(scope="session")
def real_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("real")


@pytest.mark.parametrize("name,check", cases())
def test_real_model(name: str, check: str, real_root: Path) -> None:
    pytest.importorskip(real_zoo.BY_NAME[name].library)
    status, detail = model_run(name, real_root).result(check)
    if (name, check) in REFUSED:
        assert status == "fail", f"{name} {check} was expected to be refused, and passed: {detail}"
        assert "\n" not in detail and all(part in detail for part in REFUSED[name, check]), detail
        return
    expected = KNOWN.get((name, check))
    if status == "pass":
        return
    if expected is not None and expected in detail:
        raise KnownFailure(detail)
    where = f" (KNOWN expects {expected!r})" if expected is not None else ""
    raise AssertionError(f"{name} {check}: {detail}{where}")


# ----------------------------------------------------------------------------- the set-up
@pytest.mark.parametrize("groups,transposed", [(1, False), (4, False), (8, False), (4, True)])
def test_grouped_conv_fixed_reference_equals_pipecc(groups: int, transposed: bool) -> None:
    """The reference the suite uses (torch's formula with the weight gradient divided by
    `groups`) equals pipecc's count, which tests/test_cost_formulas.py checks by hand."""
    kind = torch.nn.ConvTranspose2d if transposed else torch.nn.Conv2d
    conv = kind(8, 16, 3, stride=2, padding=1, groups=groups)
    x = torch.randn(2, 8, 9, 9, requires_grad=True)
    totals = cost.totals(driver.analyze_module(conv, (x,)))
    fwd, bwd = reference_flops(conv, (x,), mapping=GROUPED_CONV_FIX)
    assert (totals["forward_flops_matmul"], totals["backward_flops_matmul"]) == (fwd, bwd)
    _, unfixed = reference_flops(conv, (x,))
    assert (unfixed == bwd) == (groups == 1)


def test_model_files_keep_the_contract(tmp_path: Path) -> None:
    """Every generated model file imports and gives the same data on every call (each rank of
    `pipecc run` builds it for itself), without touching the global RNG."""
    from pipecc.frontend.modelfile import import_model_file
    for model in real_zoo.MODELS:
        if importlib.util.find_spec(model.library) is None:
            continue  # test_real_model skips it with the reason
        module = import_model_file(real_zoo.write_model_file(model, tmp_path))
        rng = torch.get_rng_state()
        first = (module.example_inputs(2), module.example_target(2))
        torch.testing.assert_close(first, (module.example_inputs(2), module.example_target(2)))
        assert torch.equal(rng, torch.get_rng_state()), model.name
