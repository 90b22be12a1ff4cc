"""Fixed costs: what a device spends per call, per micro-batch, per step and per message,
whatever the work (issue #20's "fixed costs"). The one cost model adds these to the roofline
or the profiled curves; `pipecc profile` measures them on the machine, with as many ranks
running as the plan will have (its document's ``"fixed_costs"`` section overrides the defaults).

    FixedCosts          one device's figures (every field in seconds) and where they came from
    fixed_costs_for     the figures the planner uses for a device: the profile's measured ones
                        where the profile has that device, else the kind's defaults
    HALF_RATE_WORK      per device kind, the work (FLOPs) at which a matmul-class kernel runs
                        at half its attainable rate (small kernels do not reach peak)
    MICROBATCH_FORWARD_SHARE  the forward action's part of `microbatch_s`
    host_share          how many ranks share each host core (the rule for ranks > cores)

How the one cost model (`pipecc.passes.plan_costs.CostTables`) uses them, per stage of one
micro-batch on a device (docs/numbers.md, "Fixed costs"):

    forward  = Σ_units roofline_or_curve + calls·op_forward_s + matmuls·w_half/rate
               + share·microbatch_s
    backward = Σ_units roofline_or_curve + calls·op_backward_s + 2·matmuls·w_half/rate
               + (1 - share)·microbatch_s
    message  = link.latency + bytes/link.bandwidth + message_s(sender) + message_s(receiver)
    per iteration, per stage: step_s (after its last action, before the iteration ends)

`calls` counts the nodes the device runs without a measured curve (a profiled node's curve
a + c·b already holds its per-call cost), `matmuls` those of them with matmul-class FLOPs
(attainable rate r·w/(w + w_half) for work w: w_half/r seconds per call on top of w/r; twice in
the backward, its input- and weight-gradient products). Ranks sharing cores: a CPU device's
host costs (op_*, microbatch_s, step_s, message_s) are multiplied by `host_share`.

Profile document section (written by `pipecc profile`, read here)::

    "fixed_costs": {"<device name>": {"op_forward_s": .., "op_backward_s": .., "microbatch_s": ..,
                                      "step_s": .., "message_s": .., "ranks": N,
                                      "source": "measured by pipecc profile on <host> ..."}}

NOTE: the defaults per kind (`DEFAULTS`) are owned by the cost model; each carries its source.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["FixedCosts", "DEFAULTS", "FIELDS", "HALF_RATE_WORK", "MICROBATCH_FORWARD_SHARE",
           "fixed_costs_for", "from_json", "host_share"]

FIELDS = ("op_forward_s", "op_backward_s", "microbatch_s", "step_s", "message_s")


@dataclass(frozen=True)
class FixedCosts:
    """One device's fixed costs, in seconds (module docstring).

    op_forward_s   per op call in a forward (CPU eager: dispatch; GPU: kernel launch)
    op_backward_s  per op call's backward (all its gradient kernels together)
    microbatch_s   per micro-batch per stage, forward and backward together: autograd, Python,
                   the engine's per-action work
    step_s         per iteration per stage: optimizer step and zero_grad beyond their bytes
    message_s      host cost per message on each side (serialisation, the backend's call),
                   beyond the link's latency and bandwidth
    source         where the figures came from (a datasheet, a paper or a measurement)
    """

    op_forward_s: float = 0.0
    op_backward_s: float = 0.0
    microbatch_s: float = 0.0
    step_s: float = 0.0
    message_s: float = 0.0
    source: str = "none"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


    def scaled(self, factor: float) -> "FixedCosts":
        """Every figure times `factor` (ranks sharing cores, `host_share`)."""
        if factor == 1:
            return self
        return FixedCosts(**{k: getattr(self, k) * factor for k in FIELDS},
                          source=f"{self.source}; x{factor:g} for ranks sharing cores")


# CPU: measured by bench/bench_fixed_costs.py on the project's 2-core development host (torch
#   2.13 eager, one thread per rank as `pipecc run` gives it, 2026-12-02, the host loaded by
#   other jobs: medians of three to four runs). op_forward_s 6.4-10 us per op (a Linear/ReLU
#   chain on a [1, 8] input that requires grad), op_backward_s 19-44 us, microbatch_s 67-123 us
#   (a one-op stage's F + B as the engine runs it, beyond its op), step_s 84-192 us (zero_grad
#   + Adam of one Linear), message_s 19 us per side (gloo ping-pong of 64 bytes, 68 us one way,
#   less the loopback link's 30 us, halved; 1 ms when the host is oversubscribed, which
#   `host_share` counts apart).
# GPU: op_forward_s 5 us, "a few microseconds" of launch overhead per CUDA kernel (NVIDIA
#   Technical Blog, A. Gray, "Getting Started with CUDA Graphs", 2019; PAPERS-SPEC §1.6); a
#   backward launches two (input and weight gradient): 10 us; message_s one NCCL kernel launch
#   per send or receive (same source), 5 us; microbatch_s and step_s are host work (Python,
#   autograd, the optimizer's loop), the CPU measurement above.
DEFAULTS: dict[str, FixedCosts] = {
    "cpu": FixedCosts(op_forward_s=7.7e-6, op_backward_s=2.7e-5, microbatch_s=8.9e-5,
                      step_s=1.2e-4, message_s=1.9e-5,
                      source="measured: bench/bench_fixed_costs.py (torch 2.13 eager, "
                             "OMP_NUM_THREADS=1, 2-core host, 2026-12-02)"),
    "gpu": FixedCosts(op_forward_s=5e-6, op_backward_s=1e-5, microbatch_s=8.9e-5,
                      step_s=1.2e-4, message_s=5e-6,
                      source="launch: NVIDIA 'Getting Started with CUDA Graphs' (2019), ~5 us "
                             "per kernel; host work: bench/bench_fixed_costs.py"),
    "fpga": FixedCosts(source="the FPGA model (pipecc.targets.fpga_model) holds its own"),
}

# The work (FLOPs) at which one matmul-class call runs at half its attainable rate:
# rate(w) = peak·eff·w / (w + w_half) (docstring).
# cpu: 2.3e5, measured by bench/bench_fixed_costs.py (matmul_w_half: F.linear's per-call time
#   beyond ReLU's, 5-7 us, times the large-matmul rate there, 14-51 GFLOP/s; medians of 4 runs).
# gpu: 2.3e8 = half a wave of 128x128 output tiles with K = 128 on 108 SMs (2·128³·108 / 2):
#   a GEMM runs in whole waves of tiles, so it loses half a wave on average and a call below
#   one wave takes a wave's time (NVIDIA Deep Learning Performance Guide, "Matrix
#   Multiplication Background", tile and wave quantization; A100: 108 SMs, A100 datasheet).
HALF_RATE_WORK: dict[str, float] = {"cpu": 2.3e5, "gpu": 128 ** 3 * 108}

# The forward action's share of microbatch_s: half (bench/bench_fixed_costs.py reports it as
# microbatch_forward_share; its runs on the loaded host gave 0.4-0.6).
MICROBATCH_FORWARD_SHARE = 0.5


def host_share(ranks: int, cores: int | None = None) -> float:
    """How many ranks share each core of one host: max(1, ranks / cores); `cores` defaults
    to os.cpu_count(). The rule: every CPU device of a plan is one rank on this host (the
    catalog's `cpu` is the host CPU, `pipecc run` starts one process per rank), and an
    oversubscribed host time-slices them, so each rank's host costs grow by this factor."""
    cores = cores or os.cpu_count() or 1
    return max(1.0, ranks / cores)


def from_json(data: Mapping[str, Any], source: str) -> FixedCosts:
    """A profile's entry for one device; ValueError naming the field when one is not a
    non-negative number."""
    values: dict[str, Any] = {}
    for name in FIELDS:
        v = data.get(name, 0.0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
            raise ValueError(f"fixed_costs field {name!r} is {v!r}, not a non-negative number")
        values[name] = float(v)
    return FixedCosts(**values, source=str(data.get("source", source)))


def fixed_costs_for(device: Any, profile: Any = None) -> FixedCosts:
    """The fixed costs of `device` (a `pipecc.targets.hardware.Device`): the profile's measured
    entry for its name when `profile` (a `pipecc.targets.profiled.Profile`) has one, else its
    kind's default."""
    if profile is not None:
        entry = (getattr(profile, "data", None) or {}).get("fixed_costs", {}).get(device.name)
        if entry is not None:
            return from_json(entry, f"measured: {getattr(profile, 'source', 'profile')}")
    return DEFAULTS.get(device.kind, FixedCosts())
