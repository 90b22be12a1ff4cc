"""FPGA backend: a pipeline stage placed on an FPGA card -> the Vitis HLS project an FPGA
engineer takes over, proved by C simulation with g++.

    lower (fx stage -> layers, BN folded)  ─►  codegen (templates/ -> stage_<i>/)
    ─►  csim (g++ testbench + shared library; golden data from torch)  ─►  FpgaStageModule

`pipeline` puts those stages into a compiled folder or a drop-in module; `backend.FpgaBackend`
is that behind the driver's Backend interface (not imported here: the distributed runtime
imports this package for an FPGA stage's rank and needs no compiler interface).

The cost model and the op-support rules live in `pipecc.targets.fpga_model` so the planner (which
must not import backends/) uses the same numbers as `estimates.json`.
"""

from pipecc.targets.fpga_model import SUPPORTED_KINDS, UnsupportedOpError, supported

from .codegen import write_fpga_stage
from .csim import CsimError, CsimResult, build, csim, toolchain_problem
from .module import FpgaStageModule

__all__ = ["SUPPORTED_KINDS", "UnsupportedOpError", "supported", "write_fpga_stage", "csim",
           "build", "CsimResult", "CsimError", "toolchain_problem", "FpgaStageModule"]
