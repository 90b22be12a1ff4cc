"""Checkpoints that survive a re-plan: every rank's state under the original model's tensor names.

Recorded. Each rank's ``stage_<r>.json`` (``pipecc.runtime.rank_checkpoint``) says, for every
module tensor it saved (``model.<stage>.<key>``), what it is in the original model
(``record``): ``[name, *aliases]`` (the stage class's ``PARAM_NAMES``/``PARAM_ALIASES``: a tied
weight has several names), or ``{"shard": [name, dim, start, size]}`` for a split layer's slice
(``SHARDS``: ``full.narrow(dim, start, size)``); and, in ``"params"``, which saved tensor the
optimizer's i-th parameter is, so its state (Adam's ``exp_avg``, ``exp_avg_sq``, ``step``;
SGD's ``momentum_buffer``) maps the same way.

Gathered (``gather``). A checkpoint of another compiled folder of the same model is read in
full by every rank of the new run: all ranks' files of the step (checked against their sha256),
each tensor put under its name, a split layer's slices concatenated back along their dim (the
slices of every replica and tied copy are equal: the first is taken). So ``--checkpoint-dir``
must be one folder every node of the new run can read; a rank file missing there is one line
saying so.

The same model. What identifies it is its state: the set of tensor names with their shapes and
dtypes, of the checkpoint against the new folder's (every rank's stages, gathered over the
process group). A name missing on either side, or another shape or dtype, is one line naming the
tensor (``check_same_model``).

Loaded (``load``). Each new rank takes its stages' tensors (slicing its shards), its
parameters' optimizer state (state tensors shaped like the parameter are sliced like it, the
others — ``step`` — copied) with the checkpoint's hyper-parameters and this run's ``--lr``; RNG:
a rank whose pipeline position holds the same stage numbers as the checkpoint's rank of the same
number (a schedule change of the same cut) takes that rank's RNG state; every other rank is
re-seeded from ``--seed``, the step and its rank, so dropout draws differ from an uninterrupted
run (models without dropout are unaffected).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from pipecc.errors import PipeccError

__all__ = ["Gathered", "check_same_model", "gather", "load", "model_state", "new_signature", "record"]

SHARED = "a re-mapped resume reads every rank's files, so --checkpoint-dir must be one folder all nodes share"


# ----------------------------------------------------------------------------- recording
def _naming(module: nn.Module) -> tuple[dict[str, list[str]], dict[str, list]]:
    cls = type(module)
    names: dict[str, str] = getattr(cls, "PARAM_NAMES", {}) or {}
    aliases: dict[str, Sequence[str]] = getattr(cls, "PARAM_ALIASES", {}) or {}
    shards: dict[str, Sequence] = getattr(cls, "SHARDS", {}) or {}
    whole = {k: [str(n), *map(str, aliases.get(k, ()))] for k, n in names.items()}
    return whole, {k: [str(v[0]), int(v[1]), int(v[2]), int(v[3])] for k, v in shards.items()}


def record(stage_ids: Sequence[int], modules: Sequence[nn.Module],
           optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """What ``stage_<r>.json`` records of this rank's tensors: ``{"names", "params"}``."""
    names: dict[str, Any] = {}
    key_of: dict[int, str] = {}
    for s, module in zip(stage_ids, modules):
        whole, shards = _naming(module)
        for key in module.state_dict():
            saved = f"model.{s}.{key}"
            names[saved] = {"shard": shards[key]} if key in shards else whole.get(key)  # None: no name
        for key, p in module.named_parameters():
            key_of.setdefault(id(p), f"model.{s}.{key}")
    params = [] if optimizer is None else \
        [key_of.get(id(p)) for group in optimizer.param_groups for p in group["params"]]
    return {"names": names, "params": params}


# ----------------------------------------------------------------------------- gathering
@dataclass
class Gathered:
    """A checkpoint step of every rank, under the original names."""

    folder: Path
    step: int
    world: int
    stages: int  # how many stages the plan that wrote it had
    rank_stages: dict[int, list[int]]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    aliases: dict[str, list[str]] = field(default_factory=dict)
    optim: dict[str, dict[str, Any]] = field(default_factory=dict)
    groups: list[dict[str, Any]] = field(default_factory=list)  # hyper-parameters (no "params")
    optimizer_class: str | None = None
    rng: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)

    def signature(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in self.tensors.items()}


def gather(folder: Path, world: int, check: Callable[[Path, int], None] | None = None) -> Gathered:
    """Every rank's files of the checkpoint step ``folder`` (``world`` ranks) under the original
    names; ``check(folder, rank)`` first checks a rank's files (its sha256)."""
    from safetensors.torch import load_file

    from pipecc.runtime.ports import from_json

    found = Gathered(folder, -1, world, 0, {})
    pieces: dict[str, dict[int, tuple[int, int, torch.Tensor, dict | None]]] = {}
    for r in range(world):
        base = folder / f"stage_{r}"
        for suffix in (".json", ".safetensors"):
            if not Path(f"{base}{suffix}").is_file():
                raise PipeccError(f"{folder} has no {base.name}{suffix} (rank {r} of {world}): "
                                  f"{SHARED}")
        if check is not None:
            check(folder, r)
        try:
            meta = json.loads(Path(f"{base}.json").read_text(encoding="utf-8"))
            tensors = load_file(f"{base}.safetensors", device="cpu")
        except (OSError, ValueError, RuntimeError) as e:
            raise PipeccError(f"{base}.safetensors or .json cannot be read ({type(e).__name__}: {e}); the "
                              "checkpoint is damaged") from None
        if not isinstance(meta, dict) or not isinstance(meta.get("names"), dict):
            raise PipeccError(f"{base}.json records no tensor names (an older pipecc wrote it): it resumes only "
                              "in the compiled folder that wrote it")
        try:
            _take_rank(found, r, meta, tensors, pieces, from_json)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            raise PipeccError(f"{base}.json does not describe its tensors ({type(e).__name__}: {e}); the "
                              "checkpoint is damaged") from None
    for name, parts in pieces.items():
        _join_shards(found, name, [(k, *parts[k]) for k in sorted(parts)])
    found.stages = len({s for stages in found.rank_stages.values() for s in stages})
    return found


def _take_rank(found: Gathered, r: int, meta: dict[str, Any], tensors: dict[str, torch.Tensor],
               pieces: dict[str, dict], from_json: Callable) -> None:
    found.step = int(meta["step"]) if found.step < 0 else found.step
    found.rank_stages[r] = [int(s) for s in meta["stages"]]
    found.rng[r] = {k: v for k, v in tensors.items() if k.startswith("rng.")}
    entries: dict[str, dict] = {}
    if "optimizer" in meta:
        opt = meta["optimizer"]
        found.optimizer_class = found.optimizer_class or opt.get("class")
        state = from_json(opt["state"], tensors)
        if not found.groups:
            found.groups = [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]]
        params = meta.get("params") or []
        for index, entry in state["state"].items():
            if int(index) < len(params) and params[int(index)] is not None:
                entries[params[int(index)]] = entry
    for saved, naming in meta["names"].items():
        if naming is None:
            raise PipeccError(f"the checkpoint's {saved} (rank {r}) has no name in the original model, so it cannot "
                              "be re-mapped: resume it with the compiled folder that wrote it")
        value = tensors[saved]
        if isinstance(naming, dict):
            name, dim, start, size = naming["shard"]
            pieces.setdefault(str(name), {}).setdefault(int(start), (int(dim), int(size), value, entries.get(saved)))
            continue
        name, *aliases = naming
        if name not in found.tensors:
            found.tensors[name], found.aliases[name] = value, list(aliases)
            if saved in entries:
                found.optim[name] = entries[saved]


def _join_shards(found: Gathered, name: str, parts: list[tuple[int, int, int, torch.Tensor, dict | None]]) -> None:
    """A split layer's slices ``(start, dim, size, value, optimizer entry)``, sorted by start,
    concatenated back into the tensor (and its optimizer state likewise)."""
    dims = {dim for _, dim, _, _, _ in parts}
    tiles, end = True, 0
    for start, dim, size, value, _ in parts:
        tiles = tiles and start == end and value.dim() > dim and value.shape[dim] == size
        end += size
    if name in found.tensors or len(dims) != 1 or not tiles:
        raise PipeccError(f"the checkpoint's slices of {name!r} do not tile one tensor; the checkpoint is damaged")
    (dim,) = dims
    found.tensors[name] = torch.cat([value for _, _, _, value, _ in parts], dim)
    found.aliases[name] = []
    entries = [entry for *_, entry in parts]
    if all(e is not None for e in entries):
        joined: dict[str, Any] = {}
        for key, first in entries[0].items():
            sliced = all(isinstance(e.get(key), torch.Tensor) and tuple(e[key].shape) == tuple(v.shape)
                         for e, (_, _, _, v, _) in zip(entries, parts))
            joined[key] = torch.cat([e[key] for e in entries], dim) if sliced else first
        found.optim[name] = joined


# ----------------------------------------------------------------------------- the same model
def _shape_text(sig: tuple[tuple[int, ...], str]) -> str:
    return f"{sig[1]}[{', '.join(map(str, sig[0]))}]"


def new_signature(stage_ids: Sequence[int], modules: Sequence[nn.Module],
                  gather_all: bool) -> tuple[dict[str, tuple[tuple[int, ...], str]], str | None]:
    """(this run's model tensors ``{name: (shape, dtype)}`` over every rank, the first problem
    of any rank: a tensor without a name in the model). ``gather_all``: a collective over the
    process group, which every rank reaches before any refuses."""
    mine: list[tuple[str, tuple[int, ...], str, list | None]] = []
    problem = None
    for s, module in zip(stage_ids, modules):
        whole, shards = _naming(module)
        for key, t in module.state_dict().items():
            dtype = str(t.dtype).removeprefix("torch.")
            if key in shards:
                mine.append((shards[key][0], tuple(t.shape), dtype, shards[key][1:]))
            elif key in whole:
                mine.append((whole[key][0], tuple(t.shape), dtype, None))
            elif problem is None:
                problem = f"stage {s}'s tensor {key!r} has no name in the original model to map it by"
    every: list[Any] = [(mine, problem)]
    if gather_all and dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, (mine, problem))
    sig: dict[str, tuple[tuple[int, ...], str]] = {}
    for rows, _ in every:
        for name, shape, dtype, shard in rows:
            if shard is not None:
                dim, start, size = shard
                full = list(sig[name][0] if name in sig else shape)
                full[dim] = max(full[dim] if name in sig else 0, start + size)
                shape = tuple(full)
            sig[name] = (shape, dtype)
    return sig, next((p for _, p in every if p), None)


def check_same_model(found: Gathered, sig: dict[str, tuple[tuple[int, ...], str]]) -> None:
    """One line naming the first tensor that differs, is missing or is extra."""
    have = found.signature()
    fix = "it is a checkpoint of another model: give this model's --checkpoint-dir, or another one to start over"
    for name in sorted(have.keys() & sig.keys()):
        if have[name] != sig[name]:
            raise PipeccError(f"its {name} is {_shape_text(have[name])}, this model's is {_shape_text(sig[name])}: "
                              f"{fix}")
    for name in sorted(sig.keys() - have.keys()):
        raise PipeccError(f"it has no tensor {name}, which this model has: {fix}")
    for name in sorted(have.keys() - sig.keys()):
        raise PipeccError(f"it holds a tensor {name}, which this model does not have: {fix}")


# ----------------------------------------------------------------------------- loading
def _reseed(seed: int, step: int, rank: int) -> int:
    digest = hashlib.sha256(f"pipecc-remap/{seed}/{step}/{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def load(found: Gathered, rt: Any, lr: float | None, seed: int) -> bool:
    """This rank's stages, optimizer and RNG from ``found``; True when the RNG state was mapped
    (the same stages on the same rank), False when it was re-seeded."""
    for s, module in zip(rt.stage_ids, rt.modules):
        whole, shards = _naming(module)
        state = {}
        for key in module.state_dict():
            if key in shards:
                name, dim, start, size = shards[key]
                state[key] = found.tensors[name].narrow(dim, start, size).clone()
            else:
                state[key] = found.tensors[whole[key][0]].clone()
        module.load_state_dict(state)
    if rt.optimizer is not None:
        _load_optimizer(found, rt, lr)
    rank = rt.global_rank
    same = rt.global_world == found.world and found.rank_stages.get(rank) == list(rt.stage_ids)
    if same:
        rng = found.rng.get(rank, {})
        if "rng.cpu" in rng:
            torch.set_rng_state(rng["rng.cpu"])
        if "rng.cuda" in rng and rt.device.type == "cuda":
            torch.cuda.set_rng_state(rng["rng.cuda"], rt.device)
    else:
        torch.manual_seed(_reseed(seed, found.step, rank))
    rt.after_optimizer_step()
    return same


def _load_optimizer(found: Gathered, rt: Any, lr: float | None) -> None:
    opt = rt.optimizer
    if found.optimizer_class is not None and found.optimizer_class != type(opt).__name__:
        raise PipeccError(f"--resume: the checkpoint in {found.folder} holds {found.optimizer_class} optimizer "
                          f"state, this run's optimizer is {type(opt).__name__}; give the --optimizer it was "
                          "trained with")
    where: dict[int, tuple[str, tuple[int, int, int] | None]] = {}
    for module in rt.modules:
        whole, shards = _naming(module)
        for key, p in module.named_parameters():
            where.setdefault(id(p), (shards[key][0], tuple(shards[key][1:])) if key in shards
                             else (whole[key][0], None))
    current = opt.state_dict()
    state: dict[int, dict[str, Any]] = {}
    index = 0
    for group in opt.param_groups:
        for p in group["params"]:
            name, shard = where[id(p)]
            entry = found.optim.get(name)
            if entry is not None:
                full = found.tensors[name]
                state[index] = {k: _slice(v, full, shard) for k, v in entry.items()}
            index += 1
    groups = []
    for i, group in enumerate(current["param_groups"]):
        saved = found.groups[i] if i < len(found.groups) else {}
        merged = {**group, **{k: v for k, v in saved.items() if k in group and k != "params"}}
        if lr is not None:
            merged["lr"] = lr
        groups.append(merged)
    opt.load_state_dict({"state": state, "param_groups": groups})


def _slice(value: Any, full: torch.Tensor, shard: tuple[int, int, int] | None) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if shard is not None and tuple(value.shape) == tuple(full.shape):
        dim, start, size = shard
        return value.narrow(dim, start, size).clone()
    return value.clone()


def model_state(found: Gathered) -> dict[str, torch.Tensor]:
    """The whole model's state dict in its original names (a tied weight under each of its names,
    each its own copy: safetensors stores no shared memory)."""
    state: dict[str, torch.Tensor] = {}
    for name in sorted(found.tensors):
        for key in (name, *found.aliases.get(name, ())):
            state[key] = found.tensors[name].detach().clone(memory_format=torch.contiguous_format)
    return state
