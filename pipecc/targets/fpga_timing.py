"""What a unit costs on an FPGA card: the FPGA model that writes estimates.json
(`pipecc.targets.fpga_model`) behind the `DeviceCosts` interface of `pipecc.targets.timing`.

A unit costs what the model gives its processes, (latency + (mb-1)·interval) / f_clk, summed
over a stage for the exact partitioner (which needs additive costs); the chosen partition's
FPGA stages are re-costed with the model's dataflow time of the whole stage (`stage_times`),
so the plan and estimates.json agree. The lower bound uses the MAC floor (`floor_times`).
Units with an op the FPGA backend cannot generate cost CANNOT_RUN_S, and cuts next to an
FPGA stage must carry exactly one float32 tensor (`one_tensor_boundaries`), which keeps what
the backend cannot build off FPGAs. A stage's memory is its on-chip BRAM: the generated design
keeps weights and frame buffers there; activations stashed for a training backward would live
in the card's DDR and are not modelled. Backward (training) is costed as twice the forward, as
a dataflow design of the transposed products would take; the FPGA backend itself generates
inference only (see `pipecc run`).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch.fx as fx

from pipecc.ir.graph import AnnotatedGraph
from pipecc.targets import fpga_model
from pipecc.targets.hardware import Device
from pipecc.targets.timing import CANNOT_RUN_S, DeviceCosts, StageMemory, UnitNumbers

BRAM18_BYTES = 18 * 1024 / 8  # one BRAM18 block: an FPGA stage's memory is counted in these


class FpgaCosts(DeviceCosts):
    """One FPGA card, costing the units `groups` (fx nodes of each unit, graph order) of
    `graph` in the number format `number` (float, ap_fixed<W,I>, or a dtype name)."""

    one_tensor_boundaries = True

    def __init__(self, device: Device, graph: AnnotatedGraph, groups: Sequence[Sequence[fx.Node]],
                 number: str, training: bool = True) -> None:
        super().__init__(device)
        self.graph, self.groups, self.number, self.training = graph, groups, number, training
        self._cycles: np.ndarray | None = None

    def cycles(self) -> np.ndarray:
        """[unit] (latency, interval, floor, clock, bram18) of each unit on the card
        (`fpga_model.unit_cycles`); NaN rows for units the FPGA backend cannot generate."""
        if self._cycles is None:
            rows = np.full((len(self.groups), 5), np.nan)
            for u, g in enumerate(self.groups):
                nodes = [n for n in g if n.op != "get_attr"]
                if not all(fpga_model.supported(n) for n in nodes):
                    continue
                try:  # lowering also judges a node in context (a broadcasting add, ...)
                    rows[u] = fpga_model.unit_cycles(nodes, self.device, self.number,
                                                     gm=self.graph.gm, point=self.graph.point)
                except fpga_model.UnsupportedOpError:
                    continue
            self._cycles = rows
        return self._cycles

    def _times(self, fwd: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        fwd = np.where(np.isnan(fwd), CANNOT_RUN_S, fwd)
        return fwd, (2 * fwd if self.training else np.zeros_like(fwd))

    def unit_times(self, units: UnitNumbers, mb: int) -> tuple[np.ndarray, np.ndarray]:
        """(latency + (mb-1)·interval) / f_clk of each unit's processes."""
        c = self.cycles()
        return self._times((c[:, 0] + (mb - 1) * c[:, 1]) / c[:, 3])

    def floor_times(self, mb: int) -> tuple[np.ndarray, np.ndarray]:
        """The MAC floor mb·floor / f_clk, which no stage holding the unit can beat (the
        additive unit times may exceed a dataflow stage's); units whose on-chip memory alone
        exceeds the card cannot run here."""
        c = self.cycles()
        fwd, bwd = self._times(mb * c[:, 2] / c[:, 3])
        big = np.nan_to_num(c[:, 4]) > self.device.fpga["bram18"]
        fwd[big] = bwd[big] = CANNOT_RUN_S
        return fwd, bwd

    def stage_times(self, units: range, fwd: np.ndarray,
                    mb: int) -> tuple[np.ndarray, np.ndarray] | None:
        """`fwd` scaled to the FPGA model's dataflow time of the whole stage (what
        estimates.json says); None when the stage cannot be lowered as a whole."""
        nodes = [n for u in units for n in self.groups[u] if n.op != "get_attr"]
        try:
            exact = fpga_model.stage_time_s(nodes, self.device, self.number, mb,
                                            gm=self.graph.gm, point=self.graph.point)
        except fpga_model.UnsupportedOpError:
            return None
        total = fwd.sum()
        if total <= 0:
            return None
        fwd = fwd * (exact / total)
        return fwd, (2 * fwd if self.training else np.zeros_like(fwd))

    def memory(self, units: UnitNumbers, stages_per_device: int) -> StageMemory:
        """Per unit the BRAM18 that `fpga_model.unit_cycles` says, against the card's."""
        static = np.nan_to_num(self.cycles()[:, 4]) * BRAM18_BYTES
        return StageMemory(static=static, act=np.zeros(len(static)),
                           cap=self.device.fpga["bram18"] * BRAM18_BYTES, inflight=0,
                           what="on-chip BRAM")

    def unsupported_nodes(self) -> list[fx.Node]:
        return [n for g in self.groups for n in g if not fpga_model.supported(n)]

    def plan_options(self) -> dict[str, Any]:
        return {"fpga_number": fpga_model.parse_number(self.number).text}
