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
"""

from __future__ import annotations

import contextlib
import keyword
from typing import Any, Iterator

import torch
import torch.fx as fx
from torch import nn

from pipecc.errors import PipeccError
from pipecc.ir.ops import module_op


def sees_into(module: nn.Module) -> bool:
    """A torch.nn module that fx keeps as a leaf, pipecc does not know as one op, and that is
    made of submodules: traced into instead of kept whole."""
    return module_op(module).startswith("module:") and next(module.children(), None) is not None


class _Tracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return super().is_leaf_module(m, module_qualified_name) and not sees_into(m)


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


def trace(model: nn.Module) -> fx.GraphModule:
    """`fx.symbolic_trace(model)`, but seeing into composite torch.nn modules."""
    tracer = _Tracer()
    with _traceable_transformers():
        graph = tracer.trace(model)
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
