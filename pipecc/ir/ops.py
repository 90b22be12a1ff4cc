"""Naming ops: map any fx node (torch function, tensor method, nn module, aten overload, ONNX
op) to one normalised op name and an op kind the cost model understands.

One table, keyed by normalised names, serves all frontends: `torch.nn.functional.linear`,
`aten.linear.default` and the ONNX importer's `Gemm` all become `linear`-class work.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

# Op kinds. `matmul`-class kinds are the ones FlopCounterMode counts (CONTRACT §5).
MATMUL_KINDS = frozenset({"linear", "matmul", "conv", "conv_transpose", "attention", "mha", "rnn"})
KINDS = MATMUL_KINDS | frozenset({
    "embedding", "norm", "pool", "softmax", "activation", "elementwise", "reduction",
    "shape", "param", "input", "loss", "unknown",
})

_KIND_BY_OP: dict[str, str] = {}


def _register(kind: str, names: str) -> None:
    for name in names.split():
        _KIND_BY_OP[name] = kind


_register("linear", "linear addmm gemm")
_register("matmul", "matmul mm bmm baddbmm einsum_matmul einsum grouped_mm grouped_mm_fallback "
                    "_grouped_mm")
_register("conv", "conv1d conv2d conv3d convolution _convolution")
_register("conv_transpose", "conv_transpose1d conv_transpose2d conv_transpose3d convtranspose")
_register("attention", "scaled_dot_product_attention")
_register("mha", "multi_head_attention")
_register("rnn", "lstm gru rnn_tanh rnn_relu")
_register("embedding", "embedding gather_rows")
_register("norm", "layer_norm batch_norm group_norm instance_norm rms_norm "
                  "native_layer_norm _native_batch_norm_legit_no_training batchnormalization "
                  "layernormalization groupnormalization instancenormalization local_response_norm")
_register("pool", "max_pool1d max_pool2d max_pool3d avg_pool1d avg_pool2d avg_pool3d "
                  "adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d adaptive_max_pool2d "
                  "max_pool2d_with_indices maxpool averagepool globalaveragepool globalmaxpool")
_register("softmax", "softmax log_softmax _softmax _log_softmax logsoftmax")
_register("activation", "relu relu6 gelu silu sigmoid tanh elu leaky_relu hardtanh hardswish "
                        "hardsigmoid mish softplus selu celu prelu glu erf relu_ leakyrelu "
                        "clip clamp")
_register("elementwise", "add sub mul truediv div floordiv neg pow sqrt rsqrt exp log abs "
                         "where masked_fill dropout iadd imul isub maximum minimum reciprocal "
                         "rsub eq ne lt le gt ge and_ or_ not_ invert lerp addcmul addcdiv "
                         "sign floor ceil round sin cos tril triu cumsum type_as to float "
                         "half bfloat16 double long int bool scaled_mul onnx_cast native_dropout "
                         "alias clone contiguous copy mod remainder logical_not bitwise_not "
                         "fill_ zeros_like ones_like full_like rand_like randn_like new_zeros "
                         "new_ones detach trilu castlike isnan")
_register("reduction", "sum mean amax amin max min var std norm argmax argmin prod all any "
                       "logsumexp reducemean reducesum reducemax reducemin count_nonzero reducel2")
_register("shape", "view reshape flatten unflatten permute transpose t squeeze unsqueeze "
                   "expand expand_as cat concat stack split chunk getitem getattr size dim "
                   "narrow select slice unbind repeat tile contiguous_view _unsafe_view "
                   "numel identity split_with_sizes sym_size arange zeros ones full "
                   "empty new_empty new_full tensor scalar_tensor _assert_scalar "
                   "sym_constrain_range_for_size _assert_tensor_metadata movedim roll flip "
                   "onnx_shape onnx_constant unsafe_view slice_scatter index_select pad "
                   "constant_pad_nd lift_fresh_copy as_strided gather index scatter index_put "
                   "masked_select take_along_dim sequenceat splittosequence gathernd")
_register("loss", "cross_entropy nll_loss mse_loss binary_cross_entropy_with_logits l1_loss")

# Views alias their input: they hold no memory of their own.
VIEW_OPS = frozenset(
    "view reshape flatten unflatten permute transpose t squeeze unsqueeze expand expand_as "
    "getitem getattr narrow select slice unbind split chunk split_with_sizes detach alias "
    "_unsafe_view movedim identity dropout".split()
)

_MODULE_OPS: list[tuple[type, str]] = [
    (nn.Linear, "linear"), (nn.Bilinear, "bilinear"),
    (nn.Conv1d, "conv1d"), (nn.Conv2d, "conv2d"), (nn.Conv3d, "conv3d"),
    (nn.ConvTranspose1d, "conv_transpose1d"), (nn.ConvTranspose2d, "conv_transpose2d"),
    (nn.ConvTranspose3d, "conv_transpose3d"),
    (nn.LSTM, "lstm"), (nn.GRU, "gru"), (nn.RNN, "rnn_tanh"),
    (nn.MultiheadAttention, "multi_head_attention"),
    (nn.Embedding, "embedding"), (nn.EmbeddingBag, "embedding_bag"),
    (nn.modules.batchnorm._BatchNorm, "batch_norm"), (nn.LayerNorm, "layer_norm"),
    (nn.GroupNorm, "group_norm"), (nn.modules.instancenorm._InstanceNorm, "instance_norm"),
    (nn.RMSNorm, "rms_norm"),
    (nn.MaxPool1d, "max_pool1d"), (nn.MaxPool2d, "max_pool2d"), (nn.MaxPool3d, "max_pool3d"),
    (nn.AvgPool1d, "avg_pool1d"), (nn.AvgPool2d, "avg_pool2d"), (nn.AvgPool3d, "avg_pool3d"),
    (nn.AdaptiveAvgPool1d, "adaptive_avg_pool1d"), (nn.AdaptiveAvgPool2d, "adaptive_avg_pool2d"),
    (nn.AdaptiveAvgPool3d, "adaptive_avg_pool3d"), (nn.AdaptiveMaxPool2d, "adaptive_max_pool2d"),
    (nn.Softmax, "softmax"), (nn.LogSoftmax, "log_softmax"),
    (nn.ReLU, "relu"), (nn.ReLU6, "relu6"), (nn.GELU, "gelu"), (nn.SiLU, "silu"),
    (nn.Sigmoid, "sigmoid"), (nn.Tanh, "tanh"), (nn.ELU, "elu"), (nn.LeakyReLU, "leaky_relu"),
    (nn.Hardtanh, "hardtanh"), (nn.Hardswish, "hardswish"), (nn.Hardsigmoid, "hardsigmoid"),
    (nn.Mish, "mish"), (nn.Softplus, "softplus"), (nn.PReLU, "prelu"), (nn.GLU, "glu"),
    (nn.Dropout, "dropout"), (nn.modules.dropout._DropoutNd, "dropout"),
    (nn.Flatten, "flatten"), (nn.Unflatten, "unflatten"), (nn.Identity, "identity"),
    (nn.CrossEntropyLoss, "cross_entropy"), (nn.MSELoss, "mse_loss"),
]

_OPERATORS = {
    operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.truediv: "truediv",
    operator.floordiv: "floordiv", operator.matmul: "matmul", operator.neg: "neg",
    operator.pow: "pow", operator.getitem: "getitem", operator.iadd: "iadd",
    operator.imul: "imul", operator.mod: "mod", operator.eq: "eq", operator.lt: "lt",
    operator.gt: "gt", operator.and_: "and_", operator.or_: "or_", operator.invert: "invert",
    getattr: "getattr",
}


def module_op(module: nn.Module) -> str:
    """Normalised op name of a leaf module; `module:<Class>` when we do not know it."""
    for cls, name in _MODULE_OPS:
        if isinstance(module, cls):
            if name == "rnn_tanh" and getattr(module, "nonlinearity", "tanh") == "relu":
                return "rnn_relu"
            return name
    return f"module:{type(module).__name__}"


def function_op(target: Any) -> str:
    """Normalised name of a call_function target (python callable or aten OpOverload)."""
    if target in _OPERATORS:
        return _OPERATORS[target]
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return target._schema.name.split("::", 1)[1] if isinstance(target, torch._ops.OpOverload) \
            else str(target).split(".")[-1]
    onnx_op = getattr(target, "__pipecc_onnx_op__", None)
    if onnx_op:
        return onnx_op
    name = getattr(target, "__name__", str(target))
    return name.lstrip("_") if name.startswith("_") and name.lstrip("_") in _KIND_BY_OP else name


def node_op(node: fx.Node, gm: fx.GraphModule) -> str:
    """Normalised op name of any node."""
    if node.op == "call_module":
        return module_op(gm.get_submodule(node.target))
    if node.op == "call_function":
        return function_op(node.target)
    if node.op == "call_method":
        return str(node.target)
    return node.op  # placeholder, get_attr, output


def op_kind(op: str) -> str:
    """Kind of a normalised op; "unknown" when the table does not know it."""
    if op in ("placeholder",):
        return "input"
    if op == "get_attr":
        return "param"
    kind = _KIND_BY_OP.get(op)
    if kind is None and op.endswith("_") and op[:-1] in _KIND_BY_OP:
        kind = _KIND_BY_OP[op[:-1]]  # in-place variants: relu_, add_
    return kind or "unknown"
