"""Capture in train and in eval mode, and keep what the flag changes (`pipecc.ir.train_flag`).

Why two captures: torch.export (every Hugging Face model goes through it) writes the value of
`self.training` into the graph — `aten.dropout.default(x, 0.1, True)`, BatchNorm's training
argument, `scaled_dot_product_attention(..., dropout_p=0.1)` where the library wrote
`p if self.training else 0.0` — and so does torch.fx for functional code. From one capture the
other mode's constants cannot be known (an eval capture has no dropout probability at all), so
`capture_both` captures the model with every module in train mode and again in eval mode
(restoring the flags), aligns the two graphs node by node (`difflib` over (op, target)) and
returns the train-mode graph with `META_BY_MODE` on every node whose constant arguments differ
(both values, per argument position). Stage graphs read the flag there (`train_flag.follow`).

Differences the alignment accepts besides constants: layout-only nodes present in one mode
(`contiguous`, `clone`, `alias`: the same values either way) and an in-place `add_` of a
constant to a buffer present in train mode only (BatchNorm's `num_batches_tracked += 1`), which
becomes an add of 0 in eval mode. Anything else (a Python branch on `self.training` that runs
other ops, a mode that cannot be captured) keeps the graph of the model's own mode, marked
`META_ONE_MODE`, with a note: its stages then refuse to run in the other mode.

A model whose modules are in mixed modes (a frozen BatchNorm in eval inside a training model)
is captured as it is, as one mode: one flag per stage cannot express a mix.
"""

from __future__ import annotations

import contextlib
import difflib
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx as fx

from pipecc.errors import CaptureError
from pipecc.frontend import host_random
from pipecc.ir.train_flag import META_BY_MODE, META_ONE_MODE

Capture = Callable[..., tuple[fx.GraphModule, str, list[str]]]

# ops that only change a tensor's layout or identity: present in one mode's graph only when
# an earlier op's output layout differs (sdpa with dropout returns other strides)
_LAYOUT = {torch.ops.aten.contiguous.default, torch.ops.aten.clone.default, torch.ops.aten.alias.default}
_LAYOUT_METHODS = {"contiguous", "clone"}


class _Differs(Exception):
    """The two captures differ in something other than constants (the message says what)."""


def capture_both(model: torch.nn.Module, inputs: tuple, symbols: Sequence[Any],
                 capture: Capture) -> tuple[fx.GraphModule, str, list[str]]:
    """`capture(model, inputs, symbols)` in both modes, merged (see the module docstring)."""
    flags = {m.training for m in model.modules()}
    if len(flags) > 1:
        with host_random.watch() as draws:
            gm, source, notes = capture(model, inputs, symbols)
        if draws:
            raise CaptureError(host_random.refusal_line(draws, "mixed train/eval"))
        return _one_mode(gm, source, notes, model.training, "the model's modules were in mixed "
                         "train/eval modes at capture")
    own = model.training
    with _modes(model, own), host_random.watch() as draws:
        gm, source, notes = capture(model, inputs, symbols)
    if draws:  # the graph would replay the capture's numbers (pipecc.frontend.host_random)
        raise CaptureError(host_random.refusal_line(draws, "train" if own else "eval"))
    try:
        with _modes(model, not own), host_random.watch() as draws:
            other, other_source, _ = capture(model, inputs, symbols)
    except Exception as exc:  # noqa: BLE001 - any failure means: one mode only
        why = f"the {'eval' if own else 'train'}-mode capture failed: {type(exc).__name__}"
        return _one_mode(gm, source, notes, own, why)
    if draws:
        return _one_mode(gm, source, notes, own, f"the {'eval' if own else 'train'}-mode forward draws "
                         f"random numbers with {draws.describe()}, which a graph cannot keep random")
    train, eval_ = (gm, other) if own else (other, gm)
    try:
        if other_source != source:
            raise _Differs(f"one mode traced with {source}, the other with {other_source}")
        _merge(train, eval_)
    except _Differs as exc:
        return _one_mode(gm, source, notes, own, str(exc))
    return train, source, notes


def _one_mode(gm: fx.GraphModule, source: str, notes: list[str], training: bool,
              why: str) -> tuple[fx.GraphModule, str, list[str]]:
    gm.meta[META_ONE_MODE] = (bool(training), why)
    mode = "train" if training else "eval"
    return gm, source, notes + [f"stages follow {mode} mode only ({why}); running them in the "
                                "other mode is an error"]


@contextlib.contextmanager
def _modes(model: torch.nn.Module, training: bool) -> Iterator[None]:
    saved = [(m, m.training) for m in model.modules()]
    try:
        model.train(training)
        yield
    finally:
        for m, flag in saved:
            m.training = flag


def _key(node: fx.Node) -> tuple[str, Any]:
    return node.op, node.target


def _layout_only(node: fx.Node) -> bool:
    if node.op == "call_function":
        return node.target in _LAYOUT and len(node.all_input_nodes) == 1
    return node.op == "call_method" and node.target in _LAYOUT_METHODS and len(node.all_input_nodes) == 1


def _merge(train: fx.GraphModule, eval_: fx.GraphModule) -> None:
    """Write META_BY_MODE on `train`'s nodes; `_Differs` unless the graphs differ only in
    constants and the accepted extra nodes."""
    a, b = list(train.graph.nodes), list(eval_.graph.nodes)
    matcher = difflib.SequenceMatcher(a=[_key(n) for n in a], b=[_key(n) for n in b], autojunk=False)
    pairs: list[tuple[fx.Node, fx.Node]] = []
    to_train: dict[fx.Node, fx.Node] = {}
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            for t, e in zip(a[i1:i2], b[j1:j2]):
                pairs.append((t, e))
                to_train[e] = t
            continue
        for t in a[i1:i2]:
            if not (_layout_only(t) or _counter_update(t) or _counter_buffer(t)):
                raise _Differs(f"train mode runs {_what(t)}, which eval mode does not")
        for e in b[j1:j2]:
            if not _layout_only(e):
                raise _Differs(f"eval mode runs {_what(e)}, which train mode does not")
    matched = {t for t, _ in pairs}
    for t in a:
        if _counter_update(t) and t not in matched:
            t.meta[META_BY_MODE] = {1: (t.args[1], 0)}

    def same_node(x: fx.Node, y: fx.Node) -> bool:
        return _through_layout(x) is to_train.get(_through_layout(y))

    for t, e in pairs:
        differs = _constant_differences(t, e, same_node)
        if differs:
            t.meta[META_BY_MODE] = differs


def _through_layout(node: fx.Node) -> fx.Node:
    while _layout_only(node):
        node = node.all_input_nodes[0]
    return node


def _counter_update(node: fx.Node) -> bool:
    """`buffer.add_(c)` on a get_attr with no user: BatchNorm's count of training batches."""
    return (node.op == "call_function" and node.target is torch.ops.aten.add_.Tensor
            and len(node.args) == 2 and not node.kwargs and not node.users
            and isinstance(node.args[0], fx.Node) and node.args[0].op == "get_attr"
            and isinstance(node.args[1], (int, float)) and not isinstance(node.args[1], bool))


def _counter_buffer(node: fx.Node) -> bool:
    """The get_attr of that counter: in train mode only, where the capture drops a get_attr
    nothing reads (`torch_capture.capture`: a tied weight's other names)."""
    return node.op == "get_attr" and bool(node.users) and all(_counter_update(u) for u in node.users)


def _what(node: fx.Node) -> str:
    target = getattr(node.target, "__name__", str(node.target))
    return f"{target} ({node.name})"


_MISSING = object()


def _arguments(node: fx.Node) -> list[tuple[int | str, Any]] | None:
    """(position or name, value) of every schema argument of an operator node, defaults filled."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return None
    out: list[tuple[int | str, Any]] = []
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args) and not arg.kwarg_only:
            out.append((i, node.args[i]))
            continue
        value = node.kwargs.get(arg.name, arg.default_value if arg.has_default_value() else _MISSING)
        out.append((arg.name, value))
    return out


def _constant_differences(t: fx.Node, e: fx.Node, same_node: Callable[[fx.Node, fx.Node], bool],
                          ) -> dict[int | str, tuple[Any, Any]]:
    """{position: (train value, eval value)} of the constant arguments that differ."""
    ta, ea = _arguments(t), _arguments(e)
    if ta is None or ea is None:
        if len(t.args) != len(e.args) or set(t.kwargs) != set(e.kwargs):
            raise _Differs(f"{_what(t)} is called with other arguments in eval mode")
        ta = list(enumerate(t.args)) + list(t.kwargs.items())
        ea = list(enumerate(e.args)) + [(k, e.kwargs[k]) for k in t.kwargs]
    out: dict[int | str, tuple[Any, Any]] = {}
    for (where, tv), (_, ev) in zip(ta, ea):
        if _equal(tv, ev, same_node):
            continue
        if _has_node(tv) or _has_node(ev) or tv is _MISSING or ev is _MISSING:
            raise _Differs(f"{_what(t)} takes other inputs in eval mode")
        out[where] = (tv, ev)
    return out


def _has_node(value: Any) -> bool:
    found: list[fx.Node] = []
    fx.node.map_arg(value, found.append)
    return bool(found)


def _equal(x: Any, y: Any, same_node: Callable[[fx.Node, fx.Node], bool]) -> bool:
    if isinstance(x, fx.Node) or isinstance(y, fx.Node):
        return isinstance(x, fx.Node) and isinstance(y, fx.Node) and same_node(x, y)
    if isinstance(x, (tuple, list)) or isinstance(y, (tuple, list)):
        return (type(x) is type(y) and len(x) == len(y)
                and all(_equal(p, q, same_node) for p, q in zip(x, y)))
    if isinstance(x, dict) or isinstance(y, dict):
        return (type(x) is type(y) and x.keys() == y.keys()
                and all(_equal(x[k], y[k], same_node) for k in x))
    if type(x) is not type(y):
        return False
    try:
        return bool(x == y) or (x != x and y != y)  # nan == nan here
    except Exception:  # noqa: BLE001 - an object without a plain ==
        return x is y
