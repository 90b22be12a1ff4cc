"""Torch implementations of ONNX operators, so an imported ONNX graph is an executable fx graph.

Each function takes the ONNX node's inputs positionally (None for an omitted optional input)
and its attributes as keyword arguments, and returns a tensor or a tuple of tensors. The
attribute `__pipecc_onnx_op__` gives the normalised op name that `pipecc.ir.ops` classifies.
Operators not listed here still import (their costs come from shapes) but raise a clear
error when executed.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

IMPLEMENTATIONS: dict[str, Callable[..., Any]] = {}


def onnx_op(op_type: str, name: str | None = None):
    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn.__pipecc_onnx_op__ = name or op_type.lower()  # type: ignore[attr-defined]
        fn.__name__ = f"onnx_{op_type}"
        IMPLEMENTATIONS[op_type] = fn
        return fn
    return register


def unsupported(op_type: str) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"ONNX operator {op_type} has no torch implementation in pipecc; "
                                  "its cost is known but it cannot be executed")
    run.__pipecc_onnx_op__ = op_type.lower()  # type: ignore[attr-defined]
    run.__pipecc_onnx_unsupported__ = op_type  # type: ignore[attr-defined]
    run.__name__ = f"onnx_{op_type}"
    return run


def _binary(op_type: str, fn: Callable[[Any, Any], Any], name: str) -> None:
    onnx_op(op_type, name)(lambda a, b: fn(a, b))


for _t, _f, _n in [("Add", torch.add, "add"), ("Sub", torch.sub, "sub"), ("Mul", torch.mul, "mul"),
                   ("Pow", torch.pow, "pow"), ("Equal", torch.eq, "eq"), ("Less", torch.lt, "lt"),
                   ("Greater", torch.gt, "gt"), ("And", torch.logical_and, "and_"),
                   ("Or", torch.logical_or, "or_"), ("Max", torch.maximum, "maximum"),
                   ("Min", torch.minimum, "minimum")]:
    _binary(_t, _f, _n)


@onnx_op("Div", "div")
def _div(a, b):
    if not a.is_floating_point() and not b.is_floating_point():
        return torch.div(a, b, rounding_mode="trunc")
    return torch.div(a, b)


for _t, _f, _n in [("Relu", torch.relu, "relu"), ("Sigmoid", torch.sigmoid, "sigmoid"),
                   ("Tanh", torch.tanh, "tanh"), ("Erf", torch.erf, "erf"), ("Sqrt", torch.sqrt, "sqrt"),
                   ("Exp", torch.exp, "exp"), ("Log", torch.log, "log"), ("Neg", torch.neg, "neg"),
                   ("Abs", torch.abs, "abs"), ("Reciprocal", torch.reciprocal, "reciprocal"),
                   ("Not", torch.logical_not, "not_"), ("Identity", lambda x: x, "identity"),
                   ("Floor", torch.floor, "floor"), ("Ceil", torch.ceil, "ceil")]:
    onnx_op(_t, _n)(lambda x, _f=_f: _f(x))


@onnx_op("Gelu", "gelu")
def _gelu(x, approximate="none"):
    return F.gelu(x, approximate=approximate)


@onnx_op("LeakyRelu", "leaky_relu")
def _leaky(x, alpha=0.01):
    return F.leaky_relu(x, alpha)


@onnx_op("Clip", "clamp")
def _clip(x, lo=None, hi=None):
    return torch.clamp(x, lo, hi)


@onnx_op("HardSwish", "hardswish")
def _hardswish(x):
    return F.hardswish(x)  # ONNX's x * max(0, min(1, x / 6 + 1 / 2)), torch's definition too


@onnx_op("HardSigmoid", "hardsigmoid")
def _hardsigmoid(x, alpha=0.2, beta=0.5):
    # ONNX's default slope is 0.2, torch's hardsigmoid 1/6: the attributes decide
    return torch.clamp(x * alpha + beta, 0.0, 1.0)


@onnx_op("IsNaN", "isnan")
def _isnan(x):
    return torch.isnan(x)


@onnx_op("LessOrEqual", "le")
def _less_or_equal(a, b):
    return torch.le(a, b)


@onnx_op("CumSum", "cumsum")
def _cumsum(x, axis, exclusive=0, reverse=0):
    dim = int(axis.reshape(-1)[0]) if torch.is_tensor(axis) else int(axis)
    y = x.flip(dim) if reverse else x
    out = torch.cumsum(y, dim)
    if exclusive:  # each element leaves itself out: the sum of those before it
        out = out - y
    return out.flip(dim) if reverse else out


@onnx_op("GatherElements", "gather")
def _gather_elements(data, indices, axis=0):
    axis = axis % data.dim()
    indices = torch.where(indices < 0, indices + data.shape[axis], indices)
    return torch.gather(data, axis, indices.long())


@onnx_op("Dropout", "dropout")
def _dropout(x, ratio=None, training_mode=None, seed=None):
    return x


@onnx_op("MatMul", "matmul")
def _matmul(a, b):
    return torch.matmul(a, b)


@onnx_op("Gemm", "gemm")
def _gemm(a, b, c=None, alpha=1.0, beta=1.0, transA=0, transB=0):
    a = a.t() if transA else a
    b = b.t() if transB else b
    y = alpha * (a @ b) if alpha != 1.0 else a @ b
    return y + (beta * c if beta != 1.0 else c) if c is not None else y


def _pads(pads, n):
    return tuple(pads[:n]) if pads else (0,) * n


@onnx_op("Conv", "convolution")
def _conv(x, w, b=None, dilations=None, group=1, kernel_shape=None, pads=None, strides=None,
          auto_pad="NOTSET"):
    n = w.dim() - 2
    p = _pads(pads, n)
    if pads and tuple(pads[:n]) != tuple(pads[n:]):
        x = F.pad(x, [v for i in reversed(range(n)) for v in (pads[i], pads[i + n])])
        p = (0,) * n
    conv = (F.conv1d, F.conv2d, F.conv3d)[n - 1]
    return conv(x, w, b, tuple(strides or (1,) * n), p, tuple(dilations or (1,) * n), group)


@onnx_op("ConvTranspose", "convtranspose")
def _conv_t(x, w, b=None, dilations=None, group=1, kernel_shape=None, pads=None, strides=None,
            output_padding=None, auto_pad="NOTSET", output_shape=None):
    n = w.dim() - 2
    conv = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[n - 1]
    return conv(x, w, b, tuple(strides or (1,) * n), _pads(pads, n),
                tuple(output_padding or (0,) * n), group, tuple(dilations or (1,) * n))


@onnx_op("BatchNormalization", "batchnormalization")
def _bn(x, scale, bias, mean, var, epsilon=1e-5, momentum=0.9, training_mode=0):
    return F.batch_norm(x, mean, var, scale, bias, False, 0.0, epsilon)


@onnx_op("LayerNormalization", "layernormalization")
def _ln(x, scale, bias=None, axis=-1, epsilon=1e-5, stash_type=1):
    axis = axis % x.dim()
    return F.layer_norm(x, tuple(x.shape[axis:]), scale, bias, epsilon)


@onnx_op("Softmax", "softmax")
def _softmax(x, axis=-1):
    return torch.softmax(x, axis)


@onnx_op("LogSoftmax", "log_softmax")
def _log_softmax(x, axis=-1):
    return torch.log_softmax(x, axis)


@onnx_op("MaxPool", "maxpool")
def _maxpool(x, kernel_shape, pads=None, strides=None, dilations=None, ceil_mode=0,
             auto_pad="NOTSET", storage_order=0):
    n = len(kernel_shape)
    pool = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[n - 1]
    return pool(x, kernel_shape, strides or kernel_shape, _pads(pads, n), dilations or 1, bool(ceil_mode))


@onnx_op("AveragePool", "averagepool")
def _avgpool(x, kernel_shape, pads=None, strides=None, ceil_mode=0, count_include_pad=0,
             auto_pad="NOTSET", dilations=None):
    n = len(kernel_shape)
    pool = (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d)[n - 1]
    return pool(x, kernel_shape, strides or kernel_shape, _pads(pads, n), bool(ceil_mode),
                bool(count_include_pad))


@onnx_op("GlobalAveragePool", "globalaveragepool")
def _gap(x):
    return x.mean(dim=tuple(range(2, x.dim())), keepdim=True)


@onnx_op("Flatten", "flatten")
def _flatten(x, axis=1):
    return x.reshape(int(torch.tensor(x.shape[:axis]).prod()), -1) if axis else x.reshape(1, -1)


@onnx_op("Reshape", "reshape")
def _reshape(x, shape, allowzero=0):
    dims = [int(d) for d in shape.tolist()]
    if not allowzero:
        dims = [x.shape[i] if d == 0 else d for i, d in enumerate(dims)]
    return x.reshape(dims)


@onnx_op("Transpose", "permute")
def _transpose(x, perm=None):
    return x.permute(perm if perm is not None else list(reversed(range(x.dim()))))


@onnx_op("Concat", "concat")
def _concat(*xs, axis=0):
    return torch.cat(xs, axis)


@onnx_op("Unsqueeze", "unsqueeze")
def _unsqueeze(x, axes=None):
    for a in sorted(int(v) % (x.dim() + len(axes)) for v in (axes.tolist() if torch.is_tensor(axes) else axes)):
        x = x.unsqueeze(a)
    return x


@onnx_op("Squeeze", "squeeze")
def _squeeze(x, axes=None):
    if axes is None:
        return x.squeeze()
    axes = axes.tolist() if torch.is_tensor(axes) else axes
    return x.squeeze(tuple(int(a) for a in axes))


@onnx_op("Shape", "onnx_shape")
def _shape(x, start=0, end=None):
    return torch.tensor(x.shape[start:end], dtype=torch.int64)


@onnx_op("Gather", "gather_rows")
def _gather(data, indices, axis=0):
    axis = axis % data.dim()
    indices = torch.where(indices < 0, indices + data.shape[axis], indices)
    return torch.index_select(data, axis, indices.reshape(-1)).reshape(
        *data.shape[:axis], *indices.shape, *data.shape[axis + 1:])


@onnx_op("Cast", "onnx_cast")
def _cast(x, to=1, saturate=1):
    from onnx.helper import tensor_dtype_to_np_dtype
    import numpy as np
    return x.to(torch.from_numpy(np.zeros((), dtype=tensor_dtype_to_np_dtype(to))).dtype)


@onnx_op("Where", "where")
def _where(c, a, b):
    return torch.where(c, a, b)


@onnx_op("Expand", "expand")
def _expand(x, shape):
    return x * torch.ones(shape.tolist(), dtype=x.dtype)


@onnx_op("ReduceMean", "reducemean")
def _reduce_mean(x, axes=None, keepdims=1, noop_with_empty_axes=0):
    axes = axes.tolist() if torch.is_tensor(axes) else axes
    return x.mean(dim=tuple(axes), keepdim=bool(keepdims)) if axes else x.mean()


@onnx_op("ReduceSum", "reducesum")
def _reduce_sum(x, axes=None, keepdims=1, noop_with_empty_axes=0):
    axes = axes.tolist() if torch.is_tensor(axes) else axes
    return x.sum(dim=tuple(axes), keepdim=bool(keepdims)) if axes else x.sum()


@onnx_op("Slice", "slice")
def _slice(x, starts, ends, axes=None, steps=None):
    starts, ends = starts.tolist(), ends.tolist()
    axes = axes.tolist() if axes is not None else list(range(len(starts)))
    steps = steps.tolist() if steps is not None else [1] * len(starts)
    index = [slice(None)] * x.dim()
    for s, e, a, st in zip(starts, ends, axes, steps):
        n = x.shape[a]  # ONNX uses INT64_MAX/MIN for "to the end"; clamp like numpy would
        index[a] = slice(max(min(s, n), -n - 1), max(min(e, n), -n - 1), st)
    return x[tuple(index)]


@onnx_op("Split", "split")
def _split(x, split=None, axis=0, num_outputs=None):
    if split is None:
        return torch.chunk(x, num_outputs, axis)
    return torch.split(x, split.tolist() if torch.is_tensor(split) else list(split), axis)


@onnx_op("Trilu", "trilu")
def _trilu(x, k=None, upper=1):
    k = int(k) if k is not None else 0
    return torch.triu(x, k) if upper else torch.tril(x, k)


@onnx_op("ConstantOfShape", "full")
def _const_of_shape(shape, value=None):
    v = value if value is not None else torch.zeros(1)
    return torch.full(shape.tolist(), v.reshape(()).item(), dtype=v.dtype)


@onnx_op("Range", "arange")
def _range(start, limit, delta):
    return torch.arange(start.item(), limit.item(), delta.item(), dtype=start.dtype)


@onnx_op("CastLike", "type_as")
def _cast_like(x, like, saturate=1):
    return x.to(like.dtype)


@onnx_op("Sign", "sign")
def _sign(x):
    return torch.sign(x)


@onnx_op("ReduceL2", "reducel2")
def _reduce_l2(x, axes=None, keepdims=1, noop_with_empty_axes=0):
    axes = axes.tolist() if torch.is_tensor(axes) else axes
    if not axes:
        return torch.linalg.vector_norm(x).reshape([1] * x.dim() if keepdims else [])
    return torch.linalg.vector_norm(x, dim=tuple(axes), keepdim=bool(keepdims))


@onnx_op("SplitToSequence", "split")
def _split_to_sequence(x, split=None, axis=0, keepdims=1):
    if split is None:
        parts = torch.split(x, 1, axis)
        return [p.squeeze(axis) for p in parts] if not keepdims else list(parts)
    sizes = split.tolist() if torch.is_tensor(split) else split
    if isinstance(sizes, int):
        return list(torch.split(x, sizes, axis))
    return list(torch.split(x, sizes, axis))


@onnx_op("SequenceAt", "getitem")
def _sequence_at(seq, position):
    return seq[int(position)]


_ONNX_TO_TORCH_GATES = (0, 2, 3, 1)  # ONNX LSTM gates are i, o, f, c; torch's are i, f, c(g), o


@onnx_op("GatherND", "gathernd")
def _gather_nd(data, indices, batch_dims=0):
    if batch_dims:
        raise NotImplementedError("ONNX GatherND with batch_dims > 0 is not supported")
    k = indices.shape[-1]
    flat = indices.reshape(-1, k)
    picked = data[tuple(flat[:, i] for i in range(k))]
    return picked.reshape(*indices.shape[:-1], *data.shape[k:])


@onnx_op("LSTM", "lstm")
def _lstm(x, w, r, b=None, sequence_lens=None, initial_h=None, initial_c=None, p=None,
          hidden_size=None, direction="forward", layout=0, input_forget=0, activations=None,
          clip=None, activation_alpha=None, activation_beta=None):
    """ONNX LSTM (one layer, forward or bidirectional) through torch's fused LSTM."""
    if sequence_lens is not None or p is not None or clip is not None or input_forget:
        raise NotImplementedError("ONNX LSTM with sequence_lens, peepholes, clip or "
                                  "input_forget is not supported")
    dirs = w.shape[0]
    h = r.shape[-1]
    if layout:  # [B, T, I] -> [T, B, I]
        x = x.transpose(0, 1)
    weights = []
    for d in range(dirs):
        def reorder(t):
            return torch.cat([t[g * h:(g + 1) * h] for g in _ONNX_TO_TORCH_GATES], 0)
        bias = b[d] if b is not None else torch.zeros(8 * h, dtype=x.dtype)
        weights += [reorder(w[d]), reorder(r[d]), reorder(bias[:4 * h]), reorder(bias[4 * h:])]
    batch = x.shape[1]
    h0 = initial_h if initial_h is not None else torch.zeros(dirs, batch, h, dtype=x.dtype)
    c0 = initial_c if initial_c is not None else torch.zeros(dirs, batch, h, dtype=x.dtype)
    y, hn, cn = torch._VF.lstm(x, (h0, c0), weights, True, 1, 0.0, False, dirs == 2, False)
    y = y.reshape(y.shape[0], batch, dirs, h).permute(0, 2, 1, 3)  # [T, dirs, B, H]
    if layout:
        return y.permute(2, 0, 1, 3), hn.transpose(0, 1), cn.transpose(0, 1)
    return y, hn, cn


_lstm.__pipecc_outputs__ = 3  # type: ignore[attr-defined]
