"""What a command-line run (``pipecc.runtime.dist.main``) feeds the pipeline and does with its
weights: the model's data (``RunData``: stage 0's inputs, the target and the loss from the model
file, or seeded random inputs and a smoke loss) and the tied weights' gradient sum
(``TiedGradients``).

Imports torch, ``pipecc.errors``, ``pipecc.runtime`` and, when a ``.py`` model file is given,
``pipecc.frontend.modelfile`` (which imports the file without building the model) — never the
compiler. The model file is imported only when its sha256 is the one ``pipecc.json`` records
(``CompiledFolder.model_source``, ``pipecc.runtime.trust``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipecc.errors import PipeccError
from pipecc.runtime.loss_reduction import LossReduction
from pipecc.runtime.watchdog import bounded
from pipecc.runtime.engine import PipelineRuntime
from pipecc.runtime.folder import CompiledFolder
from pipecc.runtime.lengths import LENGTH_ARG
from pipecc.runtime.ports import StagePorts, build_output, unflatten
from pipecc.runtime import wire

__all__ = ["RunData", "TiedGradients"]


def _synthetic_inputs(ports: StagePorts, seed: int) -> tuple:
    """Seeded inputs matching stage 0's receives (the same on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    values = []
    for port in ports.in_leaves:
        if port.kind != "tensor":
            raise PipeccError(f"input {port.name!r} is an object; the smoke run cannot invent it")
        if port.dtype.is_floating_point:
            values.append(torch.randn(port.shape, generator=gen).to(port.dtype))
        else:  # token ids and the like: 0/1 are valid for any vocabulary
            values.append(torch.randint(0, 2, port.shape, generator=gen).to(port.dtype))
    return tuple(unflatten(values, ports.receives))


def _mean_of_outputs(outputs: Any, target: Any) -> torch.Tensor:
    """Smoke-run loss: the sum over floating tensors in the outputs (nested tuples, lists and dict
    values too) of their mean."""
    if isinstance(outputs, torch.Tensor):
        if outputs.is_complex():  # a real loss of complex outputs: the mean of their magnitudes
            return outputs.abs().float().mean()
        return outputs.float().mean() if outputs.is_floating_point() else torch.zeros(())
    if isinstance(outputs, dict):
        outputs = list(outputs.values())
    if isinstance(outputs, (tuple, list)):
        return sum((_mean_of_outputs(o, target) for o in outputs), torch.zeros(()))
    return torch.zeros(())


@dataclass
class RunData:
    """What a run feeds the pipeline: stage 0's inputs, the target, the loss (see ``pipecc.runtime.dist.main``)."""

    inputs: tuple  # stage 0's receives, full batch
    target: Any
    loss_fn: Callable  # what PipelineRuntime calls: (last stage's sends, target) -> scalar
    model_loss: Callable  # (model outputs, target) -> scalar
    model_inputs: tuple = ()  # the model's positional inputs (for --verify)
    module: Any = None  # the imported model file; None: synthetic data
    note: str | None = None
    model_output: dict[str, Any] | None = None
    send_names: tuple[str, ...] = ()

    @classmethod
    def load(cls, folder: CompiledFolder | None, specs: list[dict[str, Any]], seed: int,
             length: int | None = None) -> RunData:
        """The run's data (``folder``: the compiled folder; None: seeded random inputs); ``length``
        (a folder with a declared length, ``pipecc.runtime.lengths``): the model file's input makers
        are called with ``seq_len=length``. The batch is the folder's (``CompiledFolder.batch``);
        a folder that knows none leaves it to the model file's own ``example_inputs`` default."""
        first = StagePorts.from_json(specs[0])
        meta = folder.marker if folder is not None else None
        if length is not None and (meta is None or not meta.get("model_path")):
            raise PipeccError("--length builds each batch with the model file's example_inputs(batch_size, "
                              "seq_len=L); this folder records no model file")
        if folder is None or meta is None:
            return cls(_synthetic_inputs(first, seed), None, _mean_of_outputs, _mean_of_outputs)
        path, source = folder.model_source()  # NOTE: raises unless the file is the one recorded by hash
        if path is None or not isinstance(source, bytes):
            if length is not None:
                raise PipeccError(f"--length: {source}, and a run at another length needs its example_inputs")
            note = f"note: {source}; training on seeded random inputs with the mean of the outputs as the loss"
            return cls(_synthetic_inputs(first, seed), None, _mean_of_outputs, _mean_of_outputs, note=note)
        from pipecc.frontend.modelfile import _call_with_accepted, import_model_file  # torch and pipecc.errors only

        with bounded(f"importing {path.name}"):  # --timeout, when every rank hangs in model code
            module = import_model_file(path, source)  # the bytes hashed, compiled from memory
        model_args = dict(meta.get("model_args") or {})
        if length is not None:
            model_args[LENGTH_ARG] = length
        batch = folder.batch(specs)  # 0: the folder knows none

        def call(name: str) -> Any:
            try:
                with bounded(f"{name} in {path.name}"):
                    return _call_with_accepted(getattr(module, name), *([batch] if batch else []), **model_args)
            except Exception as e:
                raise PipeccError(f"{name} in {path.name} failed: {type(e).__name__}: {e}") from None

        torch.manual_seed(seed)  # every rank draws the same batch, even from an unseeded example_inputs
        raw = call("example_inputs")
        model_inputs = tuple(raw) if isinstance(raw, (tuple, list)) else (raw,)
        target = call("example_target") if callable(getattr(module, "example_target", None)) else None
        user_loss = getattr(module, "loss_fn", None)
        note = None
        if not callable(user_loss):
            note, model_loss = f"note: {path.name} defines no loss_fn; the loss is the mean of the outputs", \
                _mean_of_outputs
        elif target is None:
            note, model_loss = f"note: {path.name} defines loss_fn but no example_target; the loss is the mean " \
                "of the outputs", _mean_of_outputs
        else:
            model_loss = user_loss
        tree = meta.get("model_output") or specs[-1].get("model_output")
        send_names = tuple(str(p.get("name")) for p in specs[-1].get("sends", ()))

        def loss_fn(value: Any, tgt: Any) -> torch.Tensor:
            sends = (value,) if len(send_names) == 1 else tuple(value)
            return model_loss(build_output(tree, dict(zip(send_names, sends))), tgt)
        if model_loss is user_loss:  # how its micro-batch losses combine (pipecc.runtime.loss_reduction)
            loss_fn.reduction = LossReduction.from_json(meta.get("loss_reduction"))  # type: ignore[attr-defined]

        inputs = _stage0_inputs(model_inputs, meta.get("model_inputs") or specs[0].get("model_inputs") or [],
                                first, path.name)
        return cls(inputs, target, loss_fn, model_loss, model_inputs, module, note, tree, send_names)


def _stage0_inputs(values: tuple, model_inputs: list[dict[str, Any]], first: StagePorts, file: str) -> tuple:
    """The model's positional inputs mapped to stage 0's receives (by ``model_inputs`` names)."""
    index = {str(d["name"]): int(d["index"]) for d in model_inputs}
    args = {str(d["name"]): str(d.get("arg", d["name"])) for d in model_inputs}
    chosen = []
    for i, port in enumerate(first.receives):
        k = index.get(port.name, i if not index else None)
        if k is None:
            raise PipeccError(f"stage 0 receives {port.name!r}, which is none of the model inputs in pipecc.json")
        if k >= len(values):
            raise PipeccError(f"example_inputs in {file} returned {len(values)} values; the compiled model takes "
                              f"input {args.get(port.name, port.name)!r} at position {k}")
        chosen.append(values[k])
    return tuple(chosen)


class TiedGradients:
    """Sums the gradient of each tied weight (one parameter used by several stages; every
    holding stage has its own copy, ``ports.json``'s ``tied``) over the holders, so every copy
    gets the original parameter's gradient and the copies stay equal under the optimizer.

    With replicated stages (PP x DP) the sum runs among the holders of the same replica, after
    the replicas' all-reduce (``PipelineRuntime.step``): both are sums, so every copy on every
    replica gets the full-batch gradient.

    Construction is collective (``dist.new_group`` for every tied weight spanning ranks, in
    the same order on every rank).
    """

    def __init__(self, runtime: PipelineRuntime, modules: Sequence[nn.Module], specs: list[dict[str, Any]]):
        holders: dict[str, list[int]] = {}
        for k, spec in enumerate(specs):
            for name in spec.get("tied", ()) or ():
                holders.setdefault(str(name), []).append(k)
        self.entries: list[tuple[str, Any, list[nn.Parameter]]] = []
        for name in sorted(holders):
            ranks = sorted({runtime.schedule.stage_to_rank[k] for k in holders[name]})
            group = None
            if len(ranks) > 1 and runtime.world > 1:  # replicas: one group per replica, made by all in order
                for r in range(runtime.replicas.count):
                    made = dist.new_group([runtime.replicas.rank_of(j, r) for j in ranks])
                    group = made if r == runtime.replicas.index else group
            local = [p for s, module in zip(runtime.stage_ids, modules) if s in holders[name]
                     for p in _named_param(module, name)]
            if local and (len(local) > 1 or group is not None):
                self.entries.append((name, group, local))

    def forget_groups(self) -> None:
        """Drop the (destroyed) tied-weight groups (``PipelineRuntime.forget_groups``)."""
        self.entries = [(name, None, params) for name, _, params in self.entries]

    def reduce(self) -> None:
        for _, group, params in self.entries:
            total = sum((p.grad if p.grad is not None else torch.zeros_like(p)) for p in params).detach().clone()
            if group is not None:
                wire.all_reduce(total, group=group)
            for p in params:
                p.grad = total.clone()


def _named_param(module: nn.Module, name: str) -> list[nn.Parameter]:
    """The parameter of a generated stage module that holds the original parameter ``name``."""
    cls = type(module)
    names: dict[str, str] = getattr(cls, "PARAM_NAMES", {})
    aliases: dict[str, tuple[str, ...]] = getattr(cls, "PARAM_ALIASES", {})
    params = dict(module.named_parameters())
    return [params[attr] for attr, n in names.items()
            if attr in params and (n == name or name in aliases.get(attr, ()))]
