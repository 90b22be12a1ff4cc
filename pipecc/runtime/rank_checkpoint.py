"""One rank's checkpoint: ``stage_<rank>.safetensors`` (module state as ``model.<stage>.<key>``,
optimizer tensors as ``optim.<path>``, the RNG state as ``rng.cpu``/``rng.cuda``) and
``stage_<rank>.json`` (step, placement, the optimizer's non-tensor state, and what every saved
tensor is in the original model: ``pipecc.runtime.ckpt_remap``); no pickle anywhere.
Each file is written under a temporary name and renamed; ``pipecc.runtime.checkpoints`` makes a
set of them atomic across ranks (``pipecc run --checkpoint-dir``). ``PipelineRuntime``'s
``save_checkpoint``/``load_checkpoint`` call these.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from pipecc.errors import PipeccError
from pipecc.runtime.atomic import write_atomic
from pipecc.runtime.ckpt_remap import record
from pipecc.runtime.ports import from_json, to_json


__all__ = ["load_checkpoint", "save_checkpoint"]


def save_checkpoint(rt: Any, directory: str | os.PathLike, step: int) -> Path:
    """Write ``stage_<rank>.safetensors`` and ``stage_<rank>.json`` into ``directory``."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for s, module in zip(rt.stage_ids, rt.modules):
        for key, t in module.state_dict().items():
            tensors[f"model.{s}.{key}"] = t.detach().cpu().clone(memory_format=torch.contiguous_format)
    # NOTE: the RNG state too, so dropout masks after a resume are those of an uninterrupted run
    tensors["rng.cpu"] = torch.get_rng_state()
    if rt.device.type == "cuda":
        tensors["rng.cuda"] = torch.cuda.get_rng_state(rt.device)
    meta: dict[str, Any] = {"format": "pipecc-checkpoint/1", "step": step, "rank": rt.global_rank,
                            "world": rt.global_world, "stages": rt.stage_ids}
    if rt.optimizer is not None:
        meta["optimizer"] = {"class": type(rt.optimizer).__name__,
                             "state": to_json(rt.optimizer.state_dict(), tensors, "optim")}
    meta.update(record(rt.stage_ids, rt.modules, rt.optimizer))  # names: a re-planned resume maps by them
    base = directory / f"stage_{rt.global_rank}"  # one file per rank, each replica its own
    write_atomic(f"{base}.safetensors", lambda tmp: save_file(tensors, tmp))
    write_atomic(f"{base}.json", json.dumps(meta, indent=1) + "\n")
    return Path(f"{base}.safetensors")

def load_checkpoint(rt: Any, directory: str | os.PathLike) -> int:
    """Restore module (and optimizer) state saved by ``save_checkpoint``; returns its step."""
    from safetensors.torch import load_file

    base = Path(directory) / f"stage_{rt.global_rank}"
    if not Path(f"{base}.json").exists():
        raise PipeccError(f"no checkpoint for rank {rt.global_rank} in {directory} (expected {base.name}.json)")
    meta = json.loads(Path(f"{base}.json").read_text())
    if (meta["world"], meta["stages"]) != (rt.global_world, rt.stage_ids):
        raise PipeccError(f"checkpoint {base}.json holds stages {meta['stages']} of a {meta['world']}-rank run, "
                          f"this rank runs stages {rt.stage_ids} of {rt.global_world}")
    # NOTE: on the CPU: load_state_dict copies into the parameters' devices, and optimizers
    # want their `step` counters on the CPU unless capturable.
    tensors = load_file(f"{base}.safetensors", device="cpu")
    for s, module in zip(rt.stage_ids, rt.modules):
        prefix = f"model.{s}."
        module.load_state_dict({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})
    if "rng.cpu" in tensors:
        torch.set_rng_state(tensors["rng.cpu"])
    if "rng.cuda" in tensors and rt.device.type == "cuda":
        torch.cuda.set_rng_state(tensors["rng.cuda"], rt.device)
    if rt.optimizer is not None:
        if "optimizer" not in meta:
            raise PipeccError(f"checkpoint {base}.json has no optimizer state")
        rt.optimizer.load_state_dict(from_json(meta["optimizer"]["state"], tensors))
    rt.after_optimizer_step()  # Bi-Partition: checkpoints hold the owners' weights; refresh the replicas
    return int(meta["step"])
