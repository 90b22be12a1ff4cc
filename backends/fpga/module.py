"""FpgaStageModule: a C-simulated FPGA stage as an nn.Module, so it can run inside a CPU
pipeline. Forward calls the stage's shared library (csim.build) through ctypes; there is no
backward — plans with FPGA stages are inference-only.
"""

from __future__ import annotations

import ctypes
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .csim import CsimError, build

_ERRORS = {-1: "weights not loaded", -2: "exception in the C simulation",
           -3: "FIFO deadlock", -4: "wrong number of output beats"}


class _NoBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, anchor: torch.Tensor, run: Any, name: str) -> torch.Tensor:
        ctx.stage = name
        return run(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        raise RuntimeError(f"FPGA stage {ctx.stage} has no backward pass: plans with FPGA "
                           "stages are inference-only (run them under torch.no_grad())")


class FpgaStageModule(nn.Module):
    """Runs `stage_dir`'s C simulation as the forward of a pipeline stage (float32 in/out)."""

    def __init__(self, stage_dir: str | Path, threaded: bool = False) -> None:
        super().__init__()
        self.stage_dir = Path(stage_dir).resolve()
        meta = json.loads((self.stage_dir / "stage.json").read_text())
        self.top: str = meta["top"]
        self.in_shape = tuple(meta["in_shape"])
        self.out_shape = tuple(meta["out_shape"])
        self.build = build(self.stage_dir)
        self._lib = ctypes.CDLL(str(self.build.lib))
        self._lib.run_stage_batch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        self._lib.pipecc_last_error.restype = ctypes.c_char_p
        self._lib.pipecc_configure(int(threaded), 0)
        weights = str(self.stage_dir / "firmware" / "weights").encode()
        if self._lib.pipecc_init(weights) != 0:
            raise CsimError(f"{self.top}: cannot load weights from {weights.decode()}")

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape[1:]) != self.in_shape:
            raise ValueError(f"{self.top} expects (batch, {', '.join(map(str, self.in_shape))}), "
                             f"got {tuple(x.shape)}")
        xs = np.ascontiguousarray(x.detach().cpu().numpy(), dtype=np.float32)
        ys = np.empty((x.shape[0], *self.out_shape), dtype=np.float32)
        rc = self._lib.run_stage_batch(xs.ctypes.data, ys.ctypes.data, int(x.shape[0]))
        if rc != 0:
            detail = self._lib.pipecc_last_error().decode(errors="replace")
            raise CsimError(f"{self.top}: {_ERRORS.get(rc, rc)}: {detail}")
        return torch.from_numpy(ys).to(x.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The anchor puts the output on the autograd graph whenever grad mode is on, so a
        # backward through this stage raises even when `x` needs no grad (an FPGA first stage):
        # its torch parameters would otherwise silently get no gradient.
        anchor = torch.zeros((), requires_grad=torch.is_grad_enabled())
        return _NoBackward.apply(x, anchor, self._run, self.top)

    def extra_repr(self) -> str:
        return f"{self.top}, in={self.in_shape}, out={self.out_shape}"
