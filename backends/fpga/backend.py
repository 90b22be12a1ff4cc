"""The FPGA backend behind the driver's `Backend` interface: for a plan that puts stages on
FPGA cards, their HLS projects under `OUT/stage_<i>/hls/` (`pipecc compile`) or the
C-simulated stages inside the drop-in module (`pipecc.compile`).

    check    the number format; one float32 tensor at each FPGA stage boundary
    writers  compile_fpga_stages into the compiled folder being written
    notes    where each FPGA stage's project is; the pipeline is inference-only
    module   mixed_pipelined_module: torch stages and C-simulated FPGA stages

A plan without FPGA stages gets no writer and no note (the driver does not choose this
backend for it). Plans with FPGA stages compile for training too, but the compiled folder is
inference-only (`pipecc.json`: "inference_only": true; FPGA stages have no backward pass):
`pipecc.load(OUT)` runs forward, a backward raises.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from torch import nn

from pipecc.backends.base import Backend, Target, Writer
from pipecc.backends.fpga.pipeline import check_boundary, compile_fpga_stages, mixed_pipelined_module
from pipecc.errors import PipeccError
from pipecc.ir.graph import AnnotatedGraph
from pipecc.ir.plan import Plan
from pipecc.techniques import capabilities as caps
from pipecc.targets.fpga_model import parse_number


class FpgaBackend(Backend):
    name = "fpga"
    # its folder runs under `pipecc run` like the torch backend's (FPGA stages in C simulation);
    # what an FPGA *stage* cannot do is its device kind's (`capabilities.DEVICE_KINDS["fpga"]`)
    capabilities = caps.COMPILED_FOLDER
    module_capabilities = caps.IN_PROCESS

    def check(self, graph: AnnotatedGraph, plan: Plan, stages: Sequence[Any], target: Target) -> None:
        """What can be checked without writing, so a bad plan fails before any file is."""
        cards = plan.fpga_stages()
        if not cards:
            return
        parse_number(target.number)
        by_index = {s.index: s for s in stages}
        for i, card in cards.items():
            if i not in by_index:
                raise PipeccError(f"the plan puts stage {i} on {card} but no such stage was cut")
            check_boundary(by_index[i], card)

    def writers(self, graph: AnnotatedGraph, plan: Plan, stages: Sequence[Any],
                target: Target) -> list[Writer]:
        if not plan.fpga_stages():
            return []
        inputs = tuple(target.example_inputs) if target.example_inputs is not None else None

        def write_fpga(folder: Path) -> None:
            compile_fpga_stages(folder, graph, plan, stages, inputs, target.number)
        return [write_fpga]

    def notes(self, plan: Plan, out: str | Path | None = None) -> list[str]:
        cards = plan.fpga_stages()
        if not cards:
            return []
        where = f"{out}/" if out is not None else ""
        lines = [f"stage {i} on {card}: HLS project {where}stage_{i}/hls (check it with "
                 f"`pipecc csim {out or 'OUT'} --stage {i}`)" for i, card in sorted(cards.items())]
        lines.append("FPGA stages run forward only: this pipeline is inference-only")
        return lines

    def module(self, model: nn.Module, graph: AnnotatedGraph, plan: Plan, stages: Sequence[Any],
               target: Target) -> nn.Module:
        """Each FPGA stage's HLS project written (into `target.fpga_dir`, else a temporary
        folder removed with the module), built with g++ and run in place of its torch stage."""
        return mixed_pipelined_module(model, graph, plan, stages, target.example_inputs,
                                      devices=target.devices, number=target.number,
                                      fpga_dir=target.fpga_dir)
