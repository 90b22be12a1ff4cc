"""torch.fx tracing that sees into torch.nn's composite modules.

`torch.fx.symbolic_trace` keeps every `torch.nn` module as one `call_module` node (a leaf).
That suits the modules that are one op to the cost model and to stage code generation
(`nn.Linear`, `nn.LSTM`, `nn.MultiheadAttention`, ...), but not the composite ones such as
`nn.TransformerEncoderLayer`, `nn.TransformerEncoder` or `nn.TransformerDecoderLayer`: as leaves
they have no cost formula (their work would be under-estimated) and no constructor that can be
rebuilt from their attributes. So a `torch.nn` module whose op pipecc does not know and that
is built of submodules is traced into; what it is built of (attention, linear, norm, dropout)
is known.

Two things in those modules' `forward` stop a symbolic trace, and are dealt with here:
  * the inference fast path (`torch._transformer_encoder_layer_fwd`, nested tensors) is chosen
    by tests on the input (`src.dim() != 3`) that a proxy cannot answer. Turning the fast path
    off for the trace (`torch.backends.mha.set_fastpath_enabled(False)`) makes `forward` take
    its first branch, so the trace records the ordinary path, the one used in training; its
    values equal the fast path's (it exists for speed);
  * `nn.TransformerEncoder` asks `_get_seq_len(src)` (which tests `src.is_nested`) only to
    check a given mask for causality; while tracing it answers None ("unknown") for a proxy,
    which is all that check needs when there is no mask. (With a mask the check itself tests
    values, the trace fails and `torch_capture` falls back to torch.export.)

Arguments the example inputs do not give keep their defaults (`forward(x, attn_mask=None)`
traced with `(x,)` is the model called as `model(x)`): a plain default (None, a bool, number
or string) is traced as that constant (`untaken_defaults`), as torch.export does, so it is no
input of the captured graph and `if attn_mask is not None:` takes the branch the call takes.
"""

from __future__ import annotations

import contextlib
import inspect
import keyword
from typing import Any, Iterator

import torch
import torch.fx as fx
from torch import nn

from pipecc.errors import PipeccError
from pipecc.ir.graph import META_OUTPUT_CLASS
from pipecc.ir.ops import module_op


def sees_into(module: nn.Module) -> bool:
    """A torch.nn module that fx keeps as a leaf, pipecc does not know as one op, and that is
    made of submodules: traced into instead of kept whole."""
    return module_op(module).startswith("module:") and next(module.children(), None) is not None


class _Tracer(fx.Tracer):
    """fx's tracer, seeing into composite torch.nn modules (`see_into`), noting the nodes it
    records with gradients off while they were on when the trace began (a no_grad region)."""

    def __init__(self, see_into: bool = True) -> None:
        super().__init__()
        self.see_into = see_into
        self.grad_at_start = torch.is_grad_enabled()
        self.no_grad_nodes: list[str] = []

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return super().is_leaf_module(m, module_qualified_name) and not (self.see_into and sees_into(m))

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        node = super().create_node(*args, **kwargs)
        if self.grad_at_start and not torch.is_grad_enabled():
            self.no_grad_nodes.append(node.name)
        return node


class Untraceable(Exception):
    """What torch.fx would capture wrong, so `torch_capture` captures with torch.export instead
    (which records it): an in-place write fx ran eagerly on a buffer or parameter (`self.steps
    += 1`, `self.ema.mul_(0.9)`: no Proxy among its arguments, so the graph would never write
    it), or ops recorded inside a `torch.no_grad()` region (fx keeps the ops, not the region,
    so gradients would flow where the model stops them)."""


def _versions(model: nn.Module) -> dict[str, int]:
    return {name: t._version for name, t in [*model.named_parameters(remove_duplicate=False),
                                             *model.named_buffers(remove_duplicate=False)]}


@contextlib.contextmanager
def _traceable_transformers() -> Iterator[None]:
    """The fast path off and `_get_seq_len` proxy-safe, for the trace only."""
    from torch.nn.modules import transformer
    mha = getattr(torch.backends, "mha", None)
    fast = mha.get_fastpath_enabled() if mha is not None else None
    seq_len = getattr(transformer, "_get_seq_len", None)

    def proxy_safe_seq_len(src: Any, *args: Any, **kwargs: Any) -> Any:
        return None if isinstance(src, fx.Proxy) else seq_len(src, *args, **kwargs)

    try:
        if mha is not None:
            mha.set_fastpath_enabled(False)
        if seq_len is not None:
            transformer._get_seq_len = proxy_safe_seq_len
        yield
    finally:
        if mha is not None:
            mha.set_fastpath_enabled(fast)
        if seq_len is not None:
            transformer._get_seq_len = seq_len


def unspellable(target: str) -> str | None:
    """The part of a module path that torch.fx cannot write into Python code, or None.

    NOTE: fx writes `self.blocks.<part>` for an identifier and `getattr(x, "<part>")` for any
    other name, so a keyword (`in`, `class`, `None`: legal nn.ModuleDict keys) is a
    SyntaxError, and a quote, backslash or line break breaks the string literal.
    """
    for part in target.split("."):
        if keyword.iskeyword(part) if part.isidentifier() else any(c in part for c in '"\\\r\n'):
            return part
    return None


_PLAIN = (type(None), bool, int, float, str)


def untaken_defaults(model: nn.Module, given: int) -> dict[str, Any]:
    """forward's arguments after the first `given` that have a plain default: name -> default.

    Tensor and container defaults are left as inputs (fx would trace a tensor as a constant
    and flatten a tuple into several inputs); so is every argument of a forward that takes
    `*args` (the example inputs may fill it)."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return {}
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return {p.name: p.default for i, p in enumerate(params)
            if not (p.kind in positional and i < given) and p.kind is not inspect.Parameter.VAR_KEYWORD
            and p.default is not inspect.Parameter.empty and type(p.default) in _PLAIN}


def _drop_specialised_inputs(graph: fx.Graph, names: list[str], concrete: dict[str, Any]) -> None:
    """Remove the placeholders fx keeps for `concrete_args` and the checks on them.

    NOTE: fx still writes one placeholder per concrete argument (named `mask_1`, with the value
    as its default) and a check that a caller passes that value (`_assert_is_none`, or
    `torch._assert(x == value)`); the traced code never reads it otherwise. Placeholders come in
    signature order, one per argument (`names`, *args excluded), which says which are which."""
    import operator

    from torch.fx._symbolic_trace import _assert_is_none
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node, name in zip(placeholders, names):
        if name not in concrete:
            continue
        checks = list(node.users)
        for check in checks:
            checks.extend(u for u in check.users if u not in checks)
        if any(c.target not in (torch._assert, _assert_is_none, operator.eq) for c in checks):
            continue  # read by model code after all: it stays an input, as before
        for check in reversed(checks):
            graph.erase_node(check)
        graph.erase_node(node)


def keep_output_class(gm: fx.GraphModule, cls: type) -> None:
    """Note on the output node the dict subclass forward returns (a Hugging Face ModelOutput,
    `META_OUTPUT_CLASS`): fx writes it as a plain dict, and the stages should return the class
    (`backends.torch.stages.output_tree`). Namedtuples fx keeps itself."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    if issubclass(cls, dict) and cls is not dict and isinstance(out.args[0], dict):
        out.meta[META_OUTPUT_CLASS] = f"{cls.__module__}:{cls.__qualname__}"


def trace(model: nn.Module, given: int | None = None, *, see_into: bool = True) -> fx.GraphModule:
    """`fx.symbolic_trace(model)`, but seeing into composite torch.nn modules (unless not
    `see_into`) and, when `given` says how many positional inputs the call passes, with the
    other arguments at their plain defaults (`untaken_defaults`)."""
    tracer = _Tracer(see_into)
    concrete = untaken_defaults(model, given) if given is not None else {}
    before = _versions(model)
    slots = [(m, dict(m._buffers)) for m in model.modules()]
    try:
        with _traceable_transformers():
            graph = tracer.trace(model, concrete_args=concrete or None)
    finally:  # `self.n = self.n + 1` while tracing assigned a Proxy to the buffer: undone
        assigned = [key for m, kept in slots for key, b in m._buffers.items() if kept.get(key) is not b]
        for m, kept in slots:
            m._buffers.update(kept)
    written = [name for name, v in _versions(model).items() if before.get(name, v) != v] + assigned
    if written:
        raise Untraceable(f"forward writes {written[0]} in place where fx cannot record it")
    if tracer.no_grad_nodes:
        raise Untraceable(f"forward runs {tracer.no_grad_nodes[0]} under torch.no_grad(), "
                          "which fx does not record")
    if concrete:
        names = [p.name for p in inspect.signature(model.forward).parameters.values()
                 if p.kind is not inspect.Parameter.VAR_KEYWORD]
        _drop_specialised_inputs(graph, names, concrete)
    for node in graph.nodes:
        part = unspellable(str(node.target)) if node.op in ("call_module", "get_attr") else None
        if part is not None:
            raise PipeccError(f"torch.fx cannot capture the model: its submodule or attribute "
                              f"path {str(node.target)!r} contains {part!r}, which fx cannot "
                              "write as Python (a keyword, quote, backslash or line break); "
                              "rename it")
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    gm.graph.lint()
    return gm
