"""Shared test helpers: the zoo at tiny size and the reference FLOP counter."""
from __future__ import annotations

import contextlib
import copy
import importlib
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode, conv_flop_count

ROOT = Path(__file__).resolve().parents[1]
ZOO = ["bert", "chargpt", "digits_cnn", "gnmt", "gpt", "mlp", "resnet50", "tiny_cnn", "vgg16"]


def zoo_module(name: str) -> Any:
    return importlib.import_module(f"pipecc.models.{name}")


def zoo_path(name: str) -> Path:
    return ROOT / "models" / f"{name}.py"


def _mv_flop(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * a_shape[0] * a_shape[1]


def _dot_flop(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * a_shape[0]


# FlopCounterMode does not count matrix-vector products (aten.mv, aten.dot); we do.
REFERENCE_EXTRAS = {torch.ops.aten.mv: _mv_flop, torch.ops.aten.dot: _dot_flop}


def _conv_backward_flop(grad_out_shape, x_shape, w_shape, _bias, _stride, _padding, _dilation,
                        transposed, _output_padding, groups, output_mask, out_shape=None,
                        **kwargs) -> int:
    """convolution_backward as torch 2.13 counts it, but with the weight gradient of a grouped
    convolution divided by `groups` (torch counts it as if groups were 1: pytorch PR #183405;
    tests/test_cost_formulas.py documents the bug against the unfixed reference). Each group's
    weight gradient correlates its own input channels with its own output channels."""
    def t(shape):  # swap the batch and channel dimensions
        return [shape[1], shape[0], *shape[2:]]
    flops = 0
    if output_mask[0]:
        flops += conv_flop_count(grad_out_shape, w_shape, out_shape[0], not transposed)
    if output_mask[1]:
        a, b = (grad_out_shape, x_shape) if transposed else (x_shape, grad_out_shape)
        flops += conv_flop_count(t(a), t(b), t(out_shape[1]), transposed=False) // groups
    return flops


# The reference with torch's grouped-convolution backward fixed (depthwise convolutions:
# MobileNet, EfficientNet, ConvNeXt); the zoo has none and keeps REFERENCE_EXTRAS.
GROUPED_CONV_FIX = {**REFERENCE_EXTRAS, torch.ops.aten.convolution_backward: _conv_backward_flop}


def reference_flops(model: torch.nn.Module, inputs: tuple, loss=None, target=None,
                    mapping: dict | None = None, device: str = "meta") -> tuple[int, int]:
    """FlopCounterMode forward and backward totals, run on the meta device.

    On CPU, torch's fused LSTM and flash-attention kernels are invisible to FlopCounterMode;
    on meta they decompose into the mm/bmm calls it counts, which is the convention we follow.
    `mapping` replaces REFERENCE_EXTRAS (tests/real_zoo.py adds GROUPED_CONV_FIX to it).
    `device="cpu"` runs a copy for real, with scaled_dot_product_attention held to its math
    path (the same mm/bmm calls), for models whose forward reads data (`.item()`, `.all()` in
    Hugging Face's mask code), which the meta device cannot; it has no view into fused LSTMs.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel
    mapping = REFERENCE_EXTRAS if mapping is None else mapping
    model = copy.deepcopy(model).to(device)
    moved = tuple(x.detach().to(device).requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor)
                  else x for x in inputs)
    with sdpa_kernel(SDPBackend.MATH) if device == "cpu" else contextlib.nullcontext():
        with FlopCounterMode(display=False, custom_mapping=mapping) as fc:
            model(*moved)
        forward = fc.get_total_flops()
        with FlopCounterMode(display=False, custom_mapping=mapping) as fc:
            out = model(*moved)
            if loss is not None:
                t = target.to(device) if isinstance(target, torch.Tensor) else target
                loss(out, t).backward()
            else:
                out.float().sum().backward()
    return forward, fc.get_total_flops() - forward


# ----------------------------------------------------------------------------- the CLI in tests
# The console script's entry point, run by this interpreter (the `pipecc` script may not be on
# PATH in a venv that was not activated).
PIPECC = [sys.executable, "-c", "import sys; from pipecc.cli import main; sys.exit(main())"]
MLP_TINY = {"in_features": 16, "hidden": 32, "depth": 3, "num_classes": 5}  # models/mlp.py TINY


def model_args(kwargs: dict[str, Any]) -> list[str]:
    """`--model-arg` values (KEY=VALUE) for a dict of build_model arguments."""
    return [f"{k}={v}" for k, v in kwargs.items()]


MLP_ARGS = model_args(MLP_TINY)  # the tiny MLP's `--model-arg` values


def model_arg_flags(kwargs: dict[str, Any]) -> list[str]:
    """`--model-arg KEY=VALUE` pairs, flattened, for a dict of build_model arguments."""
    return [flag for arg in model_args(kwargs) for flag in ("--model-arg", arg)]


def compile_mlp(out: Path, *extra: str, devices: str = "2xcpu", replicas: int | None = 1,
                batch: int = 8, microbatches: int | None = 2, args: dict[str, Any] = MLP_TINY) -> Path:
    """`pipecc compile models/mlp.py` in this process (quiet; every device a stage): the tiny
    MLP unless `args` says otherwise; `replicas` / `microbatches` None leave the flag out."""
    from pipecc import cli
    argv = ["compile", str(ROOT / "models" / "mlp.py"), "--devices", devices, "--use-all-devices",
            "-o", str(out), "-b", str(batch), "-q", *model_arg_flags(args)]
    if replicas is not None:
        argv += ["--replicas", str(replicas)]
    if microbatches is not None:
        argv += ["-m", str(microbatches)]
    assert cli.main([*argv, *extra]) == 0
    return out


def copy_folder(src: Path, dst: Path) -> Path:
    """A copy of a compiled folder at `dst`, for a test that edits or runs it (a shared fixture's
    folder is read-only: tests/conftest.py)."""
    import shutil
    return Path(shutil.copytree(src, dst))


def run_pipecc(*argv: str, timeout: float = 120, cwd: Path = ROOT,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`pipecc ARGV` in a child process (one thread per process, unbuffered output); `env`
    adds to (or replaces in) this process's environment."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([*PIPECC, *argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _print_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """What python does with a warning outside pytest: its formatted line on stderr."""
    import warnings
    try:
        (file or sys.stderr).write(warnings.formatwarning(message, category, filename, lineno, line))
    except OSError:
        pass


def pipecc_here(*argv: str) -> subprocess.CompletedProcess:
    """`pipecc ARGV` in this process, as `run_pipecc` returns it (exit code, stdout, stderr):
    for plan, compile and inspect, which need no process of their own (a python that imports
    torch: seconds of CPU each), and for `run` where the launcher's process is not what a test
    checks (torchrun and its ranks are processes either way; this one only saves the launcher's
    python, and the run's own --timeout bounds it). Usage errors return argparse's exit code;
    warnings are printed to its stderr under python's default filters, as a process shows them
    (pytest would otherwise record them, and a test counting stderr lines would not see them)."""
    import io
    import warnings
    from pipecc import cli
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr), warnings.catch_warnings():
        warnings.showwarning = _print_warning
        warnings.resetwarnings()
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", category)  # python's default filters (sys.warnoptions empty)
        warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
        try:
            code = cli.main(list(argv))
        except SystemExit as e:  # argparse's usage errors (exit 2), as the process would end
            code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1  # a message: 1
    return subprocess.CompletedProcess(["pipecc", *argv], code, stdout.getvalue(), stderr.getvalue())


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """`pipecc ARGV` in this process: (exit code, stdout, stderr)."""
    from pipecc import cli
    code = cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for rendezvous endpoints)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rehash(out: Path) -> None:
    """Re-record the sha256 of a compiled folder's code and weights after a test edited them on
    purpose (`pipecc.runtime.folder_sums`: an edit is otherwise refused before the edited file runs)."""
    import json as _json

    from pipecc.runtime import folder_sums
    marker = _json.loads((out / "pipecc.json").read_text())
    marker[folder_sums.KEY] = folder_sums.record(out)
    (out / "pipecc.json").write_text(_json.dumps(marker))
