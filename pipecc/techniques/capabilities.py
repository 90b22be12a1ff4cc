"""What a runtime and a device can execute, as data the technique rules query (tinygrad's
renderer flags): a technique asks "can every stage's device recompute?", never "is it an FPGA?".

    Capabilities(runtime, kinds)     runtime: what the backend's runtime executes (the compiled
                                     folder under `pipecc run`, or the in-process drop-in module)
                                     kinds:   device kind -> what a stage on such a device can do

The vocabulary is fixed here so that backends (`pipecc.backends.base.Backend.capabilities`),
targets (`pipecc.targets.hardware.Device.capabilities`) and the runtime's folder loader (which
imports no backend) name the same things. A device kind not listed can do everything: only
the FPGA cards' generated dataflow kernels are limited (inference only, one fixed micro-batch
shape, no autograd state, never replicated; /work/shared/FPGA.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

BACKWARD = "backward"                    # runs a backward pass (the stage trains)
SPLIT_BACKWARD = "split-backward"        # input and weight gradients as separate actions (zero-bubble I/W)
RECOMPUTE = "recompute"                  # re-runs a stage's forward inside its backward
REPLICATE = "replicate"                  # a stage on a replica group that all-reduces its gradients
VARIABLE_MICROBATCH = "variable-microbatch"  # chunks of different sizes through one stage
SAVED_TENSOR_STASH = "saved-tensor-stash"    # a stage's autograd saved tensors can leave it (BPipe, Bi-Partition)
STASH_TRANSFER = "stash-transfer"        # the runtime moves saved tensors between ranks (a process per rank)

ALL = frozenset({BACKWARD, SPLIT_BACKWARD, RECOMPUTE, REPLICATE, VARIABLE_MICROBATCH,
                 SAVED_TENSOR_STASH, STASH_TRANSFER})

# device kind -> what a stage placed there can do; kinds not listed: ALL
DEVICE_KINDS: Mapping[str, frozenset[str]] = {
    "cpu": ALL,
    "gpu": ALL,
    # an FPGA stage is generated HLS dataflow: inference only, compiled for one micro-batch
    # shape, no torch autograd to recompute or stash, one card (never a replica group)
    "fpga": frozenset(),
}

# what the torch backend's runtimes execute: the compiled folder (`pipecc run`, one process per
# rank) everything; the drop-in module (`pipecc.compile`, every stage in one process) no
# transfer of saved tensors between ranks
COMPILED_FOLDER = ALL
IN_PROCESS = ALL - {STASH_TRANSFER}


def of_kind(kind: str | None) -> frozenset[str]:
    """What a stage on a device of `kind` can do."""
    return DEVICE_KINDS.get(str(kind), ALL)


@dataclass(frozen=True)
class Capabilities:
    """The runtime's capabilities and the device kinds' (module docstring); `where` names the
    runtime in a reason ("the drop-in module")."""

    runtime: frozenset[str] = COMPILED_FOLDER
    kinds: Mapping[str, frozenset[str]] = field(default_factory=lambda: dict(DEVICE_KINDS))
    where: str = "the compiled folder"

    def runtime_can(self, capability: str) -> bool:
        return capability in self.runtime

    def stages_lacking(self, plan: Any, capability: str, only: Any = None) -> dict[int, str]:
        """Stage index -> its device's name, for the plan's stages (those in `only`, when given)
        whose device kind lacks `capability`; a replicated stage counts every device of its group."""
        out: dict[int, str] = {}
        for s in plan.stages:
            if only is not None and s.index not in only:
                continue
            for d in list(getattr(s, "replica_devices", ()) or ()) or [s.device]:
                dev = plan.devices[d] if 0 <= d < len(plan.devices) else {}
                if capability not in self.kinds.get(str(dev.get("kind")), ALL):
                    out[int(s.index)] = f"{dev.get('kind')} {dev.get('name', '?')}"
                    break
        return out

    def first_lacking(self, plan: Any, capability: str, only: Any = None) -> str | None:
        """"stage k (fpga u250)" for the first stage lacking `capability`, or None."""
        lack = self.stages_lacking(plan, capability, only)
        if not lack:
            return None
        k = min(lack)
        return f"stage {k} ({lack[k]})"


COMPILED = Capabilities()
DROP_IN = Capabilities(runtime=IN_PROCESS, where="the drop-in module (every stage in one process)")
