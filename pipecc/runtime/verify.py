"""``--verify``: a command-line run checked against the original computation in one process.

With a model file (``Verifier``) the first training step is checked: every rank builds the
original model from the model file, loads the weights of ALL stages into it (memory: a full
model copy plus all stage weights per rank, fine for test-sized models, costly for large ones),
runs the full batch with the same loss and compares its own stages' parameter gradients and
the buffers forward wrote (a step counter, an EMA: without replicas), the last rank also the
outputs and the loss. A mismatch prints
``pipecc: error: verify: rank R stage S gradient of NAME differs: ...`` and exits 1.

Like with like. Both runs are in train mode; randomness is taken out of both, since a pipeline
draws its dropout masks micro-batch by micro-batch: the pipeline's first step and the reference
run under ``determinism.Deterministic`` (dropout as in eval mode, random draws at their means,
BatchNorm and everything else in train mode), and the verdict says so ("... (train mode; dropout
off in both runs)"). Gradients are always compared. BatchNorm with several micro-batches
normalises each with its own statistics in train mode (legitimately unlike one full-batch pass):
then the reference runs the model over the same pieces of the batch, weighting their losses as
the engine does (``_piecewise``), and the line says so; only when the stages cut unequal
micro-batches of their own (UMPIPE) are eval-mode outputs compared instead, before training. An inference-only run compares the first pass's outputs with the model's eval-mode
forward.

Tolerances follow the dtype (``--rtol``/``--atol`` when given): 1e-4/1e-5 for float32 and
float64 (a little looser than ``torch.testing.assert_close``: micro-batches sum in another
order), float16 1e-3/1e-5, bfloat16 1.6e-2/1e-5 (``assert_close``'s); without ``--atol`` the atol
grows to rtol times the tensor's largest value, the resolution its partial sums had. NaN equals NaN (a loss that
is NaN in both runs matches). A parameter of the model that no stage holds is one the captured
graph never uses (an unused layer): it is left out, unless the reference gives it a gradient,
which is an error naming it. The check is collective: every rank learns whether all passed, and
those whose own check passed stop with ``PeerFailed``.

Replicated stages (PP x DP): every replica compares its stages' gradients after the replicas'
all-reduce (the full-batch gradients), the last stage's replicas the combined loss and their
own rows of the outputs (``_replica_rows``); one of them prints.

Without a model file (``verify_chained``) the pipeline's forward is checked against all stages
chained on the last rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipecc.errors import PipeccError
from pipecc.runtime.determinism import Deterministic
from pipecc.runtime.engine import PipelineRuntime
from pipecc.runtime.ports import as_tuple, output_ports
from pipecc.runtime.local import merge_outputs
from pipecc.techniques.replicas.runtime import replica_slice, slice_sizes
from pipecc.runtime.rundata import RunData
from pipecc.runtime.stagefile import assemble_owner, persistent_buffer
from pipecc.runtime import wire

__all__ = ["PeerFailed", "Verifier", "tolerance", "verify_chained"]

# dtype -> (rtol, atol) when --rtol/--atol are not given (see the module docstring)
_TOLERANCES = {torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5)}
_DEFAULT_TOLERANCE = (1e-4, 1e-5)


def tolerance(dtype: torch.dtype, rtol: float | None = None, atol: float | None = None) -> tuple[float, float]:
    """(rtol, atol) for comparing values of ``dtype``: the given ones, else the dtype's."""
    r, a = _TOLERANCES.get(dtype, _DEFAULT_TOLERANCE)
    return (r if rtol is None else rtol), (a if atol is None else atol)


class PeerFailed(PipeccError):
    """Raised on the ranks that agree to stop because another rank's check failed."""


def verify_chained(outputs: Any, inputs: tuple, modules: list[nn.Module], say: bool = True) -> None:
    """Without a model file: the pipeline's forward against all stages chained in this process
    (``say``: print the verdict; replicas: only one of them does)."""
    values: Any = inputs
    with torch.no_grad():
        for module in modules:
            values = as_tuple(module(*as_tuple(values)))
    expected = values[0] if len(values) == 1 else values
    try:
        torch.testing.assert_close(outputs, expected)
    except AssertionError as e:
        raise PipeccError(f"verify: pipeline outputs differ from the chained stages: {str(e).splitlines()[0]}") from None
    if say:
        print("verify: pipeline outputs match the chained stages", flush=True)


class Verifier:
    """``--verify`` against the original model in this process (see the module docstring); collective."""

    def __init__(self, runtime: PipelineRuntime, data: RunData, meta: dict[str, Any], stage_dirs: list[Path],
                 load_stage: Callable, rtol: float | None = None, atol: float | None = None):
        self.runtime, self.data, self.rtol, self.atol = runtime, data, rtol, atol
        self.is_last = runtime.last_stage in runtime.stage_ids
        self.speaks = self.is_last and runtime.replicas.index == 0  # replicas: one of them prints
        self.file = file = Path(str(meta.get("model_path"))).name
        try:
            model = data.module.build_model(**dict(meta.get("model_args") or {}))
        except Exception as e:
            raise PipeccError(f"verify: build_model in {file} failed: {type(e).__name__}: {e}") from None
        if not isinstance(model, nn.Module):
            raise PipeccError(f"verify: build_model in {file} returned {type(model).__name__}, not an nn.Module")
        stages = [load_stage(d)[0] for d in stage_dirs]
        state = assemble_owner(stages).state_dict()
        wanted = [n for n, _ in model.named_parameters(remove_duplicate=False)]
        wanted += [n for n, _ in model.named_buffers(remove_duplicate=False) if persistent_buffer(model, n)]
        missing = [n for n in wanted if n not in state]
        params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        # NOTE: a parameter no stage holds is one no captured node uses; check_step makes sure
        self.absent = [n for n in missing if n in params]
        missing = [n for n in missing if n not in params and not _held_as_constant(model, n, stages)]
        if missing:
            raise PipeccError(f"verify: the compiled stages hold no tensor for {missing[0]!r} of the model built from "
                              f"{file}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                              + "; was OUT compiled from this file and these --model-arg values?")
        # NOTE: the stages' state dict carries their own modules' versions (nn.Module's 1);
        # loaded into the model they would make a versioned module (torchvision's MNASNet, v2)
        # migrate an old checkpoint's layout: the model's own versions describe these tensors
        state._metadata = getattr(model.state_dict(), "_metadata", None)  # type: ignore[attr-defined]
        try:
            model.load_state_dict(state, strict=False)
        except RuntimeError as e:
            raise PipeccError(f"verify: the stage weights do not fit the model built from {file}: "
                              f"{str(e).strip().splitlines()[-1].strip()}") from None
        self.model = model.to(runtime.device)
        # NOTE: replicas cut every micro-batch again: m * d pieces that BatchNorm normalises apart
        pieces = runtime.m * runtime.replicas.count
        batchnorm = any(isinstance(mod, nn.modules.batchnorm._BatchNorm) for mod in model.modules())
        self.pieces = pieces if batchnorm and pieces > 1 else 1  # the reference runs them one by one
        self.eval_only = None
        if self.pieces > 1 and getattr(runtime.schedule, "microbatch_sizes", None) is not None:
            self.eval_only = ("the model has BatchNorm, which in train mode normalises each micro-batch with its "
                              "own statistics, and the stages cut the batch into unequal micro-batches of their own")

    def deterministic(self) -> Deterministic:
        """The mode the pipeline's checked step runs under (the reference runs under its own)."""
        return Deterministic()

    def _inputs(self) -> tuple:
        return tuple(v.to(self.runtime.device) if isinstance(v, torch.Tensor) else v for v in self.data.model_inputs)

    def _target(self) -> Any:
        t = self.data.target
        if isinstance(t, torch.Tensor):
            return t.to(self.runtime.device)
        if isinstance(t, (tuple, list)):
            return type(t)(x.to(self.runtime.device) if isinstance(x, torch.Tensor) else x for x in t)
        return t

    def check_eval_outputs(self, inputs: Any) -> None:
        """BatchNorm with micro-batches, dropout: eval-mode outputs only, before training."""
        for module in self.runtime.modules:
            module.eval()
        try:
            outputs = self.runtime.infer(inputs)
        finally:
            for module in self.runtime.modules:
                module.train()
        if self.speaks:
            print(f"verify: {self.eval_only}; compared eval-mode outputs only", flush=True)
        self.check_forward(outputs, "verify: eval-mode outputs match the single-process run")

    def check_forward(self, outputs: Any,
                      done: str = "verify: outputs match the single-process run (forward only)") -> None:
        """Inference-only runs: the pipeline's outputs (``infer``) against the model's eval-mode forward."""
        failures: list[str] = []
        if self.is_last:
            self.model.eval()
            with torch.no_grad():
                expected = self.model(*self._inputs())
            failures += self._compare_outputs(outputs, expected)
        self._agree(failures, 0)
        if self.speaks:
            print(done, flush=True)
        del self.model

    def check_step(self, loss: float | None) -> None:
        """After the pipeline's first step (before the optimizer's): outputs, loss, gradients."""
        model = self.model
        model.train()
        model.zero_grad(set_to_none=True)
        with Deterministic() as same:
            if self.pieces > 1:
                outputs, ref_loss = self._piecewise(model)
            else:
                outputs = model(*self._inputs())
                ref_loss = self.data.model_loss(outputs, self._target())
            ref_loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}
        failures: list[str] = [f"verify: the compiled stages hold no tensor for {n!r}, which the model built from "
                               f"{self.file} uses; was OUT compiled from this "
                               "file and these --model-arg values?" for n in self.absent if grads.get(n) is not None]
        count = 0
        for s, module in zip(self.runtime.stage_ids, self.runtime.modules):
            names: dict[str, str] = getattr(type(module), "PARAM_NAMES", {})
            shards: dict[str, tuple] = getattr(type(module), "SHARDS", {})
            for attr, p in module.named_parameters():
                if not p.requires_grad:
                    continue
                if attr in shards:
                    name, dim, start, size = shards[attr]
                    label = f"{name} (slice {start}:{start + size} of dim {dim})"
                    ref = grads.get(name)
                    ref = ref.narrow(dim, start, size) if ref is not None else None
                elif attr in names:
                    name = label = names[attr]
                    ref = grads.get(name)
                else:
                    continue
                if name not in grads:
                    failures.append(f"verify: rank {self.runtime.global_rank} stage {s} parameter {attr} maps to "
                                    f"{name!r}, "
                                    "which the original model does not have")
                    continue
                count += 1
                got = p.grad if p.grad is not None else torch.zeros_like(p)
                ref = ref if ref is not None else torch.zeros_like(p)
                problem = self._differs(got, ref.to(got.device))
                if problem:
                    failures.append(f"verify: rank {self.runtime.global_rank} stage {s} gradient of {label} "
                                    f"differs: {problem}")
        if self.runtime.replicas.count == 1:  # replicas: each updates statistics on its own rows
            failures += self._buffer_failures(model)
        if self.is_last:
            got_loss = float(loss) if loss is not None else float("nan")
            want = float(ref_loss.detach())
            rtol, atol = tolerance(ref_loss.dtype, self.rtol, self.atol)
            if not (abs(got_loss - want) <= atol + rtol * abs(want) or got_loss == want
                    or (math.isnan(got_loss) and math.isnan(want))):
                failures.append(f"verify: rank {self.runtime.global_rank} stage {self.runtime.last_stage} loss "
                                f"{got_loss:.8g} "
                                f"differs from the single-process {want:.8g}")
            failures += self._compare_outputs(self.runtime.last_outputs(), outputs)
        total = self._agree(failures, count)
        if self.speaks:
            print(f"verify: outputs, loss and {total} gradients match the single-process run"
                  f"{_compared(same.seen, self.pieces)}", flush=True)
        del self.model
        model.zero_grad(set_to_none=True)

    def _buffer_failures(self, model: nn.Module) -> list[str]:
        """Buffers the forward wrote (a step counter, an EMA, running statistics): each stage's
        against the model's after its own forward over the batch."""
        ref = dict(model.named_buffers(remove_duplicate=False))
        failures = []
        for s, module in zip(self.runtime.stage_ids, self.runtime.modules):
            names: dict[str, str] = getattr(type(module), "PARAM_NAMES", {})
            for attr, buf in module.named_buffers():
                want = ref.get(names.get(attr, ""))
                problem = self._differs(buf, want.to(buf.device)) if want is not None else None
                if problem:
                    failures.append(f"verify: rank {self.runtime.global_rank} stage {s} buffer "
                                    f"{names[attr]} differs after the step: {problem}")
        return failures

    def _piecewise(self, model: nn.Module) -> tuple[Any, torch.Tensor]:
        """BatchNorm with micro-batches: the model over the pipeline's pieces of the batch (each
        micro-batch, each replica's slice of it), losses weighted by rows as the engine weights
        them; the outputs concatenated back into batch order."""
        inputs, target = self._inputs(), self._target()
        batch = next(int(v.shape[0]) for v in inputs if isinstance(v, torch.Tensor) and v.dim() > 0)
        sizes = [n for mb in slice_sizes(batch, self.runtime.m) for n in slice_sizes(mb, self.runtime.replicas.count)]

        def cut(v: Any) -> list[Any]:
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] % batch == 0:
                c = v.shape[0] // batch
                return list(torch.split(v, [c * n for n in sizes]))
            if isinstance(v, (tuple, list)):
                parts = [cut(x) for x in v]
                return [type(v)(p[k] for p in parts) for k in range(len(sizes))]
            return [v] * len(sizes)

        pieces, targets = [cut(v) for v in inputs], cut(target)
        outputs, losses = [], []
        for k, n in enumerate(sizes):
            if n:
                out = model(*[p[k] for p in pieces])
                outputs.append(out)
                losses.append(self.data.model_loss(out, targets[k]).reshape(()) * (n / batch))
        return merge_outputs(outputs), torch.stack(losses).sum()

    def _compare_outputs(self, sends: Any, expected: Any) -> list[str]:
        names = self.data.send_names
        got = dict(zip(names, (sends,) if len(names) == 1 else tuple(sends)))
        want = self._replica_rows(output_ports(self.data.model_output, expected, {}))
        failures = []
        for name, value in got.items():
            if name not in want:
                continue
            ref = want[name]
            if isinstance(value, list) and not isinstance(ref, list):
                value = value[0]  # an unbatched output: one value per micro-batch
            problem = self._leaves_differ(value, ref, name in self._unsliced)
            if problem:
                failures.append(f"verify: rank {self.runtime.global_rank} stage {self.runtime.last_stage} "
                                f"output {name} "
                                f"differs: {problem}")
        return failures

    def _leaves_differ(self, value: Any, ref: Any, slice_rows: bool) -> str | None:
        """Tensors compared as `_differs` does, leaf by leaf through tuples, lists (a namedtuple
        such as GoogLeNet's outputs) and dicts; `slice_rows`: the reference's tensor leaves are
        the whole batch's, cut to this replica's rows here; other values compared with ==."""
        if isinstance(value, torch.Tensor) and isinstance(ref, torch.Tensor):
            if slice_rows and ref.dim() and self.runtime.replicas.count > 1:
                replicas = self.runtime.replicas
                ref = replica_slice(ref, 0, self.runtime.m, replicas.count, replicas.index, replicas.batch)
            return self._differs(value, ref.detach().to(value.device))
        if isinstance(value, (tuple, list)) and isinstance(ref, (tuple, list)) and len(value) == len(ref):
            for k, (v, r) in enumerate(zip(value, ref)):
                problem = self._leaves_differ(v, r, slice_rows)
                if problem:
                    return f"[{k}]: {problem}"
            return None
        if isinstance(value, dict) and isinstance(ref, dict) and value.keys() == ref.keys():
            for k in value:
                problem = self._leaves_differ(value[k], ref[k], slice_rows)
                if problem:
                    return f"[{k!r}]: {problem}"
            return None
        if isinstance(value, torch.Tensor) or isinstance(ref, torch.Tensor):
            return f"{type(value).__name__} vs {type(ref).__name__} in the single-process run"
        return None if value == ref else f"{value!r} != {ref!r}"

    def _replica_rows(self, values: dict[str, Any]) -> dict[str, Any]:
        """Replicas: the single-process outputs cut to this replica's rows (its slice of every
        micro-batch), which are what its pipeline produced."""
        replicas = self.runtime.replicas
        self._unsliced: set[str] = set()
        if replicas.count == 1:
            return values
        ports = self.runtime.runner(self.runtime.last_stage).ports
        dims = {p.name: p.batch_dim for p in ports.sends if p.kind == "tensor"}
        # NOTE: a port of several tensors (a namedtuple of batched outputs) has no one batch
        # dim: `_leaves_differ` cuts its leaves along dim 0
        self._unsliced = {name for name, v in values.items()
                          if not isinstance(v, torch.Tensor) and name not in dims}
        return {name: replica_slice(v, dims[name], self.runtime.m, replicas.count, replicas.index, replicas.batch)
                if isinstance(v, torch.Tensor) and dims.get(name) is not None else v for name, v in values.items()}

    def _differs(self, got: torch.Tensor, want: torch.Tensor) -> str | None:
        """None when close, else a one-line summary (how many elements, the largest difference)."""
        if got.shape != want.shape:
            return f"shape {list(got.shape)} vs {list(want.shape)} in the single-process run"
        dtype = want.dtype if want.dtype.is_floating_point else got.dtype
        rtol, atol = tolerance(dtype, self.rtol, self.atol)
        if got.is_complex() or want.is_complex():  # both parts compared (a real view, last dim 2)
            got, want = (torch.view_as_real(t.detach().to(torch.complex128).resolve_conj()) for t in (got, want))
        got, want = got.detach().double(), want.detach().double()
        if self.atol is None and want.numel():
            # NOTE: every float type rounds partial sums (micro-batches, another order, another
            # kernel's blocking) to its resolution at the sums' scale, so an element near zero (a
            # cancellation, such as a gradient through BatchNorm over few samples) is off by up to
            # rtol * that scale: seen as 1 element of ResNet-18's conv1 gradient off by 1.5e-5
            finite = want[torch.isfinite(want)]
            atol = max(atol, rtol * float(finite.abs().max())) if finite.numel() else atol
        if torch.allclose(got, want, rtol=rtol, atol=atol, equal_nan=True):
            return None
        diff = (got - want).abs()
        bad = ~torch.isclose(got, want, rtol=rtol, atol=atol, equal_nan=True)
        among = torch.where(bad, torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff),
                            torch.full_like(diff, -1.0))
        worst = int(torch.argmax(among))  # the largest difference among the elements that fail
        where = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), got.shape)) if got.dim() else ()
        return (f"{int(bad.sum())} of {got.numel()} elements, largest difference {float(diff.flatten()[worst]):.3g} "
                f"at {list(where)} ({float(got.flatten()[worst]):.6g} vs {float(want.flatten()[worst]):.6g}; "
                f"rtol {rtol:g}, atol {atol:g})")

    def _agree(self, failures: list[str], count: int) -> int:
        """Every rank learns whether all passed (so all stop together); returns the gradient count."""
        flags = torch.tensor([0.0 if failures else 1.0, float(count)], dtype=torch.float64,
                             device=self.runtime.device)
        if self.runtime.global_world > 1:
            wire.all_reduce(flags)
        if failures:
            more = f" (and {len(failures) - 1} more mismatches)" if len(failures) > 1 else ""
            raise PipeccError(failures[0] + more)
        if int(flags[0]) != self.runtime.global_world:
            raise PeerFailed("verify failed on another rank")
        return int(flags[1])


def _compared(seen: set[str], pieces: int = 1) -> str:
    """What the verdict compared, when the model draws random numbers or has BatchNorm over
    several micro-batches (see the module docstring)."""
    parts = ["dropout off in both runs"] if "dropout" in seen else []
    draws = sorted(seen - {"dropout"})
    if draws:
        parts.append(f"random draws ({', '.join(draws)}) at their means in both runs")
    if pieces > 1:
        parts.append(f"BatchNorm over the same {pieces} micro-batches in both runs")
    return f" (train mode; {'; '.join(parts)})" if parts else ""


def _held_as_constant(model: nn.Module, name: str, stages: list[nn.Module]) -> bool:
    """Whether a stage holds the model's buffer `name` as a constant of equal values (perhaps
    viewed: MaxViT's relative_position_index.view(-1), which the capture kept as a constant)
    rather than under its name: the reference then keeps its own, equal, values."""
    want = model.get_buffer(name)
    for stage in stages:
        for m in stage.modules():
            for t in [*vars(m).values(), *m._buffers.values()]:
                if isinstance(t, torch.Tensor) and t.numel() == want.numel() and t.dtype == want.dtype \
                        and torch.equal(t.detach().cpu().flatten(), want.detach().cpu().flatten()):
                    return True
    return False
