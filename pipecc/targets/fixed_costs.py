"""Fixed costs: what a device spends per call, per micro-batch, per step and per message,
whatever the work (issue #20's "fixed costs"). The one cost model adds these to the roofline
or the profiled curves; `pipecc profile` measures them on the machine, with as many ranks
running as the plan will have (its document's ``"fixed_costs"`` section overrides the defaults).

    FixedCosts          one device's figures (every field in seconds) and where they came from
    fixed_costs_for     the figures the planner uses for a device: the profile's measured ones
                        where the profile has that device, else the kind's defaults

Profile document section (written by `pipecc profile`, read here)::

    "fixed_costs": {"<device name>": {"op_forward_s": .., "op_backward_s": .., "microbatch_s": ..,
                                      "step_s": .., "message_s": .., "ranks": N,
                                      "source": "measured by pipecc profile on <host> ..."}}

NOTE: the defaults per kind (`DEFAULTS`) are owned by the cost model; each carries its source.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["FixedCosts", "DEFAULTS", "FIELDS", "fixed_costs_for", "from_json"]

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


# Per device kind; the cost model fills these with sourced figures (FPGA: a dataflow design
# has no per-call dispatch, its fixed costs are in the FPGA model).
DEFAULTS: dict[str, FixedCosts] = {
    "cpu": FixedCosts(source="none yet"),
    "gpu": FixedCosts(source="none yet"),
    "fpga": FixedCosts(source="the FPGA model (pipecc.targets.fpga_model) holds its own"),
}


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
