"""What a unit of the graph costs on one device: the per-device time and memory model the
balance pass asks, and its roofline implementation for CPUs and GPUs.

    DeviceCosts              one device's answers, whatever the kind of device:
      unit_times(units, mb)    [unit] forward and backward seconds per micro-batch of mb
      weight_share(units, mb)  [unit] the share of the backward seconds that computes weight
                               gradients (a zero-bubble schedule's W; the rest is its I)
      floor_times(mb)          times no stage holding the unit can beat (for the lower bound),
                               None when unit_times already are such a floor
      stage_times(...)         a stage's unit times re-costed as a whole, None when the sum
                               of unit times already is the stage's time
      memory(units, v)         what a stage's memory is counted in, and what it may hold
      one_tensor_boundaries    True when a stage on the device takes and sends one float32
                               tensor only (the partitioner then blocks other cuts)
    RooflineCosts            CPUs and GPUs: `Device.compute_time`, memory in DRAM
    fpga_timing.FpgaCosts    FPGA cards: the FPGA model behind estimates.json, memory in BRAM

Roofline: forward on the forward FLOPs and bytes, backward on the backward FLOPs and twice the
bytes (it reads the output gradient and the stash and writes the input gradient); a split
backward's W share is the roofline of the weight-gradient FLOPs over the roofline of the
input- and weight-gradient FLOPs, each with the bytes in proportion to its FLOPs. Memory per
stage: weights, gradients and optimizer state (Adam: 2 fp32 moments, so 4x the weights' bytes
in training), plus the activations stashed per micro-batch in flight, against the device's
memory less headroom.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Protocol

import numpy as np

from pipecc.targets.hardware import Device

if TYPE_CHECKING:
    import torch.fx as fx

# NOTE: a finite stand-in for "cannot run here", the one sentinel of the planner: the
# partitioner's bisection needs finite costs, so a unit a device cannot run and a cut the
# partitioner must not use cost this; a bottleneck at or above it means no allowed placement.
CANNOT_RUN_S = 1e9
MEMORY_HEADROOM = 0.9  # framework workspace, allocator fragmentation: plan to 90% of capacity


class UnitNumbers(Protocol):
    """The per-unit numbers a cost model reads (`pipecc.passes.units.Units` has them)."""

    values: Mapping[str, np.ndarray]   # cost fields -> [unit] at the micro-batch size
    param_bytes: np.ndarray            # [unit] weight bytes


@dataclass(frozen=True)
class StageMemory:
    """A stage's memory on one device: M = Σ static + inflight · (Σ act + bytes received)."""

    static: np.ndarray         # [unit] bytes held for the whole iteration
    act: np.ndarray            # [unit] bytes stashed per micro-batch in flight
    cap: float                 # usable bytes
    inflight: int | None = None  # micro-batches stashed at once; None: what the schedule says
    what: str = ""             # where the memory is, when not the device's DRAM ("on-chip BRAM")


class DeviceCosts(ABC):
    """One device's time and memory model (module docstring). Defaults: additive unit times
    that are their own floor, every cut allowed, every node runnable."""

    one_tensor_boundaries: bool = False

    def __init__(self, device: Device) -> None:
        self.device = device

    @abstractmethod
    def unit_times(self, units: UnitNumbers, mb: int) -> tuple[np.ndarray, np.ndarray]:
        """[unit] forward and backward seconds per micro-batch of `mb` samples; CANNOT_RUN_S
        for units the device cannot run."""

    @abstractmethod
    def memory(self, units: UnitNumbers, stages_per_device: int) -> StageMemory:
        """What a stage of these units holds on the device (one of `stages_per_device`)."""

    def weight_share(self, units: UnitNumbers, mb: int) -> np.ndarray:
        """[unit] share (0..1) of the unit's backward seconds that is weight-gradient work.
        Default: the cost model's FLOP fraction (`pipecc.cost`: dW products over all)."""
        v = units.values
        return _fraction(v["backward_weight_flops"], v["backward_flops"])

    def floor_times(self, mb: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Per-unit times no stage holding the unit beats; None: `unit_times` are that."""
        return None

    def stage_times(self, units: range, fwd: np.ndarray,
                    mb: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The stage of `units` (whose unit forward times are `fwd`) re-costed as a whole:
        new forward and backward unit times. None: the sum of unit times is the stage time."""
        return None

    def unsupported_nodes(self) -> list[fx.Node]:
        """Nodes the device cannot run at all (for error messages), in graph order."""
        return []

    def plan_options(self) -> dict[str, Any]:
        """What the plan's `options` record about how this device was costed."""
        return {}


class RooflineCosts(DeviceCosts):
    """CPUs and GPUs: `Device.compute_time` per unit; weights, gradients, optimizer state and
    stashed activations in the device's memory, planned to MEMORY_HEADROOM of it."""

    def __init__(self, device: Device, dtype: str = "fp32", training: bool = True,
                 optimizer_states: int = 2) -> None:
        super().__init__(device)
        self.dtype, self.training, self.optimizer_states = dtype, training, optimizer_states

    def unit_times(self, units: UnitNumbers, mb: int) -> tuple[np.ndarray, np.ndarray]:
        v, dev = units.values, self.device
        n = len(units.param_bytes)
        fwd, bwd = np.zeros(n), np.zeros(n)
        for u in range(n):
            fwd[u] = dev.compute_time(v["forward_flops"][u], v["forward_flops_matmul"][u],
                                      v["bytes_moved"][u], self.dtype)
            bwd[u] = dev.compute_time(v["backward_flops"][u], v["backward_flops_matmul"][u],
                                      2 * v["bytes_moved"][u], self.dtype) \
                if self.training else 0.0
        return fwd, bwd

    def weight_share(self, units: UnitNumbers, mb: int) -> np.ndarray:
        """The roofline of the weight-gradient part over the roofline of both parts (module
        docstring): matmul-class and other FLOPs run at different peaks on a GPU, so this can
        differ from the FLOP fraction."""
        v, dev = units.values, self.device
        share = np.zeros(len(units.param_bytes))
        for u in range(len(share)):
            total, weight = float(v["backward_flops"][u]), float(v["backward_weight_flops"][u])
            if total <= 0 or weight <= 0:
                continue
            moved = 2 * float(v["bytes_moved"][u])  # as unit_times' backward
            w = dev.compute_time(weight, v["backward_weight_flops_matmul"][u],
                                 moved * weight / total, self.dtype)
            i = dev.compute_time(total - weight,
                                 max(float(v["backward_flops_matmul"][u])
                                     - float(v["backward_weight_flops_matmul"][u]), 0.0),
                                 moved * (total - weight) / total, self.dtype)
            share[u] = w / (w + i) if w + i > 0 else 0.0
        return share

    def memory(self, units: UnitNumbers, stages_per_device: int) -> StageMemory:
        states = (2 + self.optimizer_states) if self.training else 1
        act = units.values["stash_bytes"] if self.training else np.zeros(len(units.param_bytes))
        return StageMemory(static=units.param_bytes * states, act=act,
                           cap=self.device.memory_bytes * MEMORY_HEADROOM / stages_per_device)


def _fraction(part: np.ndarray, whole: np.ndarray) -> np.ndarray:
    """part / whole elementwise, 0 where whole is 0, clipped to [0, 1]."""
    part, whole = np.asarray(part, dtype=float), np.asarray(whole, dtype=float)
    out = np.divide(part, whole, out=np.zeros_like(whole), where=whole > 0)
    return np.clip(out, 0.0, 1.0)
