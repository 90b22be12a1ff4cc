"""How micro-batch losses combine into the batch's loss: the model file's ``loss_fn`` analysed
on outputs and a target of the example's shapes (issue 33).

A pipeline computes ``loss_fn`` on each micro-batch (each replica's slice) and back-propagates
the weighted sum of those losses. That equals the loss of the whole batch only when
``loss_fn`` is

- a **mean** over the samples (``cross_entropy``'s default, ``mse_loss``, ``.mean()``): the
  batch's loss is the mean of the parts' losses weighted by their share ``n_i / n``;
- a **sum** over the samples (``reduction="sum"``, ``.sum()``, a fixed divisor such as
  ``.sum() / 8``): the batch's loss is the plain sum of the parts' losses (weight 1).

Anything else (a max, softmax, std or sort over the batch, a loss normalised by a
batch-dependent count) gives other gradients for any split: such a ``loss_fn`` runs only on the
whole batch (one micro-batch, no replicas) and a split is refused in one line.

``analyse`` decides by evaluating ``loss_fn`` on random outputs of the forward's shapes and the
model file's example target: the batch whole and split two ways (halves; one sample and the
rest), with a private generator (the global RNG is restored). A loss is "mean" (or "sum") when,
for every split and two draws, the whole batch's loss equals the weighted combination of the
parts' losses to float tolerance. ``weight(reduction, part, whole)`` is the factor the runtime
multiplies micro-batch loss by: what every runner (``pipecc run``'s stage runner, a training
object) must use so that the steps' gradients are the full batch's.

Imports torch only: the runtime may use it, and the driver does (``driver.analyze``)."""
from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from pipecc.runtime import loss_targets

# the kinds and the launcher's refusals are torch-free (`pipecc run` checks with them)
from pipecc.runtime.loss_kinds import (KINDS, MEAN, MEAN_LOSS, MIXED, SUM, LossReduction, check_run,  # noqa: F401
                                       check_split, split_words)

RTOL, ATOL = 1e-4, 1e-6
SAMPLES = 4  # samples of the example the analysis draws outputs for
WIDE_ELEMENTS = 1 << 24  # up to this many output elements, the analysis runs in float64


def weight(reduction: LossReduction | str, part: int | float, whole: int | float) -> float:
    """The factor for the loss of a part of ``part`` samples of a batch of ``whole`` samples, so
    that the weighted sum of the parts' losses is the batch's loss: ``part / whole`` for a mean,
    1 for a sum. A "mixed" loss has no such factor (the caller refuses the split)."""
    kind = reduction.kind if isinstance(reduction, LossReduction) else reduction
    if kind == SUM:
        return 1.0
    if kind == MEAN:
        return float(part) / float(whole)
    raise ValueError("a loss_fn that mixes samples cannot be combined over micro-batches")


def analyse(loss_fn: Callable[[Any, Any], Any], outputs: Any, target: Any, batch: int) -> LossReduction:
    """The reduction of ``loss_fn`` over the batch dim (module docstring). ``outputs``: the
    model's outputs (real or fake tensors: only shapes and dtypes are used); ``target``: the real
    example target. A batch of one sample cannot be split: "mean"."""
    if batch < 2:
        return MEAN_LOSS
    k = min(batch, SAMPLES)  # the first k samples: a large model's logits stay small here
    outputs, target = _shapes(outputs, batch, k), _slice(target, 0, k, batch)
    splits = [[k // 2, k - k // 2]] + ([[1, k - 1]] if k >= 3 else [])
    state = torch.random.get_rng_state()
    caught = warnings.catch_warnings()
    caught.__enter__()
    warnings.simplefilter("ignore")  # the loss's own warnings were shown by the model check
    wide = sum(_numel(outputs)) <= WIDE_ELEMENTS
    try:
        found = None
        try:  # in float64 first: the comparison then needs no float32 slack
            if wide:
                found = _analyse(loss_fn, outputs, _cast(target, torch.float64), k, splits, torch.float64, RTOL)
        except _Failed:
            pass
        if found is None:
            try:
                found = _analyse(loss_fn, outputs, target, k, splits, None, 1e-3)
            except _Failed as failed:
                found = LossReduction(MIXED, str(failed))
        if found.kind == MIXED and _weighted(loss_fn, outputs, target, k, splits):
            return MEAN_LOSS  # a mean its targets weigh: each step's factors found from its targets
        return found
    finally:
        caught.__exit__(None, None, None)
        torch.random.set_rng_state(state)


def _weighted(loss_fn: Callable[[Any, Any], Any], outputs: Any, target: Any, batch: int,
              splits: list[list[int]]) -> bool:
    """Whether ``loss_fn`` is, on the example target, a combination of its parts' losses with
    factors its targets set (cross_entropy's mean with ignore_index entries or class weights): a
    mean the runtime weighs step by step (``step_factors``)."""
    moved = False
    flipped = _map_leaves(target, lambda t: t.flip(0) if t.dim() and t.shape[0] == batch else t)
    for sizes in splits:
        draws = []
        for tgt, seed in ((target, 1), (target, 2), (flipped, 1)):
            targets = [_slice(tgt, lo, hi, batch) for lo, hi in _bounds(sizes)]
            draws.append(_factors(loss_fn, _shapes(outputs, batch, sizes[0]), 0, targets, sizes, seed))
        if not all(isinstance(d, list) for d in draws) or not _same(draws[0], draws[1]):
            return False  # not a combination, or one the outputs set (a max)
        moved = moved or not _same(draws[0], draws[2])
    return moved  # the targets set the factors (not the sample counts alone: a count of the batch)


def _same(a: list[float], b: list[float]) -> bool:
    return all(abs(x - y) <= 1e-6 * max(abs(x), abs(y), 1e-9) for x, y in zip(a, b))


class _Failed(Exception):
    """loss_fn raised or returned no finite value (the message says where)."""


def _analyse(loss_fn: Callable[[Any, Any], Any], outputs: Any, target: Any, batch: int,
             splits: list[list[int]], dtype: torch.dtype | None, rtol: float) -> LossReduction:
    found = {MEAN: True, SUM: True}
    for seed in (0, 1):
        gen = torch.Generator().manual_seed(1234 + seed)
        outs = _random_tree(outputs, gen, dtype)
        whole = _call(loss_fn, outs, target, "the whole batch")
        for sizes in splits:
            parts = [_call(loss_fn, _slice(outs, lo, hi, batch), _slice(target, lo, hi, batch),
                           f"samples {lo}:{hi} of the batch") for lo, hi in _bounds(sizes)]
            for kind in (MEAN, SUM):
                combined = sum(weight(kind, n, batch) * p for n, p in zip(sizes, parts))
                if abs(combined - whole) > ATOL + rtol * max(abs(whole), abs(combined)):
                    found[kind] = False
    if found[MEAN]:
        return MEAN_LOSS
    if found[SUM]:
        return LossReduction(SUM)
    return LossReduction(MIXED, "its value on the batch is neither the weighted mean nor the sum of its "
                         "values on parts of it: a max, softmax, std or count over the batch")


def _call(loss_fn: Callable[[Any, Any], Any], outs: Any, target: Any, where: str) -> float:
    try:
        loss = loss_fn(outs, target)
    except Exception as exc:
        raise _Failed(f"it raised {type(exc).__name__} on {where}") from None
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        raise _Failed(f"it returned no one-element floating tensor on {where}")
    v = float(loss.detach().reshape(()).double())
    if v != v or abs(v) == float("inf"):
        raise _Failed(f"it returned {v} on {where} of random outputs")
    return v


def _shapes(value: Any, batch: int, k: int) -> Any:
    """``value``'s tensors as empty ones of k samples where dim 0 is the batch (shape and dtype
    are all the analysis reads of the outputs)."""
    if isinstance(value, torch.Tensor):
        shape = (k, *value.shape[1:]) if value.dim() and value.shape[0] == batch else tuple(value.shape)
        return torch.empty(shape, dtype=value.dtype, device="meta")
    if isinstance(value, dict):
        return type(value)((key, _shapes(v, batch, k)) for key, v in value.items())
    if isinstance(value, (tuple, list)):
        return _rebuilt(value, [_shapes(v, batch, k) for v in value])
    return value


def _numel(value: Any) -> Iterator[int]:
    if isinstance(value, torch.Tensor):
        yield value.numel()
    elif isinstance(value, dict):
        for v in value.values():
            yield from _numel(v)
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _numel(v)


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, dict):
        return type(value)((k, _cast(v, dtype)) for k, v in value.items())
    if isinstance(value, (tuple, list)):
        return _rebuilt(value, [_cast(v, dtype) for v in value])
    return value


def _bounds(sizes: list[int]) -> Iterator[tuple[int, int]]:
    lo = 0
    for n in sizes:
        yield lo, lo + n
        lo += n


def _random_tree(value: Any, gen: torch.Generator, dtype: torch.dtype | None) -> Any:
    """Real tensors of ``value``'s shapes: floating ones drawn from N(0, 1) (as ``dtype``, or
    their own dtype with 16-bit floats widened to float32), others zero."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            own = torch.float32 if value.dtype in (torch.float16, torch.bfloat16) else value.dtype
            return torch.randn(tuple(value.shape), generator=gen, dtype=torch.float64).to(dtype or own)
        return torch.zeros(tuple(value.shape), dtype=value.dtype)
    if isinstance(value, dict):
        return type(value)((k, _random_tree(v, gen, dtype)) for k, v in value.items())
    if isinstance(value, (tuple, list)):
        return _rebuilt(value, [_random_tree(v, gen, dtype) for v in value])
    return value


def _slice(value: Any, lo: int, hi: int, batch: int) -> Any:
    """Samples lo:hi of every tensor whose dim 0 is the batch (the others whole), as the runtime
    splits outputs and target."""
    if isinstance(value, torch.Tensor):
        return value[lo:hi] if value.dim() and value.shape[0] == batch else value
    if isinstance(value, dict):
        return type(value)((k, _slice(v, lo, hi, batch)) for k, v in value.items())
    if isinstance(value, (tuple, list)):
        return _rebuilt(value, [_slice(v, lo, hi, batch) for v in value])
    return value


def _rebuilt(value: Any, items: list) -> Any:
    """A tuple or list like ``value`` holding ``items`` (a namedtuple, e.g. GoogLeNet's outputs,
    takes them as positional fields)."""
    if isinstance(value, tuple) and hasattr(type(value), "_fields"):
        return type(value)(*items)
    return type(value)(items)


# ---------------------------------------------------------------------------- this step's targets
# A mean that counts targets (cross_entropy's ignore_index, its class weights, a masked mean
# ``(err * mask).sum() / mask.sum()``) is a mean over the samples for the example target and yet
# weighs micro-batches by what their targets hold: with ignored targets spread unevenly, parts
# weighted n_i / n give other gradients than the batch. ``step_factors`` finds each step's true
# factors from the step's own targets.

def step_factors(loss_fn: Callable[[Any, Any], Any], value: Any, mb: int, targets: list[Any],
                 sizes: list[int], kind: str, replicas: int = 1) -> list[float] | None:
    """The factors ``w_i`` with ``loss_fn(batch) == sum_i w_i * loss_fn(part i)`` for this step's
    ``targets`` (one per micro-batch, ``sizes[i]`` samples each; ``value``: micro-batch ``mb``'s
    outputs, for their shapes), or None when they are the analysed ones (``weight(kind, ...)``)
    or cannot be found (a target or output without the batch as dim 0: the analysed ones hold).

    How: a weighted mean ``sum_j a_j l_j / sum_j a_j`` over parts is ``sum_i (A_i / A) *
    loss_i``. On random outputs of the parts' shapes (on the outputs' device), the loss of two
    parts joined has, on each, a gradient ``c`` times that part's own, checked element by element
    and on the value: ``c_i / c_r = A_i / A_r`` (``_factors_as``). Costs about three forwards and
    backwards of ``loss_fn`` on the batch, two micro-batches at a time (no model), on the rank
    holding the last stage: on the first step of each shape, then only where ``loss_targets``'
    trace of ``loss_fn`` cannot say (its counted or fixed factors stand in for it otherwise).

    Refused (PipeccError, one line) when this step's loss is no such combination. With
    replicas the caller passes every replica's micro-batches (``StageRunner.every_replica``);
    ``replicas`` > 1 here means only this replica's are known: factors other than the analysed
    ones are then refused (the batch's are not known on this rank)."""
    from pipecc.errors import PipeccError
    whole = sum(sizes)
    analysed = [weight(kind, n, whole) for n in sizes]
    if len(sizes) < 2 or len(targets) != len(sizes):
        return None
    # NOTE: found in float32 (outputs too large for float64), the factors carry its rounding: within
    # 1e-4 of the analysed ones they are taken for them (the difference is float32's own noise)
    close = 1e-6 if _wide(value, mb, sizes) else 1e-4

    def same(a: list[float], b: list[float]) -> bool:
        return all(abs(x - y) <= 1e-9 + close * max(abs(x), abs(y)) for x, y in zip(a, b))

    # the trace of loss_fn says whether targets can weigh the micro-batches (loss_targets): once the
    # probe has confirmed it on a real step, its quick answer stands in for the probe
    step = loss_targets.step_of(loss_fn, value, mb, targets, sizes) if kind in (MEAN, SUM) else None
    quick = step.quick(targets, sizes) if step is not None else loss_targets.PROBE
    if step is not None and step.settled and quick != loss_targets.PROBE:
        found: list[float] | str | None = quick
    else:
        found = _factors(loss_fn, value, mb, targets, sizes)
        if step is not None and isinstance(found, list) and quick != loss_targets.PROBE:
            step.settled = same(found, analysed if quick is None else quick)  # type: ignore[arg-type]
            if not step.settled:  # the trace's reading is wrong for this loss: the probe, for good
                step.kind = loss_targets.PROBE
    if found is None:
        return None
    if isinstance(found, str):
        raise PipeccError(f"loss_fn on this step's targets {found}, so the losses of {len(sizes)} micro-batches do "
                          "not combine into the batch's loss; give --microbatches 1 --replicas 1")
    if same(found, analysed):
        return None
    if replicas > 1:
        raise PipeccError("loss_fn weighs this step's micro-batches by what their targets hold (e.g. "
                          "cross_entropy's ignore_index or class weights, a masked mean), not by their sample "
                          f"counts, and {replicas} replicas each see only their own targets; give --replicas 1 "
                          "(the micro-batches are then weighed exactly)")
    return found


def _factors(loss_fn: Callable[[Any, Any], Any], value: Any, mb: int, targets: list[Any],
             sizes: list[int], seed: int = 4321) -> list[float] | str | None:
    leaves = list(_leaves(value))
    if not sizes[mb] or not any(isinstance(t, torch.Tensor) and t.is_floating_point() for t in leaves):
        return None
    for t in leaves:
        if isinstance(t, torch.Tensor) and (not t.dim() or t.shape[0] % sizes[mb]):
            return None  # an output that does not carry the batch in dim 0
    batch_target = _cat_targets(targets)
    if batch_target is None:
        return None
    found: list[float] | str | None = None
    for dtype, rtol in ((torch.float64, 1e-7), (torch.float32, 1e-3)):  # float32: a loss holding float32 tensors
        if dtype == torch.float64 and not _wide(value, mb, sizes):
            continue
        found = _factors_as(loss_fn, value, mb, targets, sizes, dtype, rtol, seed)
        if found is not None:
            return found
    return found


def _wide(value: Any, mb: int, sizes: list[int]) -> bool:
    """Whether two of the largest micro-batches' outputs are few enough to find factors in float64."""
    rows = 2 * max(sizes)
    return sum(t.numel() // max(sizes[mb], 1) * rows for t in _leaves(value)) <= WIDE_ELEMENTS


def _factors_as(loss_fn: Callable[[Any, Any], Any], value: Any, mb: int, targets: list[Any], sizes: list[int],
                dtype: torch.dtype, rtol: float, seed: int = 4321) -> list[float] | str | None:
    """The factors from pairs of micro-batches: a reference part r (one whose loss has a
    gradient) and each other part i, joined: the pair's gradient on each is ``c`` times its own,
    and the pair's loss ``c_r * loss_r + c_i * loss_i``. A weighted mean has ``c_r + c_i = 1``
    (``c_i / c_r = A_i / A_r``), a sum ``c_r = c_i = 1``. Two micro-batches at a time: the
    batch's outputs are never made whole (an LM's logits)."""
    leaves = [t for t in _leaves(value) if isinstance(t, torch.Tensor)]
    device = next((t.device for t in leaves if t.device.type != "meta"), torch.device("cpu"))
    tol = 1e-12

    def part(i: int) -> Any:
        gen = torch.Generator(device=device).manual_seed(seed + i)

        def leaf(t: torch.Tensor) -> torch.Tensor:
            shape = (t.shape[0] // sizes[mb] * sizes[i], *t.shape[1:])
            if t.is_floating_point():
                return torch.randn(shape, generator=gen, dtype=dtype, device=device).requires_grad_()
            return torch.zeros(shape, dtype=t.dtype, device=device)
        return _map_leaves(value, leaf)

    def target(i: int) -> Any:
        return _map_leaves(targets[i], lambda t: t.to(device))

    def alone(i: int) -> tuple[Any, float | None, list[torch.Tensor], float]:
        p = part(i)
        loss, grads = _loss_and_grads(loss_fn, p, target(i), list(_leaves(p)))
        return p, loss, grads, sum(float((g.double() ** 2).sum()) for g in grads)

    def multiple(got: list[torch.Tensor], own: list[torch.Tensor], norm: float) -> float | None:
        """c with got = c * own (None: not a multiple)."""
        c = sum(float((a.double() * b.double()).sum()) for a, b in zip(got, own)) / norm if norm > 0 else 0.0
        scale = max((float(a.abs().max()) for a in got if a.numel()), default=0.0)
        if any(float((a.double() - c * b.double()).abs().max()) > tol + rtol * 10 * scale
               for a, b in zip(got, own) if a.numel()):
            return None
        return c

    state = torch.random.get_rng_state()
    not_combined = "is not a weighted mean or sum of its values on the micro-batches"
    try:
        with torch.enable_grad(), torch.autocast(device.type, enabled=False), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = None
            for r in range(len(sizes)):
                found = alone(r)
                if found[1] is None:
                    return None
                if found[3] > 0:
                    ref = (r, *found)
                    break
            if ref is None:
                return None  # no micro-batch's loss has a gradient: nothing to weigh
            r, p_r, loss_r, grads_r, norm_r = ref
            pairs: dict[int, tuple[float, float]] = {}
            for i in range(len(sizes)):
                if i == r:
                    continue
                p_i, loss_i, grads_i, norm_i = alone(i)
                if loss_i is None:
                    return None
                joined = [torch.cat([a.detach(), b.detach()]).requires_grad_(a.requires_grad)
                          for a, b in zip(_leaves(p_r), _leaves(p_i))]
                it = iter(joined)
                pair = _map_leaves(value, lambda _t: next(it))
                both = _cat_targets([target(r), target(i)])
                if both is None:
                    return None
                loss_pair, grads_pair = _loss_and_grads(loss_fn, pair, both, joined)
                if loss_pair is None or loss_pair != loss_pair:
                    return None
                cut = [(g.shape[0] * sizes[r]) // (sizes[r] + sizes[i]) for g in grads_pair]
                c_r = multiple([g[:k] for g, k in zip(grads_pair, cut)], grads_r, norm_r)
                c_i = multiple([g[k:] for g, k in zip(grads_pair, cut)], grads_i, norm_i)
                if c_r is None or c_i is None:
                    return f"{not_combined} (the gradient of micro-batch {i} is not a multiple of theirs joined)"
                if c_r <= tol or (norm_i > 0 and c_i <= tol):  # its own loss depends on it, the pair's not (a max)
                    return f"{not_combined} (a micro-batch counts for nothing joined, yet its own loss depends on it)"
                combined = c_r * loss_r + (c_i * loss_i if c_i else 0.0)
                if abs(combined - loss_pair) > tol + rtol * 10 * max(abs(loss_pair), abs(combined)):
                    return f"{not_combined} (the loss of micro-batches {r} and {i} joined)"
                pairs[i] = (c_r, c_i)
            near = 1e-6 if dtype == torch.float64 else 1e-3
            if all(abs(c_r + c_i - 1) <= near for c_r, c_i in pairs.values()):  # a weighted mean
                ratio = [1.0 if i == r else pairs[i][1] / pairs[i][0] for i in range(len(sizes))]
                return [x / sum(ratio) for x in ratio]
            if all(abs(c_r - 1) <= near and (abs(c_i - 1) <= near or c_i == 0) for c_r, c_i in pairs.values()):
                return [1.0] * len(sizes)  # a sum
            return not_combined
    except Exception:  # the compile's analysis ran it on random outputs; a failure here changes nothing
        return None
    finally:
        torch.random.set_rng_state(state)


def _loss_and_grads(loss_fn: Callable[[Any, Any], Any], value: Any, target: Any,
                    leaves: list[torch.Tensor]) -> tuple[float | None, list[torch.Tensor]]:
    loss = loss_fn(value, target)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        return None, []
    wrt = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
    grads = torch.autograd.grad(loss.reshape(()), wrt, allow_unused=True)
    return float(loss.detach().double()), [torch.zeros_like(t) if g is None else g.detach() for t, g in zip(wrt, grads)]


def _leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _leaves(v)
    elif isinstance(value, torch.Tensor):
        yield value


def _map_leaves(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return type(value)((k, _map_leaves(v, fn)) for k, v in value.items())
    if isinstance(value, (tuple, list)):
        return _rebuilt(value, [_map_leaves(v, fn) for v in value])
    return value


def _cat_targets(targets: list[Any]) -> Any:
    """The batch's target from the micro-batches' (tensors, or tuples/lists of them), or None."""
    first = targets[0]
    if isinstance(first, torch.Tensor):
        if not all(isinstance(t, torch.Tensor) and t.dim() for t in targets):
            return None
        return torch.cat(list(targets))
    if isinstance(first, (tuple, list)) and first and all(isinstance(t, type(first)) and len(t) == len(first)
                                                          for t in targets):
        cols = [_cat_targets([t[k] for t in targets]) for k in range(len(first))]
        return None if any(c is None for c in cols) else type(first)(cols)
    return None
