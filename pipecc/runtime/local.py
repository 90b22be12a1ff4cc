"""The drop-in module: a pipeline's stages run in one process, micro-batch by micro-batch.

`PipelinedModule(stages, ports, owner=model, microbatches=m, devices=[...])` is an `nn.Module`
that, called with the model's inputs, returns what the model returns (CONTRACT §7; in train mode
dropout draws its masks per micro-batch and BatchNorm normalises each, so with m > 1 those differ):

  * `forward` splits every tensor input whose dim 0 is the batch into `m` micro-batches
    (`torch.tensor_split`, through `pipecc.runtime.ports.split_batch` like the distributed
    runtime; other inputs go to every micro-batch whole), runs each micro-batch through the
    stages in order — moving received values to the stage's device, and replacing a
    `torch.device` value by it — and concatenates the outputs along dim 0 into the model's
    output structure (`pipecc.runtime.ports.build_output`). Autograd flows through it all, so
    `loss.backward()` reaches the weights.
  * Parameters and buffers are those of `owner` (the original model for `pipecc.compile`; the
    loaded tensors under their original names for `pipecc.load`). The module *adopts* owner's
    direct parameters, buffers and children: they are registered here under the same names, so
    `state_dict()` keys, `named_parameters()` and `parameters()` are the owner's, each tensor
    once, and an optimizer built on the original model before wrapping keeps working. The stage
    modules are not registered (they reference the same tensors); `.train()`/`.eval()` and
    `.to()` reach them too.

Caveats. BatchNorm in train mode normalises each micro-batch with its own statistics (and
updates its running statistics once per micro-batch), so with m > 1 training numerics differ
from the full-batch model; eval mode is exact. An output that is a 0-dim tensor cannot be
concatenated and is an error with m > 1; a non-tensor output is taken from the first
micro-batch. A tensor shared by stages on different devices (a tied weight) is refused.

Port specs are the plain JSON dicts of `ports.json`: {"receives": [{"name": ...}, ...],
"sends": [...], "model_inputs": [{"name", "arg", "index"}], "model_output": tree}; the
runtime never imports the compiler.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from pipecc.errors import PipeccError
from pipecc.runtime.folder import CompiledFolder
from pipecc.runtime.handlers import setup
from pipecc.runtime.ports import as_output_type, build_output, split_batch
from pipecc.runtime.stagefile import assemble_owner, load_stage, persistent_buffer
from pipecc.techniques import parts as technique_parts

__all__ = ["PipelinedModule", "load", "load_stage"]


class PipelinedModule(nn.Module):
    """Stages run in sequence per micro-batch; parameters, buffers and names of `owner`."""

    def __init__(self, stages: Sequence[nn.Module], ports: Sequence[Mapping[str, Any]], *,
                 owner: nn.Module, microbatches: int = 1,
                 devices: Sequence[str | torch.device] | None = None, precision: str = "fp32") -> None:
        super().__init__()
        if not stages or len(stages) != len(ports):
            raise ValueError(f"need one port spec per stage, got {len(stages)} stages and {len(ports)} specs")
        if microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {microbatches}")
        devices = list(devices) if devices is not None else ["cpu"] * len(stages)
        if len(devices) != len(stages):
            raise ValueError(f"{len(stages)} stages but {len(devices)} devices")
        self._adopt(owner)
        object.__setattr__(self, "_pipecc_owner", owner)  # unregistered: its tensors are adopted
        self._pipecc_stages = list(stages)  # a plain list: not registered, see the module doc
        self._pipecc_receives = [[p["name"] for p in spec["receives"]] for spec in ports]
        self._pipecc_sends = [[p["name"] for p in spec["sends"]] for spec in ports]
        self._pipecc_inputs = sorted(ports[0]["model_inputs"], key=lambda d: d["index"])
        # NOTE: a model input whose port has no batch dim but a shape was captured at that shape
        # only (export specialised the batch: forward used it as a Python number); other shapes
        # would fail deep in a stage or, where they broadcast, compute something else
        names = {d["name"] for d in self._pipecc_inputs}
        self._pipecc_fixed = {p["name"]: tuple(int(n) for n in p["shape"]) for p in ports[0]["receives"]
                              if p["name"] in names and p.get("kind", "tensor") == "tensor"
                              and p.get("batch_dim") is None and p.get("shape")}
        self._pipecc_output = ports[-1]["model_output"]
        self._pipecc_microbatches = int(microbatches)
        # mixed precision (`pipecc compile --precision`): each stage under torch.autocast on its device
        self._pipecc_amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        if self._pipecc_amp is None and precision != "fp32":
            raise ValueError(f"precision {precision!r}: choose fp32, bf16 or fp16")
        self._pipecc_devices = [torch.device(d) for d in devices]
        self._check_chain()
        self._place()
        # NOTE: the model's mode, not nn.Module's default (train): a model compiled in eval mode
        # gives an eval-mode module. Only the flags of this module and the stage roots are set;
        # the model's own submodules keep theirs (one may be frozen in eval inside a train model).
        self.training = bool(owner.training)
        for stage in self._pipecc_stages:
            stage.training = self.training

    def _adopt(self, owner: nn.Module) -> None:
        for name, p in owner._parameters.items():
            self.register_parameter(name, p)
        for name, b in owner._buffers.items():
            self.register_buffer(name, b, persistent=persistent_buffer(owner, name))
        for name, child in owner._modules.items():
            self.add_module(name, child)

    def _check_chain(self) -> None:
        """Stage k must receive exactly what stage k-1 sends (the relay convention)."""
        for k in range(1, len(self._pipecc_stages)):
            if set(self._pipecc_receives[k]) != set(self._pipecc_sends[k - 1]):
                raise PipeccError(f"stage {k} receives {self._pipecc_receives[k]} but stage {k - 1} "
                                  f"sends {self._pipecc_sends[k - 1]}")
        known = {d["name"] for d in self._pipecc_inputs}
        missing = [n for n in self._pipecc_receives[0] if n not in known]
        if missing:
            raise PipeccError(f"stage 0 receives {missing}, which are not model inputs")

    def _place(self) -> None:
        """Move each stage's tensors to its device; refuse a tensor wanted on two devices."""
        if len(set(self._pipecc_devices)) > 1:
            where: dict[int, tuple[torch.device, str]] = {}
            for k, (stage, device) in enumerate(zip(self._pipecc_stages, self._pipecc_devices)):
                for name, t in [*stage.named_parameters(), *stage.named_buffers()]:
                    other = where.setdefault(id(t), (device, f"stage {k}"))
                    if other[0] != device:
                        raise PipeccError(f"{name} is used by {other[1]} on {other[0]} and stage {k} on "
                                          f"{device} (a tied weight); place those stages on one device")
        # a split layer's parent (`passes.split_layers`) is no stage's submodule: it goes to its
        # first shard's device, and a shard on another device reads its slice through a copy
        parents: dict[int, tuple[nn.Module, torch.device]] = {}
        for stage, device in zip(self._pipecc_stages, self._pipecc_devices):
            for m in stage.modules():
                parent = m.__dict__.get("parent") if hasattr(m, "pipecc_shard_of") else None
                if isinstance(parent, nn.Module):
                    parents.setdefault(id(parent), (parent, device))
        slots = _buffer_slots([*self._pipecc_stages, *(p for p, _ in parents.values())])
        for stage, device in zip(self._pipecc_stages, self._pipecc_devices):
            stage.to(device)
        for parent, device in parents.values():
            parent.to(device)
        self._rebind(slots)

    def _rebind(self, slots: list[tuple[nn.Module, str, torch.Tensor]]) -> None:
        """Wherever a buffer was replaced (moved), make every other holder use the new tensor.

        NOTE: `.to()` keeps a Parameter's identity (it swaps `.data`) but replaces buffers, and
        a buffer may be registered in several places here (owner, adopted modules, stages).
        `slots` (module, key, tensor) from before the move also keeps old ids from being reused.
        """
        moved = {id(b): m._buffers[k] for m, k, b in slots if m._buffers.get(k) is not b}
        if not moved:
            return
        for m in [*self.modules(), *self._pipecc_owner.modules(), *_modules_of(self._pipecc_stages)]:
            for key, buf in list(m._buffers.items()):
                if buf is not None and id(buf) in moved:
                    m._buffers[key] = moved[id(buf)]

    def warn_on_train(self, message: str, *, refuse: bool = False) -> None:
        """Say `message` (a warning, or a PipeccError with `refuse`) when switched to train
        mode: `pipecc.compile` of a model in eval mode whose BatchNorm, in train mode, would
        normalise each micro-batch with its own statistics."""
        self._pipecc_on_train = (message, refuse)

    # -- nn.Module behaviour that must reach the unregistered stages
    def train(self, mode: bool = True) -> "PipelinedModule":
        message, refuse = getattr(self, "_pipecc_on_train", None) or ("", False)
        if mode and message:
            if refuse:
                raise PipeccError(message)
            warnings.warn(message, UserWarning, stacklevel=2)
        super().train(mode)
        self._pipecc_owner.train(mode)
        for stage in self._pipecc_stages:
            stage.train(mode)
        return self

    def _apply(self, fn: Any, recurse: bool = True) -> "PipelinedModule":
        slots = _buffer_slots([self, self._pipecc_owner, *self._pipecc_stages])
        super()._apply(fn, recurse)
        self._rebind(slots)
        for k, stage in enumerate(self._pipecc_stages):
            stage._apply(fn, recurse)  # what only the stage holds; shared tensors are done
            first = next(iter([*stage.parameters(), *stage.buffers()]), None)
            if first is not None:
                self._pipecc_devices[k] = first.device
        self._rebind(slots)
        return self

    def extra_repr(self) -> str:
        """Stages, micro-batches and the devices, each device once: an interleaved plan's stages
        (several per device, `plan.stages[k].device`) are counted per device, not listed again."""
        stages, devices = f"stages={len(self._pipecc_stages)}", list(self._pipecc_devices)
        plan = self.__dict__.get("plan")
        on = [getattr(s, "device", None) for s in getattr(plan, "stages", [])]
        if len(on) == len(devices) and None not in on and len(set(on)) < len(on):
            first = {d: devices[k] for k, d in reversed(list(enumerate(on)))}  # each device's first stage
            per = {on.count(d) for d in first}
            stages += f" ({per.pop()} per device)" if len(per) == 1 else f" on {len(first)} devices"
            devices = [first[d] for d in sorted(first)]
        shown = ", ".join(str(d) for d in devices)
        amp = f", precision {str(self._pipecc_amp).removeprefix('torch.')} autocast" if self._pipecc_amp else ""
        return f"{stages}, microbatches={self._pipecc_microbatches}, devices=[{shown}]{amp}"

    def __repr__(self) -> str:
        """One line, not nn.Module's tree of every adopted submodule (issue 21): the owner, the
        stages and their devices, the micro-batches; `print(pm.plan)` has the stage table."""
        plan = self.__dict__.get("plan")  # set by pipecc.compile / pipecc.load
        schedule = f", schedule {plan.schedule}" if getattr(plan, "schedule", None) else ""
        return (f"PipelinedModule({type(self._pipecc_owner).__name__}: {self.extra_repr()}{schedule})")

    def pipeline_info(self) -> dict[str, Any]:
        """Stage count, micro-batches, devices and the stage modules (for inspection and tests)."""
        return {"stages": list(self._pipecc_stages), "microbatches": self._pipecc_microbatches,
                "devices": list(self._pipecc_devices)}

    # -- running
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        env = self._bind(args, kwargs)
        self._check_fixed(env)
        chunks = self._split(env)
        outputs = [build_output(self._pipecc_output, self._run(chunk)) for chunk in chunks]
        return outputs[0] if len(outputs) == 1 else merge_outputs(outputs)

    def _bind(self, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        if len(args) > len(self._pipecc_inputs):
            raise TypeError(f"the model takes {len(self._pipecc_inputs)} inputs, got {len(args)}")
        env, kwargs = {}, dict(kwargs)
        for i, spec in enumerate(self._pipecc_inputs):
            if i < len(args):
                env[spec["name"]] = args[i]
            elif spec["arg"] in kwargs:
                env[spec["name"]] = kwargs.pop(spec["arg"])
            else:
                raise TypeError(f"missing input {spec['arg']!r}")
        if kwargs:
            raise TypeError(f"unexpected inputs {sorted(kwargs)}")
        return env

    def _check_fixed(self, env: dict[str, Any]) -> None:
        """One line for an input of another shape than a graph fixed at capture accepts."""
        for name, shape in self._pipecc_fixed.items():
            v = env.get(name)
            if isinstance(v, torch.Tensor) and tuple(v.shape) != shape:
                raise PipeccError(f"input {name!r} is {list(v.shape)}, but the captured graph only runs at "
                                  f"{list(shape)}: the capture fixed its batch size (forward uses it as a "
                                  "Python number, e.g. int(x.shape[0]) or a numpy array of that size); call "
                                  "it with that shape, or compile with an example of the batch you run")

    def _split(self, env: dict[str, Any]) -> list[dict[str, Any]]:
        batched = [v for v in env.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        if not batched or self._pipecc_microbatches == 1 or self._pipecc_fixed:
            return [env]  # a graph fixed at the whole batch runs it in one piece
        batch = batched[0].shape[0]
        m = min(self._pipecc_microbatches, batch)
        if m <= 1:
            return [env]
        chunks: list[dict[str, Any]] = [{} for _ in range(m)]
        for name, value in env.items():
            split = (isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch
                     and name not in self._pipecc_fixed)
            parts = split_batch(value, m) if split else [value] * m
            for chunk, part in zip(chunks, parts):
                chunk[name] = part
        return chunks

    def _run(self, env: dict[str, Any]) -> dict[str, Any]:
        for k, stage in enumerate(self._pipecc_stages):
            device = self._pipecc_devices[k]
            amp = torch.autocast(device.type, dtype=self._pipecc_amp) if self._pipecc_amp is not None \
                else contextlib.nullcontext()
            with amp:
                outputs = stage(*[_to(env[name], device) for name in self._pipecc_receives[k]])
            if not isinstance(outputs, tuple) or len(outputs) != len(self._pipecc_sends[k]):
                raise PipeccError(f"stage {k} returned {type(outputs).__name__}; expected a tuple of "
                                  f"{len(self._pipecc_sends[k])} values")
            env = dict(zip(self._pipecc_sends[k], outputs))
        return env


def _modules_of(roots: Sequence[nn.Module]) -> list[nn.Module]:
    return [m for root in roots for m in root.modules()]


def _buffer_slots(roots: Sequence[nn.Module]) -> list[tuple[nn.Module, str, torch.Tensor]]:
    return [(m, k, b) for m in _modules_of(roots) for k, b in m._buffers.items() if b is not None]


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, torch.device):
        return device
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    return value


def merge_outputs(outputs: list[Any]) -> Any:
    """Concatenate micro-batch outputs along dim 0, structure by structure."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            raise PipeccError("the model returns a 0-dim tensor, which micro-batches cannot "
                              "concatenate; use microbatches=1")
        return torch.cat(outputs, dim=0)
    if isinstance(first, list):
        return [merge_outputs([o[i] for o in outputs]) for i in range(len(first))]
    if isinstance(first, tuple):  # a namedtuple too
        return as_output_type(type(first), tuple(merge_outputs([o[i] for o in outputs]) for i in range(len(first))))
    if isinstance(first, dict):  # a ModelOutput too
        return as_output_type(type(first), {k: merge_outputs([o[k] for o in outputs]) for k in first})
    return first


def load(out_dir: str | Path, *, devices: Sequence[str | torch.device] | None = None,
         microbatches: int | None = None, folder: CompiledFolder | None = None) -> PipelinedModule:
    """A PipelinedModule over the stages of a compiled folder (`pipecc compile -o OUT`).

    Its tensors are the saved ones, under the original model's state_dict names. Stages run on
    `devices` (default: all on CPU) with `microbatches` (default: the plan's). ``folder``: the
    folder already opened (``CompiledFolder.open``, as ``pipecc.load`` does), not read again.
    """
    out = Path(out_dir)
    if folder is None:  # checked, the code and weights recorded by hash; a library caller's words when none
        folder = CompiledFolder.open(out, f"{out} is not a folder written by `pipecc compile` "
                                          "(no readable pipecc.json)")
    loaded = [load_stage(out / f"stage_{i}") for i in range(folder.num_stages)]
    modules, ports = [m for m, _ in loaded], [p for _, p in loaded]
    setup(technique_parts("runtime"), "one_process", modules)  # Bi-Partition: the owners' weights serve the replicas
    m = microbatches if microbatches is not None else folder.microbatches
    if devices is not None and len(devices) != len(modules):
        devices = folder.given_devices(list(devices))  # one per device of the compile's --devices
    return PipelinedModule(modules, ports, owner=assemble_owner(modules), microbatches=m, devices=devices,
                           precision=folder.precision)
