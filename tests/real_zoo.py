"""Real library models as a user brings them, and the checks the real-model suite runs on them.

Each entry is a model exactly as its library builds it: the library's own class or builder at a
small config, random weights, train mode with the dropout the config has, and only the inputs a
user must give (a forward argument with a default is left out unless a later positional input
needs it, e.g. T5's attention mask before `decoder_input_ids`). `write_model_file` turns an entry
into a model file for the command line (docs/model-files.md's convention: `build_model`,
`example_inputs`, `loss_fn`, `example_target`); tests/test_real_models.py and
bench/real_models.py run the same checks on the same files, so the pass table the bench prints is
what the suite asserts.

The checks (`CHECKS`): `cost` (matmul-class FLOPs, forward and backward, within 2 % of
FlopCounterMode's, the convention of tests/test_cost_reference.py, with torch's grouped-convolution
backward fixed: helpers.GROUPED_CONV_FIX), `compile` (`pipecc compile`
for 2xcpu with the defaults), `compile_r1` (with `--replicas 1`: a real two-stage pipeline),
`verify_train` (`pipecc run --verify` on the `--replicas 1` folder), `verify_eval` (`compile
--inference --replicas 1`, then `run --verify`: eval-mode outputs) and `dropin` (`pipecc.compile`
on 2xcpu: eval-mode outputs, their type, and the parameters' gradients equal the model's).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from helpers import GROUPED_CONV_FIX, pipecc_here, reference_flops

TESTS = Path(__file__).resolve().parent
BATCH = 4
FLOP_TOLERANCE = 0.02


# What a failing check reports: the last `pipecc: error:` line of the command, or the exception.
ERROR_PREFIX = "pipecc: error: "


@dataclass(frozen=True)
class RealModel:
    """One library model: how its model file builds it and what it is fed.

    `build` is the expression build_model returns; `inputs` and `target` are expressions of the
    batch size `b` and a seeded generator `g` (the data must be the same in every rank);
    `loss` is "tokens" (cross-entropy over [B, T, V] logits) or "labels" ([B, C] logits);
    `checks` limits a model kept to document a refusal to the checks that show it."""

    name: str
    library: str
    imports: str
    build: str
    inputs: str
    target: str
    loss: str
    checks: tuple[str, ...] = ()  # () = all of CHECKS
    zero_bubble: bool = False  # also verify_zb: `run --verify --schedule zb-h1` (encoder-decoders)


_TOKENS = "(torch.randint(0, 100, (b, 8), generator=g),)"
_TOKEN_TARGET = "torch.randint(0, 100, (b, 8), generator=g)"
_IMAGES = "(torch.randn(b, 3, 32, 32, generator=g),)"
# EfficientNet-B0 downsamples 32x: at 64x64 its last BatchNorms still see 2x2 maps (32x32 leaves
# 1x1 maps, BatchNorm over 2 values per channel per micro-batch: gradients of 1e6-1e9 that float32
# itself cannot resolve against float64, so no check can tell a right pipeline from a wrong one)
_IMAGES_64 = "(torch.randn(b, 3, 64, 64, generator=g),)"
_LABELS = "torch.randint(0, 10, (b,), generator=g)"
_HF = "import transformers"
_WAV2VEC2 = ("transformers.Wav2Vec2ForCTC(transformers.Wav2Vec2Config(vocab_size=32, hidden_size=64, "
             "num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, conv_dim=(32, 32), "
             "conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, "
             "num_conv_pos_embedding_groups=4{}))")
_AUDIO = "(torch.randn(b, 1600, generator=g),)"
_FRAMES = "torch.randint(0, 32, (b, 159), generator=g)"
_TV = "import torchvision"

MODELS: list[RealModel] = [
    RealModel("gpt2", "transformers", _HF,
              "transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, "
              "vocab_size=100, n_positions=32, bos_token_id=0, eos_token_id=0, use_cache=False))",
              _TOKENS, _TOKEN_TARGET, "tokens"),
    # NOTE: the decoders above and below set use_cache=False, as a training config does: with the
    # default the model also returns its key/value cache object; this row keeps the default
    RealModel("gpt2_use_cache", "transformers", _HF,
              "transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, "
              "vocab_size=100, n_positions=32, bos_token_id=0, eos_token_id=0))",
              _TOKENS, _TOKEN_TARGET, "tokens", checks=("cost", "compile")),
    RealModel("bert", "transformers", _HF,
              "transformers.BertForSequenceClassification(transformers.BertConfig(num_hidden_layers=2, "
              "hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=100, "
              "max_position_embeddings=32, num_labels=10))",
              _TOKENS, _LABELS, "labels"),
    # NOTE: forward(input_ids, attention_mask, decoder_input_ids, ...): the mask is given because
    # the decoder's ids come after it and model files pass inputs by position
    RealModel("t5", "transformers", _HF,
              "transformers.T5ForConditionalGeneration(transformers.T5Config(vocab_size=100, d_model=64, "
              "d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4, "
              "decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, use_cache=False))",
              "(torch.randint(2, 100, (b, 8), generator=g), torch.ones(b, 8, dtype=torch.long), "
              "torch.randint(2, 100, (b, 6), generator=g))",
              "torch.randint(0, 100, (b, 6), generator=g)", "tokens", zero_bubble=True),
    RealModel("llama", "transformers", _HF,
              "transformers.LlamaForCausalLM(transformers.LlamaConfig(hidden_size=64, intermediate_size=128, "
              "num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=100, "
              "max_position_embeddings=32, bos_token_id=0, eos_token_id=0, use_cache=False))",
              _TOKENS, _TOKEN_TARGET, "tokens"),
    RealModel("vit_hf", "transformers", _HF,
              "transformers.ViTForImageClassification(transformers.ViTConfig(image_size=32, patch_size=8, "
              "hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, "
              "num_labels=10))",
              _IMAGES, _LABELS, "labels"),
    # 1600 samples of audio: two conv layers (stride 5, 2) give 159 frames. NOTE: layerdrop=0.0
    # and mask_time_prob=0.0, as a config without those regularisers has: the default layerdrop
    # (0.1) skips encoder layers on a torch.rand() read in Python, and the default SpecAugment
    # (mask_time_prob=0.05) draws its masks with np.random, which a graph would freeze; both are
    # refused at capture, and the two rows after it keep one default each to show the refusal
    RealModel("wav2vec2", "transformers", _HF, _WAV2VEC2.format(", layerdrop=0.0, mask_time_prob=0.0"),
              _AUDIO, _FRAMES, "tokens"),
    RealModel("wav2vec2_layerdrop", "transformers", _HF, _WAV2VEC2.format(", mask_time_prob=0.0"),
              _AUDIO, _FRAMES, "tokens", checks=("cost", "compile")),
    RealModel("wav2vec2_specaugment", "transformers", _HF, _WAV2VEC2.format(", layerdrop=0.0"),
              _AUDIO, _FRAMES, "tokens", checks=("cost", "compile")),
    # an encoder-decoder speech model: the decoder's tokens are a model input only the last stage
    # reads (item 6: the planner chose zb-h1 for it, whose split backward broke there)
    RealModel("whisper", "transformers", _HF,
              "transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(vocab_size=100, "
              "num_mel_bins=16, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, "
              "decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_source_positions=16, "
              "max_target_positions=16, decoder_start_token_id=0, pad_token_id=0, bos_token_id=0, "
              "eos_token_id=0, use_cache=False))",
              "(torch.randn(b, 16, 32, generator=g), torch.ones(b, 32, dtype=torch.long), "
              "torch.randint(2, 100, (b, 6), generator=g))",
              "torch.randint(0, 100, (b, 6), generator=g)", "tokens", zero_bubble=True),
    RealModel("resnet18", "torchvision", _TV, "torchvision.models.resnet18(num_classes=10)",
              _IMAGES, _LABELS, "labels"),
    RealModel("mobilenet_v3_small", "torchvision", _TV,
              "torchvision.models.mobilenet_v3_small(num_classes=10)", _IMAGES, _LABELS, "labels"),
    RealModel("efficientnet_b0", "torchvision", _TV, "torchvision.models.efficientnet_b0(num_classes=10)",
              _IMAGES_64, _LABELS, "labels"),
    RealModel("convnext_tiny", "torchvision", _TV, "torchvision.models.convnext_tiny(num_classes=10)",
              _IMAGES, _LABELS, "labels"),
    RealModel("swin_t", "torchvision", _TV, "torchvision.models.swin_t(num_classes=10)",
              _IMAGES, _LABELS, "labels"),
    # the builder fixes the widths (patch 16, 12 layers of 768); only the image size is free
    RealModel("vit_b_16", "torchvision", _TV, "torchvision.models.vit_b_16(image_size=32, num_classes=10)",
              _IMAGES, _LABELS, "labels"),
    RealModel("vit_tiny_timm", "timm", "import timm",
              "timm.create_model('vit_tiny_patch16_224', pretrained=False, img_size=32, num_classes=10)",
              _IMAGES, _LABELS, "labels"),
]
BY_NAME = {m.name: m for m in MODELS}
CHECKS = ["cost", "compile", "compile_r1", "verify_train", "verify_eval", "dropin", "verify_zb"]


def checks_of(model: RealModel) -> list[str]:
    """The checks the suite runs on `model`, in CHECKS order (verify_zb where zero_bubble)."""
    return [c for c in CHECKS if (not model.checks or c in model.checks)
            and (c != "verify_zb" or model.zero_bubble)]

_FILE = '''\
"""{name}: {library}'s model as the library builds it (random weights); written by
tests/real_zoo.py for the real-model suite."""
import torch
import torch.nn.functional as F
{imports}


def build_model():
    return {build}


def example_inputs(batch_size=1):
    b, g = batch_size, torch.Generator().manual_seed(0)
    return {inputs}


def example_target(batch_size=1):
    b, g = batch_size, torch.Generator().manual_seed(1)
    return {target}


def _logits(outputs):
    if isinstance(outputs, torch.Tensor):
        return outputs
    return outputs["logits"] if isinstance(outputs, dict) else outputs[0]


def loss_fn(outputs, target):
    logits = _logits(outputs)
    return {loss}
'''
_LOSSES = {"tokens": "F.cross_entropy(logits.flatten(0, 1), target.flatten())",
           "labels": "F.cross_entropy(logits, target)"}


def write_model_file(model: RealModel, folder: Path) -> Path:
    """The model file for `model` in `folder` (named after it)."""
    path = folder / f"{model.name}.py"
    path.write_text(_FILE.format(name=model.name, library=model.library,
                                 imports=model.imports, build=model.build, inputs=model.inputs,
                                 target=model.target, loss=_LOSSES[model.loss]))
    return path


# ----------------------------------------------------------------------------- the checks
class CheckFailed(AssertionError):
    """A check's failure, in one line (what the pass table shows and the xfail reasons hold)."""


def one_line(exc: BaseException) -> str:
    """An exception as one line: its type and the first line of its message (for
    torch.testing.assert_close also which item differs and by how much)."""
    text = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    keep = text[:1] + [ln for ln in text[1:] if ln.startswith(("Mismatched elements", "Greatest absolute",
                                                              "The failure occurred"))]
    return f"{type(exc).__name__}: {' '.join(keep)}".strip()


def _cli(*argv: str) -> str:
    """`pipecc ARGV` in this process (helpers.pipecc_here: the model's library is imported once,
    not by a python per command; `run` still launches torchrun and its ranks, bounded by the
    run's own --timeout); its stdout, or CheckFailed with its last error line."""
    result = pipecc_here(*argv)
    if result.returncode != 0:
        lines = [ln for ln in (result.stderr + result.stdout).splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith(ERROR_PREFIX)]
        last = errors[-1] if errors else (lines[-1] if lines else "(no output)")
        raise CheckFailed(f"exit {result.returncode}: {last.removeprefix(ERROR_PREFIX)}")
    return result.stdout


def load(path: Path) -> Any:
    """The model file's ModelSpec at the suite's batch size (the model in train mode)."""
    from pipecc.frontend.modelfile import load_model_file
    torch.manual_seed(0)
    return load_model_file(path, batch_size=BATCH)


def check_cost(path: Path) -> str:
    """Matmul-class FLOPs against FlopCounterMode's; the forward and backward ratios."""
    from pipecc import cost, driver
    spec = load(path)
    graph = driver.analyze_module(spec.model, spec.example_inputs, model_name=path.stem)
    totals = cost.totals(graph)
    ref_fwd, ref_bwd = reference_flops(spec.model, spec.example_inputs, spec.loss_fn,
                                       spec.make_target(BATCH), mapping=GROUPED_CONV_FIX,
                                       device="cpu")
    fwd = totals["forward_flops_matmul"] / ref_fwd
    bwd = totals["backward_flops_matmul"] / ref_bwd
    ratios = f"{fwd:.3f}/{bwd:.3f}"
    if abs(fwd - 1) > FLOP_TOLERANCE or abs(bwd - 1) > FLOP_TOLERANCE:
        raise CheckFailed(f"matmul FLOPs forward/backward are {ratios} of FlopCounterMode's")
    return ratios


def check_compile(path: Path, out: Path, *flags: str) -> str:
    """`pipecc compile PATH --devices 2xcpu -b BATCH -o OUT FLAGS`: the plan's stages x replicas."""
    import json
    _cli("compile", str(path), "--devices", "2xcpu", "-b", str(BATCH), "-o", str(out), *flags)
    plan = json.loads((out / "plan.json").read_text())
    n = len(plan["stages"])
    return f"{n} stage{'s' if n != 1 else ''} x {plan.get('replicas', 1)}"


def check_verify(out: Path, *flags: str) -> str:
    """`pipecc run OUT --steps 1 --verify FLAGS`."""
    _cli("run", str(out), "--steps", "1", "--verify", *flags)
    return "ok"


def _leaves(value: Any) -> dict[str, torch.Tensor]:
    """The tensors of a model output by key (ModelOutput and dict by key, tuple by position)."""
    if isinstance(value, torch.Tensor):
        return {"": value}
    items = value.items() if isinstance(value, dict) else enumerate(value)
    return {str(k): v for k, v in items if isinstance(v, torch.Tensor)}


def check_dropin(path: Path) -> str:
    """`pipecc.compile(model, inputs, "2xcpu")` in eval mode (dropout off, so one pass is the
    reference): the same outputs of the same type, and the same gradients on the parameters."""
    import pipecc
    spec = load(path)
    model, inputs = spec.model, spec.example_inputs
    reference = copy.deepcopy(model).eval()
    pm = pipecc.compile(model, inputs, "2xcpu")
    pm.eval()
    target = spec.make_target(BATCH)
    got, want = pm(*inputs), reference(*inputs)
    try:
        torch.testing.assert_close(_leaves(got), _leaves(want))
    except AssertionError as e:
        raise CheckFailed(f"drop-in outputs differ: {one_line(e)}") from None
    if type(got) is not type(want):
        raise CheckFailed(f"drop-in returns {type(got).__name__} where the model returns {type(want).__name__}")
    spec.loss_fn(got, target).backward()
    spec.loss_fn(want, target).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if (p.grad is None) != (q.grad is None):
            raise CheckFailed(f"drop-in gradient of {name}: {p.grad is not None} vs the model's {q.grad is not None}")
        if p.grad is not None:
            try:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
            except AssertionError as e:
                raise CheckFailed(f"drop-in gradient of {name} differs: {one_line(e)}") from None
    return "ok"


class ModelRun:
    """The checks of one model over one scratch folder, each run at most once: the compiled
    folders are reused (verify_train runs on compile_r1's folder), so a model costs three
    compiles and two torchrun runs. `result(check)` is ("pass", detail) or ("fail", error)."""

    def __init__(self, model: RealModel, folder: Path) -> None:
        self.model, self.folder = model, folder
        self.path = write_model_file(model, folder)
        self.results: dict[str, tuple[str, str]] = {}

    def _run(self, check: str) -> str:
        out = self.folder
        steps: dict[str, Callable[[], str]] = {
            "cost": lambda: check_cost(self.path),
            "compile": lambda: check_compile(self.path, out / "default"),
            "compile_r1": lambda: check_compile(self.path, out / "r1", "--replicas", "1"),
            "verify_train": lambda: self._after("compile_r1") or check_verify(out / "r1"),
            "verify_eval": lambda: (check_compile(self.path, out / "inference", "--inference", "--replicas", "1")
                                    and check_verify(out / "inference")),
            "dropin": lambda: check_dropin(self.path),
            "verify_zb": lambda: self._after("compile_r1") or check_verify(out / "r1", "--schedule", "zb-h1"),
        }
        return steps[check]()

    def _after(self, check: str) -> None:
        status, detail = self.result(check)
        if status != "pass":
            raise CheckFailed(f"needs {check}: {detail}")

    def result(self, check: str) -> tuple[str, str]:
        if check not in self.results:
            try:
                self.results[check] = ("pass", self._run(check))
            except CheckFailed as e:
                self.results[check] = ("fail", str(e))
            except Exception as e:  # noqa: BLE001 — the library's or pipecc's error, reported
                self.results[check] = ("fail", one_line(e))
        return self.results[check]

