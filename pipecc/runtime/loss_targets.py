"""Whether a step's targets can change how its micro-batch losses combine, read once from a
trace of ``loss_fn`` (issue 31: the per-step probe cost 26-57x the loss it weighs).

``loss_reduction.step_factors`` finds each step's factors on the micro-batch losses by probing
``loss_fn`` on random outputs: exact for any weighted mean or sum, and as costly as three
forwards and backwards of the loss on the whole batch. Most losses never need it: their factors
follow from the micro-batch sizes whatever the targets hold. This module traces ``loss_fn``
once per shape (``make_fx`` on fake tensors, so no output is computed) and follows the
targets' values through the aten graph:

- **fixed**: a target value reaches the loss only element by element (point-wise ops, views,
  a ``gather`` along a non-leading dim, a fixed-divisor loss such as ``mse_loss``, an
  ``nll_loss`` that sums or keeps every element) and reductions of those terms are added or
  scaled by constants, never multiplied or divided by each other. Nothing counts targets, so
  the factors are the analysed ones (``n_i / n`` for a mean, 1 for a sum).
- **counted**: the loss is, up to constants and views, one ``nll_loss`` mean (``cross_entropy``)
  with ``ignore_index`` and optional constant class weights. Its factor for micro-batch i is
  exactly ``A_i / A`` with ``A_i = sum_j w[t_j] [t_j != ignore_index]`` over the targets the
  nll sees, which the graph's target-only nodes give when replayed on the step's real targets
  (a shift, a pad or a ``.long()`` included).
- **guarded**: an nll mean next to other terms: its factors are the analysed ones while no
  target it sees equals ``ignore_index`` (and it has no class weights); the probe runs on a
  step where one does.
- **probe**: anything else (a count of the targets such as ``mask.sum()``, label smoothing
  with ``ignore_index``, a data-dependent branch, an op not listed here): the probe runs every
  step, as before.

The probe still runs on the first step of every shape, on the step's real targets: it refuses a
loss that is no weighted combination (a sample-mixing loss the compile's analysis missed) and
checks this module's answer; a disagreement sends that shape to the probe for good."""
from __future__ import annotations

import operator
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

FIXED, COUNTED, GUARDED, PROBE = "fixed", "counted", "guarded", "probe"

_O, _T, _R = 1, 2, 4  # depends on the outputs / on the targets / a reduction of target-dependent terms

_aten = torch.ops.aten
_VIEWS = {_aten.view, _aten.reshape, _aten._unsafe_view, _aten.expand, _aten.permute, _aten.transpose, _aten.t,
          _aten.squeeze, _aten.unsqueeze, _aten.slice, _aten.select, _aten.alias, _aten.clone, _aten._to_copy,
          _aten.detach, _aten.lift_fresh_copy, _aten.flatten, _aten.narrow, _aten.contiguous, _aten.unbind,
          _aten.split, _aten.split_with_sizes, _aten.to, _aten.type_as, _aten.lift_fresh}
_POINTWISE_EXTRA = {_aten.masked_fill, _aten.masked_fill_, _aten.where}
_REDUCTIONS = {_aten.sum, _aten.mean}
_FIXED_LOSSES = {_aten.mse_loss, _aten.l1_loss, _aten.smooth_l1_loss, _aten.huber_loss, _aten.soft_margin_loss,
                 _aten.binary_cross_entropy, _aten.binary_cross_entropy_with_logits}
_NLL = {_aten.nll_loss_forward, _aten.nll_loss2d_forward}
_LINEAR = {_aten.add, _aten.sub, _aten.neg, _aten.rsub}
_SCALE = {_aten.mul, _aten.div}


@dataclass
class Count:
    """An nll mean's count: ``target`` (the graph node the nll reads its targets from),
    ``ignore`` (its ignore_index) and ``weight`` (its constant class weights, or None)."""
    target: torch.fx.Node
    ignore: int
    weight: torch.Tensor | None


@dataclass
class Use:
    """What one trace found: ``kind``, ``why`` (for "probe"), and for counted and guarded uses
    the graph and its nll counts (``values``: how many placeholders the outputs take)."""
    kind: str
    why: str = ""
    graph: torch.fx.GraphModule | None = None
    counts: list[Count] = field(default_factory=list)
    values: int = 0

    def seen(self, target: Any) -> list[torch.Tensor]:
        """The targets each count's nll reads, replayed on one micro-batch's real ``target``."""
        assert self.graph is not None
        leaves = [t for t in pytree.tree_leaves(target) if isinstance(t, torch.Tensor)]
        env: dict[torch.fx.Node, Any] = {}

        def run(n: torch.fx.Node) -> Any:
            if n not in env:
                if n.op == "placeholder":
                    env[n] = leaves[int(n.meta["pipecc_leaf"]) - self.values]
                elif n.op == "get_attr":
                    env[n] = getattr(self.graph, str(n.target))
                else:
                    args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), run)
                    env[n] = n.target(*args, **kwargs)  # type: ignore[operator]
            return env[n]
        with torch.no_grad():
            return [run(c.target) for c in self.counts]


@dataclass
class Step:
    """A step shape's use (one ``Use`` per micro-batch size, all of one kind) and whether the
    probe has confirmed it on a real step (``settled``)."""
    kind: str
    why: str
    uses: dict[int, Use]
    settled: bool = False

    def quick(self, targets: list[Any], sizes: list[int]) -> list[float] | None | str:
        """This step's factors without the probe: None (the analysed ones), a list (counted),
        or PROBE (the probe must find them)."""
        if self.kind == FIXED:
            return None
        if self.kind not in (COUNTED, GUARDED):
            return PROBE
        try:
            seen = [(self.uses[n], self.uses[n].seen(t)) for t, n in zip(targets, sizes)]
        except Exception:  # a target of another structure than the traced one
            return PROBE
        if self.kind == GUARDED:
            clear = all(c.weight is None and not bool((s == c.ignore).any())
                        for use, per in seen for c, s in zip(use.counts, per))
            return None if clear else PROBE
        mass = [_mass(per[0], use.counts[0]) for use, per in seen]
        total = sum(mass)
        if not total > 0:
            return PROBE  # every target ignored: the batch's loss is 0/0 (the probe says what holds)
        return [a / total for a in mass]


def _mass(seen: torch.Tensor, count: Count) -> float:
    keep = seen != count.ignore
    if count.weight is None:
        return float(keep.sum())
    w = count.weight.to(seen.device)
    return float((w[torch.where(keep, seen, 0).long()] * keep).sum())


# ------------------------------------------------------------------------------------ the cache
_SEEN: weakref.WeakKeyDictionary[Any, dict[Any, Step]] = weakref.WeakKeyDictionary()
_STRONG: dict[int, tuple[Any, dict[Any, Step]]] = {}  # loss functions that take no weak reference


def step_of(loss_fn: Callable[[Any, Any], Any], value: Any, mb: int, targets: list[Any],
            sizes: list[int]) -> Step:
    """The target use of ``loss_fn`` for this step's shapes, traced once per shape and remembered
    (per loss function, weakly). A micro-batch size other than ``mb``'s is traced on empty
    outputs of its size; the sizes' uses must be of one kind, or the step is probed."""
    bound = hasattr(loss_fn, "__func__") and hasattr(loss_fn, "__self__")
    owner, func = (getattr(loss_fn, "__self__"), getattr(loss_fn, "__func__")) if bound else (loss_fn, None)
    try:
        per = _SEEN.setdefault(owner, {})
    except TypeError:  # no weak reference (a builtin): kept, a few at most
        if len(_STRONG) > 16:
            _STRONG.clear()
        per = _STRONG.setdefault(id(owner), (owner, {}))[1]
    key = (func, _signature(value, mb, targets, sizes))
    if key not in per:
        uses: dict[int, Use] = {}
        for i, n in enumerate(sizes):
            if n not in uses:
                uses[n] = _trace(loss_fn, value if n == sizes[mb] else _resized(value, sizes[mb], n), targets[i])
        kinds = {(u.kind, len(u.counts)) for u in uses.values()}
        one = uses[sizes[mb]]
        per[key] = Step(one.kind, one.why, uses) if len(kinds) == 1 else \
            Step(PROBE, "micro-batches of different sizes trace differently", uses)
    return per[key]


def _signature(value: Any, mb: int, targets: list[Any], sizes: list[int]) -> tuple:
    def shapes(tree: Any) -> tuple:
        return tuple((tuple(t.shape), t.dtype, t.device.type) if isinstance(t, torch.Tensor) else type(t)
                     for t in pytree.tree_leaves(tree))
    return shapes(value), sizes[mb], tuple(sizes), tuple(shapes(t) for t in targets)


def _resized(value: Any, had: int, n: int) -> Any:
    def leaf(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dim() and had and t.shape[0] % had == 0:
            return t.new_empty((t.shape[0] // had * n, *t.shape[1:]))
        return t
    return pytree.tree_map(leaf, value)


def _trace(loss_fn: Callable[[Any, Any], Any], value: Any, target: Any) -> Use:
    from torch.fx.experimental.proxy_tensor import make_fx
    out_leaves, out_spec = pytree.tree_flatten(value)
    tgt_leaves, tgt_spec = pytree.tree_flatten(target)
    out_at = [i for i, t in enumerate(out_leaves) if isinstance(t, torch.Tensor)]
    tgt_at = [i for i, t in enumerate(tgt_leaves) if isinstance(t, torch.Tensor)]

    def flat(*tensors: torch.Tensor) -> Any:
        outs, tgts = list(out_leaves), list(tgt_leaves)
        for i, t in zip(out_at, tensors[:len(out_at)]):
            outs[i] = t
        for i, t in zip(tgt_at, tensors[len(out_at):]):
            tgts[i] = t
        return loss_fn(pytree.tree_unflatten(outs, out_spec), pytree.tree_unflatten(tgts, tgt_spec))

    args = [out_leaves[i].detach() for i in out_at] + [tgt_leaves[i].detach() for i in tgt_at]
    device = next((t.device.type for t in args), "cpu")
    state = torch.random.get_rng_state()
    try:
        with warnings.catch_warnings(), torch.autocast(device, enabled=False):
            warnings.simplefilter("ignore")
            gm = make_fx(flat, tracing_mode="fake", _allow_non_fake_inputs=True)(*args)
    except Exception as exc:  # a data-dependent branch, an op fake tensors cannot run, ...
        return Use(PROBE, f"loss_fn cannot be traced ({type(exc).__name__})")
    finally:
        torch.random.set_rng_state(state)
    return read(gm, len(out_at))


def read(gm: torch.fx.GraphModule, values: int) -> Use:
    """The target use of a traced loss: placeholders ``0..values-1`` are the outputs', the rest
    the targets' (module docstring)."""
    flags: dict[torch.fx.Node, int] = {}
    counts: dict[torch.fx.Node, Count] = {}
    placeholders = 0
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            n.meta["pipecc_leaf"] = placeholders
            flags[n] = _O if placeholders < values else _T
            placeholders += 1
            continue
        if n.op == "output":
            break
        ins = [flags.get(a, 0) for a in n.all_input_nodes]
        f = 0
        for x in ins:
            f |= x
        if n.op != "call_function" or not f & _T:
            flags[n] = f
            continue
        why = _why_not(n, f, ins, flags, counts)
        if why:
            return Use(PROBE, why)
        flags[n] = _flag(n, f, flags)
    out = gm.graph.output_node().args[0]
    out = out[0] if isinstance(out, (tuple, list)) and len(out) == 1 else out
    for n in gm.graph.nodes:  # the fake values are read: a remembered graph keeps none of them
        n.meta.pop("val", None)
        n.meta.pop("tensor_meta", None)
    if not counts:
        return Use(FIXED, graph=gm, values=values)
    nll = _scaled_from(out)
    if nll is not None and nll in counts and len(counts) == 1:
        return Use(COUNTED, graph=gm, counts=[counts[nll]], values=values)
    return Use(GUARDED, graph=gm, counts=list(counts.values()), values=values)


def _packet(n: torch.fx.Node) -> Any:
    return getattr(n.target, "overloadpacket", n.target)


def _pointwise(n: torch.fx.Node) -> bool:
    return torch.Tag.pointwise in getattr(n.target, "tags", ()) or _packet(n) in _POINTWISE_EXTRA


def _why_not(n: torch.fx.Node, f: int, ins: list[int], flags: dict[torch.fx.Node, int],
             counts: dict[torch.fx.Node, Count]) -> str:
    """Why the target values reaching ``n`` may change the factors ("" when they cannot)."""
    op = _packet(n)
    name = getattr(op, "__name__", str(op))
    if n.target is operator.getitem:
        src = n.args[0]
        if isinstance(src, torch.fx.Node) and _packet(src) in _NLL and n.args[1] == 1 and n.users:
            return "loss_fn reads nll_loss's total weight (a count of the targets)"
        return ""
    if f == _T:  # target-only: element-wise, views and a pad along later dims only (no counts)
        if str(name).endswith("_"):
            return f"loss_fn changes its target in place ({name})"
        if _pointwise(n) or op in _VIEWS:
            return ""
        if op is _aten.constant_pad_nd and len(n.args[1]) <= 2 * (len(n.args[0].meta["val"].shape) - 1):
            return ""
        return f"loss_fn computes {name} of its targets alone (a count or a statistic of the targets)"
    if op in _NLL:
        self_, target, weight = n.args[0], n.args[1], n.args[2] if len(n.args) > 2 else None
        if flags.get(self_, 0) & _T or flags.get(target, 0) != _T or isinstance(weight, torch.fx.Node) and \
                (flags.get(weight, 0) or weight.op != "get_attr"):
            return f"{name}'s inputs mix outputs and targets"
        reduction = n.args[3] if len(n.args) > 3 else 1
        if reduction == 1:
            w = None if weight is None else getattr(n.graph.owning_module, str(weight.target))
            counts[n] = Count(target, int(n.args[4]) if len(n.args) > 4 else -100, w)
        return ""
    if _pointwise(n):
        tainted = sum(1 for x in ins if x & _T)
        if f & _R and tainted > 1 and op not in _LINEAR:
            return f"loss_fn combines target-dependent reductions with {name} (a normalisation by the targets)"
        return ""
    if op in _VIEWS or op in _REDUCTIONS:
        return ""
    if op in _FIXED_LOSSES:
        rest = [a for a in n.all_input_nodes[2:] if flags.get(a, 0) & _T]
        return f"{name}'s weights depend on the targets" if rest else ""
    if op is _aten.gather:
        index, dim = n.args[2], n.args[1]
        ndim = len(n.args[0].meta["val"].shape)
        return "loss_fn gathers along the batch dim by target" if flags.get(index, 0) & _T and dim % ndim == 0 else ""
    if op is _aten.index:
        indices = n.args[1]
        first = indices[0] if indices else None
        return "loss_fn indexes the batch dim by target" if isinstance(first, torch.fx.Node) and \
            flags.get(first, 0) & _T else ""
    return f"target values reach {name}, which pipecc does not follow"


def _flag(n: torch.fx.Node, f: int, flags: dict[torch.fx.Node, int]) -> int:
    op = _packet(n)
    if op in _REDUCTIONS or op in _FIXED_LOSSES:
        return f | _R
    if op in _NLL:
        reduction = n.args[3] if len(n.args) > 3 else 1
        return f | (_R if reduction else 0)
    return f


def _scaled_from(node: Any) -> torch.fx.Node | None:
    """The nll node ``node`` is, up to views, negation and constant factors (None otherwise)."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        op = _packet(node)
        if node.target is operator.getitem:
            src = node.args[0]
            return src if node.args[1] == 0 and isinstance(src, torch.fx.Node) and _packet(src) in _NLL else None
        if op in _VIEWS or op is _aten.neg:
            node = node.args[0]
        elif op in _SCALE and not isinstance(node.args[1], torch.fx.Node):
            node = node.args[0]
        elif op is _aten.mul and not isinstance(node.args[0], torch.fx.Node):
            node = node.args[1]
        else:
            return None
    return None
