"""`call_module` nodes as readable functional code: `nn.Linear` -> `F.linear(x, self.w, self.b)`.

Each rule takes the module, the emitter context and the rendered input, and returns an
expression; it reads the module's configuration exactly as the module's own `forward` does, so
the generated call computes the same values (tests compare them on the whole model zoo). A rule
applies only to modules whose class did not override `forward` (a subclass of nn.Linear with its
own forward is not a Linear for our purposes).

Modules without a rule — recurrent layers, attention, anything configurable — are instantiated
in the generated `__init__` from their constructor arguments (`instantiate`), after checking that
the rebuilt module has the same configuration (`extra_repr`) and state shapes. Modules outside
`torch.nn` cannot be written and raise `PipeccError`.

Split-layer shards (`pipecc.passes.split_layers`: LinearShard, Conv2dShard, EmbeddingShard) are
recognised by duck typing (`pipecc_shard_of`, `parent`, `start`, `size`, `dim`) and become the
functional call over their own weight slices, exactly as their `forward` computes it.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Protocol

import torch
from torch import nn

from pipecc.backends.torch.names import literal
from pipecc.errors import PipeccError


class Context(Protocol):
    """What a rule may ask of the stage emitter."""

    def tensor(self, t: torch.Tensor | None, hint: str) -> str: ...   # "self.<attr>" or "None"
    def statement(self, line: str) -> None: ...                       # a line before the node's
    def temp(self, hint: str) -> str: ...                             # a fresh local name
    def const(self, value: Any) -> str: ...                           # a rendered constant


Rule = Callable[[Any, Context, str], str]


def _kw(c: Context, **items: Any) -> str:
    return ", ".join(f"{k}={c.const(v)}" for k, v in items.items())


def _conv(m: nn.Module, c: Context, x: str, transposed: bool = False) -> str:
    n = len(m.kernel_size)
    w, b = c.tensor(m.weight, "weight"), c.tensor(m.bias, "bias")
    padding: Any = m.padding
    if m.padding_mode != "zeros":  # as _ConvNd._conv_forward does
        if transposed:
            raise PipeccError(f"{type(m).__name__} with padding_mode={m.padding_mode!r} is not supported")
        padded = c.temp("padded")
        c.statement(f"{padded} = F.pad({x}, {c.const(tuple(m._reversed_padding_repeated_twice))}, "
                    f"mode={literal(m.padding_mode)})")
        x, padding = padded, (0,) * n
    if transposed:
        return (f"F.conv_transpose{n}d({x}, {w}, {b}, "
                + _kw(c, stride=m.stride, padding=padding, output_padding=m.output_padding,
                      groups=m.groups, dilation=m.dilation) + ")")
    return (f"F.conv{n}d({x}, {w}, {b}, "
            + _kw(c, stride=m.stride, padding=padding, dilation=m.dilation, groups=m.groups) + ")")


def _batch_norm(m: nn.modules.batchnorm._BatchNorm, c: Context, x: str) -> str:
    w, b = c.tensor(m.weight, "weight"), c.tensor(m.bias, "bias")
    if not m.track_running_stats or m.running_mean is None:
        return f"F.batch_norm({x}, None, None, {w}, {b}, True, 0.0, {c.const(m.eps)})"
    mean, var = c.tensor(m.running_mean, "running_mean"), c.tensor(m.running_var, "running_var")
    count = c.tensor(m.num_batches_tracked, "num_batches_tracked")
    c.statement(f"if self.training:  # BatchNorm counts its training batches\n    {count}.add_(1)")
    momentum = (f"(1.0 / float({count}) if self.training else 0.0)" if m.momentum is None
                else c.const(m.momentum))
    return f"F.batch_norm({x}, {mean}, {var}, {w}, {b}, self.training, {momentum}, {c.const(m.eps)})"


def _embedding(m: nn.Embedding, c: Context, x: str) -> str:
    defaults = dict(padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False, sparse=False)
    extra = {k: getattr(m, k) for k, v in defaults.items() if getattr(m, k) != v}
    tail = f", {_kw(c, **extra)}" if extra else ""
    return f"F.embedding({x}, {c.tensor(m.weight, 'weight')}{tail})"


def _dropout(fn: str) -> Rule:
    return lambda m, c, x: f"{fn}({x}, p={c.const(m.p)}, training=self.training)"


def _call(fn: str, *attrs: str) -> Rule:
    """`fn(x, attr=module.attr, ...)` for a parameter-free module."""
    return lambda m, c, x: f"{fn}({x}{''.join(', ' + _kw(c, **{a: getattr(m, a)}) for a in attrs)})"


def _pool(fn: str, always: tuple[str, ...], defaults: dict[str, Any]) -> Rule:
    """`fn(x, <always>..., <non-default optional>...)` as the pooling module's forward calls it."""
    def rule(m: nn.Module, c: Context, x: str) -> str:
        items = {a: getattr(m, a) for a in always}
        items.update({a: getattr(m, a) for a, d in defaults.items() if getattr(m, a) != d})
        return f"{fn}({x}, {_kw(c, **items)})"
    return rule


_MAX = (("kernel_size", "stride", "padding"), dict(dilation=1, ceil_mode=False, return_indices=False))
_AVG = (("kernel_size", "stride", "padding"), dict(ceil_mode=False, count_include_pad=True))
_AVG_DIV = (_AVG[0], dict(_AVG[1], divisor_override=None))
_POOLS: list[tuple[type, Rule]] = [
    (nn.MaxPool1d, _pool("F.max_pool1d", *_MAX)), (nn.MaxPool2d, _pool("F.max_pool2d", *_MAX)),
    (nn.MaxPool3d, _pool("F.max_pool3d", *_MAX)), (nn.AvgPool1d, _pool("F.avg_pool1d", *_AVG)),
    (nn.AvgPool2d, _pool("F.avg_pool2d", *_AVG_DIV)), (nn.AvgPool3d, _pool("F.avg_pool3d", *_AVG_DIV)),
    (nn.AdaptiveAvgPool1d, _pool("F.adaptive_avg_pool1d", ("output_size",), {})),
    (nn.AdaptiveAvgPool2d, _pool("F.adaptive_avg_pool2d", ("output_size",), {})),
    (nn.AdaptiveAvgPool3d, _pool("F.adaptive_avg_pool3d", ("output_size",), {})),
    (nn.AdaptiveMaxPool1d, _pool("F.adaptive_max_pool1d", ("output_size",), dict(return_indices=False))),
    (nn.AdaptiveMaxPool2d, _pool("F.adaptive_max_pool2d", ("output_size",), dict(return_indices=False))),
]


RULES: list[tuple[type, Rule]] = [
    (nn.Linear, lambda m, c, x: f"F.linear({x}, {c.tensor(m.weight, 'weight')}, {c.tensor(m.bias, 'bias')})"),
    (nn.Conv1d, _conv), (nn.Conv2d, _conv), (nn.Conv3d, _conv),
    (nn.ConvTranspose1d, lambda m, c, x: _conv(m, c, x, True)),
    (nn.ConvTranspose2d, lambda m, c, x: _conv(m, c, x, True)),
    (nn.ConvTranspose3d, lambda m, c, x: _conv(m, c, x, True)),
    (nn.BatchNorm1d, _batch_norm), (nn.BatchNorm2d, _batch_norm), (nn.BatchNorm3d, _batch_norm),
    (nn.LayerNorm, lambda m, c, x: f"F.layer_norm({x}, {c.const(tuple(m.normalized_shape))}, "
                                   f"{c.tensor(m.weight, 'weight')}, {c.tensor(m.bias, 'bias')}, "
                                   f"{c.const(m.eps)})"),
    (nn.GroupNorm, lambda m, c, x: f"F.group_norm({x}, {m.num_groups}, {c.tensor(m.weight, 'weight')}, "
                                   f"{c.tensor(m.bias, 'bias')}, {c.const(m.eps)})"),
    (nn.Embedding, _embedding),
    (nn.Dropout, _dropout("F.dropout")), (nn.Dropout1d, _dropout("F.dropout1d")),
    (nn.Dropout2d, _dropout("F.dropout2d")), (nn.Dropout3d, _dropout("F.dropout3d")),
    (nn.AlphaDropout, _dropout("F.alpha_dropout")),
    # NOTE: activations are written out of place whatever `inplace` says: in the distributed
    # runtime a received activation is a leaf that autograd forbids modifying in place.
    (nn.ReLU, _call("F.relu")), (nn.ReLU6, _call("F.relu6")), (nn.SiLU, _call("F.silu")),
    (nn.GELU, lambda m, c, x: f"F.gelu({x})" if m.approximate == "none"
        else f"F.gelu({x}, approximate={literal(m.approximate)})"),
    (nn.Sigmoid, _call("torch.sigmoid")), (nn.Tanh, _call("torch.tanh")),
    (nn.Hardswish, _call("F.hardswish")), (nn.Hardsigmoid, _call("F.hardsigmoid")),
    (nn.Mish, _call("F.mish")), (nn.Softplus, _call("F.softplus", "beta", "threshold")),
    (nn.LeakyReLU, _call("F.leaky_relu", "negative_slope")), (nn.ELU, _call("F.elu", "alpha")),
    (nn.Softmax, _call("F.softmax", "dim")), (nn.LogSoftmax, _call("F.log_softmax", "dim")),
    (nn.Identity, lambda m, c, x: x),
    (nn.Flatten, _call("torch.flatten", "start_dim", "end_dim")),
    *_POOLS,
]


def rule_for(module: nn.Module) -> Rule | None:
    """The functional rule for `module`, or None (then `instantiate` it)."""
    if hasattr(module, "pipecc_shard_of"):
        return _shard_rule(module)
    for cls, rule in RULES:
        if type(module) is cls or (isinstance(module, cls) and type(module).forward is cls.forward):
            if isinstance(module, nn.Softmax) and module.dim is None:
                return None  # implicit-dim softmax: let the module decide, as it does today
            return rule
    return None


# ----------------------------------------------------------------------------- shards
def _shard_rule(m: nn.Module) -> Rule:
    kind = type(m).__name__
    parent = m.__dict__.get("parent")
    if kind not in ("LinearShard", "Conv2dShard", "EmbeddingShard") or parent is None:
        raise PipeccError(f"stage code generation does not know the split-layer shard {kind}")
    if kind == "LinearShard":
        return lambda m, c, x: f"F.linear({x}, {c.tensor(m.weight, 'weight')}, {c.tensor(m.bias, 'bias')})"
    if kind == "Conv2dShard":
        return lambda m, c, x: _conv(_ShardConv(m, parent), c, x)
    return _embedding_shard


class _ShardConv:
    """A Conv2dShard seen as a Conv2d: its weight slice with the parent's configuration."""

    def __init__(self, shard: nn.Module, parent: nn.Conv2d) -> None:
        self.weight, self.bias = shard.weight, shard.bias
        for attr in ("kernel_size", "stride", "padding", "dilation", "padding_mode",
                     "_reversed_padding_repeated_twice"):
            setattr(self, attr, getattr(parent, attr))
        self.groups = 1


def _embedding_shard(m: nn.Module, c: Context, x: str) -> str:
    """As EmbeddingShard.forward: look rows up in the slice, zero where the id is not ours."""
    start, end, pad = m.start, m.start + m.size, m.__dict__["parent"].padding_idx
    local_pad = pad - start if pad is not None and start <= pad < end else None
    inside = c.temp("inside")
    c.statement(f"{inside} = ({x} >= {start}) & ({x} < {end})")
    rows = f"F.embedding(({x} - {start}).clamp(0, {m.size - 1}), {c.tensor(m.weight, 'weight')}, {local_pad!r})"
    return f"torch.where({inside}.unsqueeze(-1), {rows}, 0.0)"


# ----------------------------------------------------------------------------- instantiation
def constructor(module: nn.Module, const: Callable[[Any], str]) -> str:
    """`torch.nn.<Class>(...)` rebuilding `module`'s configuration; PipeccError when impossible."""
    cls = type(module)
    if getattr(nn, cls.__name__, None) is not cls:
        raise PipeccError(f"stage code generation cannot write the module {cls.__name__} (from "
                          f"{cls.__module__}): only torch.nn modules can appear in a stage file")
    params = inspect.signature(cls.__init__).parameters
    if cls in _RNN_ARGS:  # (*args, **kwargs) constructors: their arguments, by name
        params = {**{a: _ANY for a in _RNN_ARGS[cls]}, "dtype": _ANY}
    kwargs: dict[str, Any] = {}
    for name, p in list(params.items())[0 if cls in _RNN_ARGS else 1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or name in ("device", "dtype"):
            continue
        if hasattr(module, name):
            value = getattr(module, name)
            if name == "bias" and isinstance(value, (torch.Tensor, type(None))):
                value = value is not None
            kwargs[name] = value
        elif name == "bias":  # nn.MultiheadAttention keeps it only as in_proj_bias
            kwargs[name] = any("bias" in k for k, _ in module.named_parameters())
        elif p.default is p.empty:
            raise PipeccError(f"cannot rebuild {cls.__name__}: its argument {name!r} is not an attribute")
    first = next(iter(module.parameters()), None)
    if first is not None and "dtype" in params:
        kwargs["dtype"] = first.dtype
    _check_rebuilt(module, cls, kwargs)
    args = ", ".join(f"{k}={const(v)}" for k, v in kwargs.items())
    return f"torch.nn.{cls.__name__}({args})"


_RNN = ("input_size", "hidden_size", "num_layers", "bias", "batch_first", "dropout", "bidirectional")
_RNN_ARGS: dict[type, tuple[str, ...]] = {nn.LSTM: _RNN + ("proj_size",), nn.GRU: _RNN,
                                          nn.RNN: _RNN + ("nonlinearity",)}
_ANY = inspect.Parameter("x", inspect.Parameter.KEYWORD_ONLY)


def _check_rebuilt(module: nn.Module, cls: type, kwargs: dict[str, Any]) -> None:
    try:
        with torch.device("meta"):
            rebuilt = cls(**kwargs)
    except Exception as exc:
        raise PipeccError(f"cannot rebuild {cls.__name__} from its attributes: {exc}") from exc
    shapes = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    if rebuilt.extra_repr() != module.extra_repr() or \
            {k: tuple(v.shape) for k, v in rebuilt.state_dict().items()} != shapes:
        raise PipeccError(f"cannot rebuild {cls.__name__} faithfully from its attributes")
