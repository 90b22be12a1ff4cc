"""A compiled folder as one object a training script drives, one process per rank
(``pipecc.distributed.load``; ``pipecc run`` is a client of the same object).

    # train.py, started with: torchrun --nproc-per-node 2 train.py
    pipe = pipecc.distributed.load("out")          # this rank's stage(s), device and links
    opt = torch.optim.AdamW(pipe.parameters(), lr=3e-4)
    for x, y in loader:                            # the same loader, in the same order, on every rank
        loss = pipe.step(x, target=y)              # one step of the folder's schedule.txt
        pipe.clip_grad_norm_(1.0)                  # the global norm over every stage
        opt.step(); opt.zero_grad()

``step`` runs the folder's schedule (every technique it carries: replicas, zero-bubble, UMPIPE,
BPipe, Bi-Partition, recomputation, split layers) on the full batch every rank passes: the rank of
stage 0 feeds its share of the inputs, the rank of the last stage uses its share of the target,
the others ignore both (they may pass None). It returns the loss the unsplit model reports for
that batch, on every rank (one broadcast). Gradients accumulate over ``step`` calls as
``loss.backward()`` does: ``k`` steps before the optimizer's add ``k`` batches' gradients.

``parameters()``/``named_parameters()`` are this rank's, named as in the original model (a slice
of a split layer keeps its parameter's name), so any ``torch.optim`` optimizer and scheduler work
unchanged. The model file's ``loss_fn`` combines over micro-batches as compile analysed it (a
mean or a sum, ``pipecc.runtime.loss_reduction``); a ``loss_fn`` given to ``load`` must be a
per-sample mean or sum too (analysed on the first micro-batch it sees; one that mixes samples
refuses a split in one line). ``state_dict()`` is this rank's tensors under the model's names (a slice as
``NAME@dim:start:stop``); ``full_state_dict()`` (collective) the whole model's, loadable into the
model the file builds; ``load_state_dict`` takes either. ``save_checkpoint``/``load_checkpoint``
write and read the checkpoints of ``pipecc run --checkpoint-dir`` (so ``pipecc
export-checkpoint`` reads them).

``eval()`` then ``pipe(x)`` returns the model's outputs on the rank of the last stage (of replica 0,
when stages are replicated: the replicas' rows are gathered there in the batch's order) and None on
the others; ``evaluate(x, target=y)`` returns the loss on every rank, without gradients.
``train()`` returns to training.

Mixed precision, declared once: ``pipecc compile --precision bf16`` (the plan then counts the
bytes autocast holds and sends, and the devices' bf16 peak) makes it the folder's default, or
``load(out, precision="bf16")`` asks for it. It runs every stage's forward and the loss under
``torch.autocast`` in bfloat16 and sends float32 activations and gradients in bfloat16;
``"fp16"`` also scales the loss (dynamic, as ``torch.amp.GradScaler``: 2**16 at first, halved on
an overflow, doubled after 2000 steps without one), unscales the gradients after every step and
checks them for Inf/NaN on every rank at once: an overflow on any rank drops the gradients
accumulated since the last optimizer step on every rank (``opt.step()`` then changes nothing) and
``pipe.overflowed`` says so.

Without torchrun one process runs every stage (the folder's stages chained, the same numerics).
Loading a folder runs code: its ``stage.py`` files and the model file ``pipecc.json`` names (only
when its sha256 is the recorded one), as ``pipecc run`` does.
"""

from __future__ import annotations

import argparse
import math
import os
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipecc.errors import PipeccError, UsageError
from pipecc.runtime import teardown, wire
from pipecc.runtime.engine import PRECISIONS, PipelineRuntime
from pipecc.runtime.handlers import setup
from pipecc.runtime.loss_reduction import MEAN, MEAN_LOSS, SUM, analyse, split_words, weight
from pipecc.runtime.ports import StagePorts, as_tuple, build_output, flatten, unflatten
from pipecc.techniques import parts as technique_parts
from pipecc.techniques.replicas.runtime import replica_inputs, replica_target, replica_unslice
from pipecc.runtime.rundata import TiedGradients

__all__ = ["DistributedPipeline", "load"]

INIT_SCALE, GROWTH_INTERVAL = 2.0 ** 16, 2000  # fp16 loss scaling, torch.amp.GradScaler's defaults


def load(out: str | Path, *, loss_fn: Callable | None = None, precision: str | None = None,
         microbatches: int | None = None, schedule: str | None = None, timeout: float = 60.0,
         backend: str | None = None, seed: int = 0) -> DistributedPipeline:
    """This rank's share of the compiled folder ``out``, ready to train (module docstring).

    ``loss_fn(outputs, target)``: default the model file's. ``precision``: "fp32", "bf16" or
    "fp16"; None: the one the folder was compiled for (``pipecc compile --precision``, fp32 unless
    given). ``microbatches``/``schedule``: another than the compiled (the folder's
    ``schedule.txt`` runs otherwise). ``timeout``: seconds any wait for a peer may take.
    Under torchrun this joins the process group torchrun describes (collective)."""
    from pipecc.runtime import rank as run_rank

    if precision is not None and precision not in ("fp32", *PRECISIONS):
        raise UsageError(f"precision={precision!r}: choose 'fp32', {', '.join(map(repr, PRECISIONS))} or None "
                         "(the folder's)")
    if loss_fn is not None and not callable(loss_fn):
        raise UsageError(f"loss_fn must be callable (outputs, target) -> scalar tensor, got {type(loss_fn).__name__}")
    if not isinstance(timeout, (int, float)) or not timeout > 0:
        raise UsageError(f"timeout must be a positive number of seconds, got {timeout!r}")
    path = Path(out)
    if not path.is_dir():
        raise PipeccError(f"{out} is not a folder; compile one with `pipecc compile MODEL -o {out}`")
    if schedule is None and not ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        # one process holds every stage: the interleaved schedule runs several stages on one rank
        # (unequal micro-batches keep their gpipe, which runs them in one process as it is)
        stages = len([d for d in path.glob("stage_*") if d.is_dir()])
        if stages > 1 and not run_rank.folder_has_sizes(path):
            schedule = "interleaved"
    args = argparse.Namespace(
        out=path, steps=0, schedule=schedule, microbatches=microbatches, timeout=float(timeout), backend=backend,
        optimizer=None, lr=None, seed=seed, length=None, verify=False, rtol=None, atol=None,
        verify_stages_only=False, checkpoint_dir=None, checkpoint_every=None, resume=False, json=False,
        warmup_steps=0, trace=None, debug=False, precision=precision, force=False)
    pipe = DistributedPipeline(run_rank.load_rank(args), loss_fn)
    if dist.is_initialized():  # a script that never calls close() still leaves cleanly at exit
        teardown.leave_at_exit(_forget_later(pipe))
    return pipe


def _forget_later(pipe: DistributedPipeline) -> Callable[[], None]:
    """``pipe.forget_groups`` at exit, without keeping ``pipe`` alive until then."""
    method = weakref.WeakMethod(pipe.forget_groups)

    def forget() -> None:
        bound = method()
        if bound is not None:
            bound()
    return forget


class DistributedPipeline:
    """This rank's stages of a compiled folder, run by the folder's schedule (module docstring)."""

    def __init__(self, run: Any, loss_fn: Callable | None = None) -> None:
        self.run = run
        self.out = run.stage_dirs[0].parent
        data = run.data
        own = getattr(data.module, "loss_fn", None) if data.module is not None else None
        self.model_loss = loss_fn or (own if callable(own) else None)
        self._loss_note = data.note
        tree, names = data.model_output, data.send_names or tuple(
            str(p.get("name")) for p in run.specs[-1].get("sends", ()))

        def runtime_loss(value: Any, target: Any) -> torch.Tensor:
            sends = (value,) if len(names) == 1 else tuple(value)
            outputs = build_output(tree, dict(zip(names, sends)))
            if not hasattr(runtime_loss, "reduction"):  # a loss_fn given to load(): analysed on its first call
                runtime_loss.reduction = analyse(self.model_loss, outputs, target,  # type: ignore[attr-defined]
                                                 _rows_of(target) or _rows_of(outputs))
            return self.model_loss(outputs, target)  # type: ignore[misc]

        # how the model file's loss_fn combines over micro-batches (pipecc.runtime.loss_reduction,
        # recorded at compile); a loss_fn given to load() is analysed the same way on the first
        # micro-batch it sees (a sum adds the parts; one that mixes samples refuses a split)
        file_loss = getattr(data.module, "loss_fn", None) if data.module is not None else None
        if self.model_loss is not None and self.model_loss in (file_loss, data.model_loss):
            runtime_loss.reduction = getattr(data.loss_fn, "reduction", MEAN_LOSS)  # type: ignore[attr-defined]
        self._runtime_loss = runtime_loss
        self._outputs = lambda value: None if value is None else build_output(
            tree, dict(zip(names, (value,) if len(names) == 1 else tuple(value))))
        self.runtime = PipelineRuntime(run.modules, run.ports, run.rank, run.world, run.config,
                                       runtime_loss if not run.forward else None, None, run.replicas)
        self.tied = TiedGradients(self.runtime, run.modules, run.specs)
        self.training = not run.forward
        self.is_first = 0 in self.runtime.stage_ids
        self.is_last = self.runtime.last_stage in self.runtime.stage_ids
        self.fp16 = run.config.precision == "fp16"
        self.loss_scale = INIT_SCALE if self.fp16 else 1.0
        self.runtime.loss_scale = self.loss_scale
        self._good_steps = 0
        self.overflowed = False  # fp16: the last step overflowed on some rank (its gradients were dropped)
        self._refresh_due = False  # Bi-Partition: replicas to refresh before the weights are read again
        self.refresh_after_step = False  # pipecc run: after_optimizer_step() follows every step itself
        self.last_loss: float | None = None  # the last step's loss as the last stage computed it (None elsewhere)
        # what a technique's stages cannot run under autocast (Bi-Partition's workers)
        setup(technique_parts("runtime"), "check_precision", run.config.precision, run.modules)

    # -- what this rank holds ------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This process's rank in the process group (0 in one process)."""
        return self.runtime.global_rank

    @property
    def world_size(self) -> int:
        return self.runtime.global_world

    @property
    def device(self) -> torch.device:
        return self.runtime.device

    @property
    def stages(self) -> list[int]:
        """The pipeline stages this rank runs."""
        return list(self.runtime.stage_ids)

    @property
    def batch_size(self) -> int:
        """The batch the folder was compiled for: what ``step`` takes."""
        return int(self.run.batch)

    @property
    def microbatches(self) -> int:
        return int(self.runtime.m)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under the original model's names (a slice of a split layer:
        its parameter's name; a stage's own tensor the model does not name: ``stage<i>.<attr>``)."""
        for s, module in zip(self.runtime.stage_ids, self.runtime.modules):
            names = _names(module)
            for attr, p in module.named_parameters():
                yield names.get(attr, (f"stage{s}.{attr}", None))[0], p

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and persistent buffers under the model's names (a slice of a split
        layer's parameter as ``NAME@dim:start:stop``), detached."""
        state: dict[str, torch.Tensor] = {}
        for s, module in zip(self.runtime.stage_ids, self.runtime.modules):
            names = _names(module)
            for attr, t in module.state_dict(keep_vars=False).items():
                name, shard = names.get(attr, (f"stage{s}.{attr}", None))
                key = name if shard is None else f"{name}@{shard[0]}:{shard[1]}:{shard[1] + shard[2]}"
                state.setdefault(key, t.detach())
        return state

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict (every rank's ``state_dict`` gathered, split layers' slices
        joined), on every rank, on the CPU; collective."""
        local = {k: v.cpu() for k, v in self.state_dict().items()}
        parts = [local]
        if self.world_size > 1:
            parts = [None] * self.world_size  # type: ignore[list-item]
            dist.all_gather_object(parts, local)
        whole: dict[str, torch.Tensor] = {}
        slices: dict[str, dict[tuple[int, int], torch.Tensor]] = {}
        for part in parts:
            for key, t in part.items():
                if "@" in key:
                    name, where = key.rsplit("@", 1)
                    dim, start, _ = (int(x) for x in where.split(":"))
                    slices.setdefault(name, {})[(dim, start)] = t
                else:
                    whole.setdefault(key, t)
        for name, pieces in slices.items():
            order = sorted(pieces)
            whole[name] = torch.cat([pieces[k] for k in order], dim=order[0][0])
        return whole

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Copy ``state`` (a ``state_dict``, a ``full_state_dict`` or the model's own state dict)
        into this rank's tensors, by the model's names; ``strict``: every tensor of this rank must
        be found in it."""
        for s, module in zip(self.runtime.stage_ids, self.runtime.modules):
            names = _names(module)
            own = module.state_dict(keep_vars=True)
            for attr, t in own.items():
                name, shard = names.get(attr, (f"stage{s}.{attr}", None))
                value = None
                if shard is not None:
                    dim, start, size = shard
                    value = state.get(f"{name}@{dim}:{start}:{start + size}")
                    if value is None and name in state:
                        value = state[name].narrow(dim, start, size)
                else:
                    value = state.get(name)
                if value is None:
                    if strict:
                        raise PipeccError(f"load_state_dict: no tensor for {name!r} (stage {s}); pass strict=False "
                                          "to leave it as it is")
                    continue
                if tuple(value.shape) != tuple(t.shape):
                    raise PipeccError(f"load_state_dict: {name!r} is {list(value.shape)}, stage {s} holds "
                                      f"{list(t.shape)}")
                with torch.no_grad():
                    t.copy_(value.to(t.device, t.dtype))
        self._refresh_due = True

    # -- modes ---------------------------------------------------------------------------------

    def train(self, mode: bool = True) -> DistributedPipeline:
        if mode and self.run.forward:
            raise PipeccError(f"{self.out} runs forward passes only ({self.run.why}); it cannot train")
        self.training = mode
        for module in self.runtime.modules:
            module.train(mode)
        return self

    def eval(self) -> DistributedPipeline:
        self.training = False
        for module in self.runtime.modules:
            module.eval()
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.parameters():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    # -- running -------------------------------------------------------------------------------

    def feed(self, inputs: Any, target: Any = None) -> tuple[tuple | None, Any]:
        """What this rank feeds the schedule from a full batch of the model's inputs and target:
        stage 0's receives (this replica's rows) and the last stage's target (its rows); None
        where this rank needs neither. Checks the batch's rows against the compiled batch."""
        rows, tgt = None, None
        if self.is_first:
            if inputs is None:
                raise PipeccError(f"rank {self.rank} runs stage 0: pass the batch's inputs to step()")
            model_inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
            rows = self._stage0_rows(model_inputs)
        if self.is_last:
            if target is None:
                raise PipeccError(f"rank {self.rank} runs the last stage: pass target= to step()")
            _check_rows(target, self.batch_size, "target")
            tgt = replica_target(target, self.runtime.m, self.runtime.replicas.count, self.runtime.replicas.index,
                                 self.runtime.replicas.batch) if self.runtime.replicas.count > 1 else target
        return rows, tgt

    def _stage0_rows(self, model_inputs: tuple) -> tuple:
        from pipecc.runtime.rundata import _stage0_inputs

        run = self.run
        first = StagePorts.from_json(run.specs[0])
        meta_inputs = (run.meta or {}).get("model_inputs") or run.specs[0].get("model_inputs") or []
        values = _stage0_inputs(model_inputs, meta_inputs, first, "the batch")
        for v, port in zip(flatten(as_tuple(values), first.receives, "inputs"), first.in_leaves):
            if port.kind == "tensor" and port.batch_dim is not None:
                if not isinstance(v, torch.Tensor):
                    raise PipeccError(f"input {port.name!r} must be a tensor, got {type(v).__name__}")
                _check_rows(v, self.batch_size, f"input {port.name!r}", port.batch_dim)
        replicas = self.runtime.replicas
        if replicas.count == 1:
            return values
        leaves = flatten(as_tuple(values), first.receives, "inputs")
        dims = [p.batch_dim if p.kind == "tensor" else None for p in first.in_leaves]
        return tuple(unflatten(replica_inputs(leaves, dims, self.runtime.m, replicas.count, replicas.index,
                                              replicas.batch), first.receives))

    def step(self, *inputs: Any, target: Any = None) -> float:
        """One training step of the folder's schedule on the batch: forward's positional arguments
        (or one tuple of them) and ``target=`` (module docstring); the batch's loss, on every rank."""
        if self.run.forward:
            raise PipeccError(f"{self.out} runs forward passes only ({self.run.why}); use pipe(x) or evaluate()")
        if self.model_loss is None:
            raise PipeccError(f"{self._loss_note or 'the folder has no model file'}; pass loss_fn= to "
                              "pipecc.distributed.load to train")
        rows, tgt = self.feed(_one(inputs), target)
        return self.step_rows(rows, tgt)

    def step_rows(self, rows: tuple | None, target: Any) -> float:
        """``step`` on what ``feed`` returned (``pipecc run`` feeds its own rows)."""
        self._refresh()
        params = [p for m in self.runtime.modules for p in m.parameters()]
        kept = [p.grad for p in params]  # accumulation: the step's collectives see its own gradients only
        for p in params:
            p.grad = None
        self.runtime.loss_scale = self.loss_scale
        loss = self.runtime.step(rows, target)
        self.tied.reduce()
        self.overflowed = self.fp16 and self._unscale(params)
        if self.overflowed:  # fp16: this step's gradients and those accumulated before are dropped everywhere
            kept = [None] * len(params)
            for p in params:
                p.grad = None
        for p, old in zip(params, kept):
            if old is not None:
                p.grad = old if p.grad is None else old.add_(p.grad)
        self.last_loss = loss
        self._refresh_due = not self.refresh_after_step  # else the caller refreshes after its optimizer step
        return self._everywhere(loss)

    def after_optimizer_step(self) -> None:
        """Bi-Partition: send the owners' updated weights to their replicas now (``pipecc run``
        calls it after every optimizer step; a script need not: the next step or forward does)."""
        self._refresh_due = False
        self.runtime.after_optimizer_step()

    def _refresh(self) -> None:
        if self._refresh_due:
            self._refresh_due = False
            self.runtime.after_optimizer_step()

    def __call__(self, *inputs: Any) -> Any:
        """The model's outputs for a full batch (no gradients; stages in their current mode), on
        the rank of the last stage; None on the others."""
        return self.forward(*inputs)

    def forward(self, *inputs: Any) -> Any:
        self._refresh()
        rows = self._stage0_rows(inputs[0] if len(inputs) == 1 and isinstance(inputs[0], tuple) else inputs) \
            if self.is_first else None
        value = self.runtime.infer(rows)
        if self.runtime.replicas.count > 1 and self.is_last:
            value = self._gather_replicas(value)
        return self._outputs(value)

    def _gather_replicas(self, value: Any) -> Any:
        """Replicated stages: each replica's rows of the outputs, gathered to replica 0's rank of the
        last stage in the batch's order (collective over the last stage's replicas); None on the
        others. An output without a batch dim is replica 0's."""
        rt = self.runtime
        last = rt.runner(rt.last_stage)
        leaves = flatten((value,) if len(last.ports.sends) == 1 else tuple(value), last.ports.sends, "outputs")
        leaves = [v.cpu() if isinstance(v, torch.Tensor) else v for v in leaves]
        replicas = rt.replicas
        gathered: list[Any] | None = [None] * replicas.count if replicas.index == 0 else None
        dist.gather_object(leaves, gathered, dst=replicas.rank_of(rt.rank, 0), group=replicas.group(rt.rank))
        if gathered is None:
            return None
        merged = [replica_unslice([g[i] for g in gathered], port.batch_dim, rt.m, replicas.batch).to(self.device)
                  if port.kind == "tensor" and port.batch_dim is not None else leaves[i]
                  for i, port in enumerate(last.ports.out_leaves)]
        outs = unflatten(merged, last.ports.sends)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def evaluate(self, *inputs: Any, target: Any = None) -> float:
        """The loss of the batch without gradients (stages in their current mode; call ``eval()``
        first for dropout off), on every rank."""
        if self.model_loss is None:
            raise PipeccError(f"{self._loss_note or 'no loss'}; pass loss_fn= to pipecc.distributed.load")
        self._refresh()
        rows, tgt = self.feed(_one(inputs), target)
        value = self.runtime.infer(rows)
        loss = None
        if value is not None:
            outputs = self._outputs(value)
            with torch.no_grad(), self.runtime.ctx.autocast():
                total = self.model_loss(outputs, tgt)
            replicas = self.runtime.replicas
            if replicas.count > 1:  # each replica's rows: a mean weighted by its share, a sum as it is
                reduction = getattr(self._runtime_loss, "reduction", None) or analyse(
                    self.model_loss, outputs, tgt, _rows_of(tgt) or _rows_of(outputs))
                if reduction.kind not in (MEAN, SUM):
                    raise PipeccError(reduction.message(split_words(1, replicas.count)))
                share = torch.tensor([float(total) * weight(reduction, _rows_of(tgt), self.batch_size)],
                                     dtype=torch.float64, device=self.device)
                wire.all_reduce(share, group=replicas.group(self.runtime.rank))
                loss = float(share)
            else:
                loss = float(total)
        return self._everywhere(loss)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Scale every rank's gradients so that their global norm (each parameter counted once:
        tied copies and replicas once) is at most ``max_norm``; the norm before, on every rank
        (as ``torch.nn.utils.clip_grad_norm_``; collective)."""
        if not isinstance(max_norm, (int, float)) or max_norm < 0 or math.isnan(max_norm):
            raise UsageError(f"clip_grad_norm_: max_norm must be a number >= 0, got {max_norm!r}")
        counted = self._counted_grads()
        inf = math.isinf(norm_type)
        if inf:
            local = max((float(g.detach().abs().max()) for g in counted), default=0.0)
        else:
            local = sum(float(g.detach().double().norm(norm_type) ** norm_type) for g in counted)
        total = torch.tensor([local], dtype=torch.float64, device=self.device)
        if self.world_size > 1:
            wire.all_reduce(total, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM)
        norm = float(total) if inf else float(total) ** (1.0 / norm_type)
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)
        return norm

    # -- checkpoints -----------------------------------------------------------------------------

    def save_checkpoint(self, directory: str | Path, step: int, optimizer: torch.optim.Optimizer | None = None) -> Path:
        """Every rank's model, optimizer and RNG state as ``pipecc run --checkpoint-dir`` writes it
        (``DIR/step_<step>/``, ``latest.json``; ``pipecc export-checkpoint`` reads it); collective."""
        return self._checkpoints(directory, optimizer).save(int(step))

    def load_checkpoint(self, directory: str | Path, optimizer: torch.optim.Optimizer | None = None) -> int:
        """Restore the newest checkpoint in ``directory`` (checksums checked); its step. Collective."""
        step = self._checkpoints(directory, optimizer).resume()
        self._refresh_due = True
        return step

    def _checkpoints(self, directory: str | Path, optimizer: torch.optim.Optimizer | None) -> Any:
        from pipecc.runtime.checkpoints import RunCheckpoints, folder_fingerprint

        self.runtime.optimizer = optimizer
        return RunCheckpoints(Path(directory), self.runtime, folder_fingerprint(self.run.stage_dirs), None, None)

    def close(self) -> None:
        """Leave the process group (collective): a barrier, so no rank tears it down under a
        peer, then every group destroyed and nothing of gloo left running
        (``pipecc.runtime.teardown``), so the script's interpreter exits cleanly."""
        teardown.leave()
        self.forget_groups()

    def forget_groups(self) -> None:
        """Drop this rank's references to the (destroyed) groups pipecc made, so their
        backends end now rather than at exit (``close`` does it)."""
        self.runtime.forget_groups()
        self.tied.forget_groups()

    # -- internals -------------------------------------------------------------------------------

    def _everywhere(self, loss: float | None) -> float:
        """The last stage's value on every rank (one broadcast from replica 0 of the last stage)."""
        if self.world_size == 1:
            return float("nan") if loss is None else loss
        src = self.runtime.replicas.rank_of(self.runtime.schedule.stage_to_rank[self.runtime.last_stage], 0)
        value = torch.tensor([float("nan") if loss is None else loss], dtype=torch.float64, device=self.device)
        wire.broadcast(value, src)
        return float(value)

    def _counted_grads(self) -> list[torch.Tensor]:
        """The gradients this rank counts in a global norm: replica 0's; a tied weight at its first
        stage; no Bi-Partition replica segment (its owner counts it)."""
        if self.runtime.replicas.index != 0:
            return []
        first_holder: dict[str, int] = {}
        for k, spec in enumerate(self.run.specs):
            for name in spec.get("tied", ()) or ():
                first_holder.setdefault(str(name), k)
        grads = []
        for s, module in zip(self.runtime.stage_ids, self.runtime.modules):
            names = _names(module)
            skip = {id(p) for r in getattr(module, "runners", ()) if not getattr(r, "owner", True)
                    for p in r.module.parameters()}
            for attr, p in module.named_parameters():
                name = names.get(attr, (None, None))[0]
                if p.grad is None or id(p) in skip or (name in first_holder and first_holder[name] != s):
                    continue
                grads.append(p.grad)
        return grads

    def _unscale(self, params: Sequence[nn.Parameter]) -> bool:
        """fp16: divide the step's gradients by the loss scale and agree on every rank whether any
        is not finite (then the scale halves; after ``GROWTH_INTERVAL`` clean steps it doubles).
        True on an overflow."""
        bad = 0.0
        for p in params:
            if p.grad is not None:
                p.grad.div_(self.loss_scale)
                if not bool(torch.isfinite(p.grad).all()):
                    bad = 1.0
        flag = torch.tensor([bad], dtype=torch.float64, device=self.device)
        if self.world_size > 1:
            wire.all_reduce(flag, op=dist.ReduceOp.MAX)
        if float(flag) > 0:
            self.loss_scale /= 2.0
            self._good_steps = 0
            return True
        self._good_steps += 1
        if self._good_steps >= GROWTH_INTERVAL:
            self.loss_scale *= 2.0
            self._good_steps = 0
        return False


def _names(module: nn.Module) -> dict[str, tuple[str, tuple[int, int, int] | None]]:
    """A generated stage module's attribute -> (the model's name, (dim, start, size) of a slice)."""
    cls = type(module)
    names: dict[str, Any] = {a: (n, None) for a, n in getattr(cls, "PARAM_NAMES", {}).items()}
    for attr, (name, dim, start, size) in getattr(cls, "SHARDS", {}).items():
        names[attr] = (name, (int(dim), int(start), int(size)))
    return names


def _one(inputs: tuple) -> Any:
    """``step``'s positional inputs as ``feed`` takes them: one value or tuple as given, several as
    a tuple, none as None (a rank that feeds no stage 0)."""
    if not inputs:
        return None
    return inputs[0] if len(inputs) == 1 else inputs


def _rows_of(value: Any) -> int:
    """Rows (dim 0) of a target: a tensor's, or its first tensor's."""
    if isinstance(value, torch.Tensor):
        return int(value.shape[0]) if value.dim() else 1
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return _rows_of(value[0])
    return 1


def _check_rows(value: Any, batch: int, what: str, dim: int = 0) -> None:
    """A batch must have the compiled batch's rows (a one-line error saying how to get them)."""
    if not batch:
        return
    tensors = [value] if isinstance(value, torch.Tensor) else [
        v for v in (value if isinstance(value, (tuple, list)) else ()) if isinstance(v, torch.Tensor)]
    for t in tensors:
        if t.dim() > dim and t.shape[dim] != batch:
            raise PipeccError(f"{what} has {t.shape[dim]} rows, the folder was compiled for batches of {batch}: give "
                              f"full batches (a DataLoader with drop_last=True) or compile with -b {t.shape[dim]}")
