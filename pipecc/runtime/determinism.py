"""Randomness taken out of one training step, so that ``--verify`` compares like with like.

A pipeline draws its random numbers micro-batch by micro-batch, stage by stage, and the
single-process reference draws them once over the whole batch: the same seed gives other
dropout masks, so train-mode outputs and gradients legitimately differ. ``--verify`` therefore
runs both the pipeline's first step and the reference under ``Deterministic`` (a
``TorchFunctionMode``), in which

  * dropout does what it does in eval mode (``F.dropout``/``dropout1d/2d/3d``,
    ``alpha_dropout``, ``feature_alpha_dropout``, ``torch.dropout`` and the aten ops of
    torch.export graphs, ``native_dropout``; the ``dropout_p`` of
    ``scaled_dot_product_attention`` and of ``nn.MultiheadAttention``'s
    ``multi_head_attention_forward``, and an RNN's inter-layer ``dropout`` become 0) while
    everything else, BatchNorm included, stays in train mode;
  * random draws in forward take their expected value, which is also the value at zero noise:
    ``randn``/``randn_like``/``normal``/``normal_`` their mean, ``rand``/``rand_like``/
    ``uniform_`` the middle of their range, ``bernoulli``/``bernoulli_`` their probability. Their
    gradients stay consistent (``normal(mean, std)`` passes its gradient to ``mean``).

Other random functions (``randint``, ``randperm``, ``multinomial``) are left alone. ``seen``
collects what was replaced, so the verdict can say what was compared.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["Deterministic"]

_DROPOUTS = {"dropout", "alpha_dropout", "feature_dropout", "feature_alpha_dropout", "dropout1d",
             "dropout2d", "dropout3d", "native_dropout"}
_RNNS = {"lstm", "gru", "rnn_tanh", "rnn_relu"}


def _name(func: Callable) -> str:
    schema = getattr(func, "_schema", None)
    if schema is not None:
        return schema.name.split("::")[-1]
    return getattr(func, "__name__", "")


class _Mode(TorchFunctionMode):
    """Dropout off, random draws at their means; ``seen``: what was replaced."""

    def __init__(self, seen: set[str] | None = None) -> None:
        super().__init__()
        self.seen: set[str] = set() if seen is None else seen

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        name = _name(func)
        if name in _DROPOUTS:
            args, kwargs = self._dropout(func, name, list(args), kwargs)
        elif name == "scaled_dot_product_attention":
            args, kwargs = self._zero(list(args), kwargs, 4, "dropout_p", "dropout")
        elif name == "multi_head_attention_forward":
            # nn.MultiheadAttention's own dropout: the mode is off inside this call, so the
            # F.dropout / scaled_dot_product_attention it makes would not be seen
            args, kwargs = self._zero(list(args), kwargs, 10, "dropout_p", "dropout")
        elif name in _RNNS and len(args) > 6:
            index = 6 if isinstance(args[1], torch.Tensor) else 5  # packed: (data, batch_sizes, hx, ...)
            args, kwargs = self._zero(list(args), kwargs, index, "dropout", "dropout")
        elif name in _DRAWS:
            self.seen.add(name)
            with torch.no_grad() if name.endswith("_") else contextlib.nullcontext():
                return _DRAWS[name](*args, **kwargs)
        return func(*args, **kwargs)

    def _dropout(self, func: Callable, name: str, args: list, kwargs: dict) -> tuple[tuple, dict]:
        key = "training" if inspect.isfunction(func) else "train"  # F.* vs torch/aten spelling
        p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
        if len(args) > 2:
            train, args[2] = args[2], False
        else:
            train = kwargs.get(key, True)
            kwargs[key] = False
        if train and (not isinstance(p, (int, float)) or p > 0):
            self.seen.add("dropout")
        return tuple(args), kwargs

    def _zero(self, args: list, kwargs: dict, index: int, key: str, what: str) -> tuple[tuple, dict]:
        if len(args) > index:
            value, args[index] = args[index], 0.0
        else:
            value = kwargs.get(key, 0.0)
            if key in kwargs:
                kwargs[key] = 0.0
        if isinstance(value, (int, float)) and value > 0:
            self.seen.add(what)
        return tuple(args), kwargs


class Deterministic(_Mode):
    """``_Mode`` (see the module docstring), also inside activation recomputation.

    NOTE: autograd runs a checkpointed stage's recomputation (``torch.utils.checkpoint``,
    non-reentrant: the stage.py of ``--recompute``) without the torch-function modes of the
    forward, so it would draw real masks and fail checkpoint's own check. While the mode is
    entered, ``torch.utils.checkpoint.checkpoint`` gives such calls a ``context_fn`` that runs
    the recomputation under the same mode.
    """

    def __enter__(self) -> "Deterministic":
        import torch.utils.checkpoint as ckpt
        self._checkpoint = original = ckpt.checkpoint
        seen = self.seen

        def checkpoint(fn: Callable, *args: Any, use_reentrant: bool | None = None,
                       context_fn: Callable | None = None, **kwargs: Any) -> Any:
            if use_reentrant is False and context_fn is None:
                context_fn = lambda: (contextlib.nullcontext(), _Mode(seen))  # noqa: E731
            if context_fn is not None:
                kwargs["context_fn"] = context_fn
            return original(fn, *args, use_reentrant=use_reentrant, **kwargs)

        ckpt.checkpoint = checkpoint
        try:
            super().__enter__()
        except BaseException:
            ckpt.checkpoint = original
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch.utils.checkpoint as ckpt
        try:
            super().__exit__(*exc)
        finally:
            ckpt.checkpoint = self._checkpoint


def _factory(kwargs: dict) -> dict:
    return {k: v for k, v in kwargs.items() if k not in ("generator",)}


def _filled(value: float) -> Callable[..., torch.Tensor]:
    def make(*size: Any, **kwargs: Any) -> torch.Tensor:
        kw = _factory(kwargs)
        grad = kw.pop("requires_grad", False)
        out = torch.full(_size(size), value, **{"dtype": torch.get_default_dtype(), **kw})
        return out.requires_grad_(grad)
    return make


def _filled_like(value: float) -> Callable[..., torch.Tensor]:
    return lambda x, *a, **kwargs: torch.full_like(x, value, **_factory(kwargs))


def _size(size: tuple) -> tuple:
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        return tuple(size[0])
    return tuple(size)


def _normal(mean: Any = 0.0, std: Any = 1.0, *size: Any, **kwargs: Any) -> torch.Tensor:
    kw = _factory(kwargs)
    kw.pop("out", None)
    if isinstance(mean, torch.Tensor):
        shape = torch.broadcast_shapes(mean.shape, std.shape) if isinstance(std, torch.Tensor) else mean.shape
        return mean.expand(shape).clone()
    if isinstance(std, torch.Tensor):
        return torch.full_like(std, float(mean))
    return torch.full(_size(size) or tuple(kw.pop("size", ())), float(mean),
                      **{"dtype": torch.get_default_dtype(), **kw})


def _bernoulli(x: torch.Tensor, p: Any = None, **kwargs: Any) -> torch.Tensor:
    return x.clone() if p is None else torch.full_like(x, float(p))


def _fill(value: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    def fill(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        v = value(*args, **_factory(kwargs))
        return x.copy_(v.expand_as(x)) if isinstance(v, torch.Tensor) else x.fill_(v)
    return fill


_DRAWS: dict[str, Callable[..., torch.Tensor]] = {
    "randn": _filled(0.0), "randn_like": _filled_like(0.0),
    "rand": _filled(0.5), "rand_like": _filled_like(0.5),
    "normal": _normal, "bernoulli": _bernoulli,
    "normal_": _fill(lambda mean=0.0, std=1.0: mean),
    "uniform_": _fill(lambda a=0.0, b=1.0, **kw: (kw.get("from", a) + kw.get("to", b)) / 2),
    "bernoulli_": _fill(lambda p=0.5: p),
}
