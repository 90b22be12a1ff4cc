"""Mixed precision in the cost model: which tensors autocast holds in bfloat16/float16, and what
that does to the bytes a plan counts.

A run in ``bf16`` or ``fp16`` (`pipecc.runtime.engine.PRECISIONS`: every stage's forward and loss
under ``torch.autocast``, float32 messages sent in that dtype) changes three figures of a node:

  * ``output_bytes``, what crosses a cut: every float32 tensor travels in the autocast dtype
    (`pipecc.runtime.messages`), 2 bytes an element whatever the op;
  * ``stash_bytes``, what the node holds for its backward: its output in the dtype autocast gives
    it (`autocast_low`, below; torch's CUDA and CPU lists differ), plus, for a matmul-class op with parameter weights, the
    low-precision copies of those weights (not of a bias: no backward reads it) that autocast
    makes and the backward saves — one set
    per micro-batch in flight, because the runtime enters autocast once per forward and
    autocast's weight cache lives only inside one region;
  * ``bytes_moved`` (the roofline's memory traffic) reads inputs and writes outputs in the dtypes
    they are held in.

Parameters, gradients and optimizer state stay float32 (autocast keeps float32 master weights),
so the static bytes do not change; FLOPs do not change, the device's peak for the dtype does
(`pipecc.targets.hardware.Device.peak`).

Which dtype autocast gives an op's output follows torch's autocast op reference ("Automatic
Mixed Precision package - torch.amp", sections "CUDA Ops that can autocast to float16" and
"... to float32"; aten/src/ATen/autocast_mode.h): matmul-class ops (linear, matmul, bmm,
convolutions, attention, recurrent cells, einsum, prelu) run in the low dtype; the float32 list
(layer/group norm, softmax and log-softmax, exp/log/pow, sums and products, losses, ...) runs
in float32; every other op follows type promotion: a low-precision output when every floating
input with dimensions is low, float32 when any is float32 (a float32 parameter or buffer, a
float32-list op's output, a graph input). An explicit cast (``.float()``, ``.to(dtype)``) keeps
float32. Where a rule cannot tell, the node counts as float32: a plan then reserves more memory,
never less.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from pipecc.errors import UsageError
from pipecc.ir.graph import META_KIND, META_OP, META_PARAMS, META_VALUE, Dim, tensors_in
from pipecc.ir.ops import MATMUL_KINDS
from pipecc.ir.precision import PRECISIONS

__all__ = ["LOW_ITEMSIZE", "PRECISIONS", "autocast_device", "autocast_low", "held_bytes", "kept_casts",
           "weight_copy_bytes", "wire_bytes"]

LOW_ITEMSIZE = 2  # bytes per element of bfloat16 and float16

# the autocast op reference's float32 lists, in pipecc's normalised op names (pipecc.ir.ops):
# CUDA's ("CUDA Ops that can autocast to float32"), and the CPU's, which is much shorter ("CPU Ops
# that can autocast to float32": losses, prod, cdist, 3-d pooling; norms, softmax, exp, sums run in
# bfloat16 there, as torch 2.13 on this project's CPUs shows, tests/test_precision_plan.py)
_FP32_CPU = frozenset("prod cdist avg_pool3d max_pool3d adaptive_avg_pool3d mse_loss nll_loss l1_loss "
                      "smooth_l1_loss huber_loss kl_div cross_entropy binary_cross_entropy "
                      "binary_cross_entropy_with_logits poisson_nll_loss cosine_embedding_loss "
                      "hinge_embedding_loss margin_ranking_loss multilabel_margin_loss multi_margin_loss "
                      "soft_margin_loss triplet_margin_loss".split())
_FP32_CUDA = frozenset(
    "layer_norm native_layer_norm group_norm layernormalization groupnormalization softmax "
    "log_softmax _softmax _log_softmax logsoftmax softmin exp expm1 log log10 log1p log2 pow "
    "rsqrt reciprocal acos asin cosh sinh tan erfinv softplus sum prod cumsum cumprod norm "
    "normalize logsumexp cdist pdist dist renorm cosine_similarity cross_entropy nll_loss "
    "mse_loss l1_loss smooth_l1_loss huber_loss kl_div binary_cross_entropy_with_logits "
    "poisson_nll_loss cosine_embedding_loss hinge_embedding_loss margin_ranking_loss "
    "multilabel_margin_loss multi_margin_loss soft_margin_loss triplet_margin_loss".split())
# the low-precision list beyond the matmul-class kinds
_LOW_OPS = frozenset({"prelu", "einsum", "addmm", "baddbmm", "addbmm", "mm", "bmm", "mv", "addmv",
                      "addr", "chain_matmul", "linalg_multi_dot"})
_CASTS = frozenset({"float", "double", "to", "type", "type_as", "onnx_cast", "castlike"})


def _low_op(node: fx.Node, device_type: str = "cuda") -> bool | None:
    """True: autocast runs the op in the low dtype; False: in float32; None: type promotion."""
    op, kind = node.meta.get(META_OP, ""), node.meta.get(META_KIND, "")
    if op in (_FP32_CPU if device_type == "cpu" else _FP32_CUDA) or kind == "loss":
        return False
    if kind in MATMUL_KINDS or op in _LOW_OPS:
        return True
    if op in _CASTS:  # an explicit dtype keeps it (a float32 result stays float32)
        return False
    return None


def autocast_device(kinds: list[str], precision: str = "bf16") -> str:
    """Whose autocast lists a plan in `precision` over devices of these kinds counts with: the
    CPU's when every device is a CPU, else CUDA's (a CPU stage in a GPU cluster: CUDA's list keeps
    more in float32, so its bytes are over-, never under-counted). FPGA cards compute in their
    own number format, not under autocast: a mixed precision with one is refused."""
    if precision != "fp32" and "fpga" in kinds:
        raise UsageError(f"--precision {precision} runs CPU and GPU stages under torch.autocast, and FPGA "
                         "stages compute in their --fpga-number format: plan pipelines with FPGA cards in fp32")
    return "cpu" if kinds and all(k == "cpu" for k in kinds) else "cuda"


def autocast_low(gm: fx.GraphModule, device_type: str = "cuda") -> set[fx.Node]:
    """The nodes whose float32 outputs autocast (on `device_type`: "cuda" or "cpu") holds in the
    low dtype (module docstring)."""
    low: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        rule = _low_op(node, device_type)
        if rule is None:
            floats = [a for a in node.all_input_nodes
                      if any(t.dtype.is_floating_point and len(t.shape) > 0
                             for t in tensors_in(a.meta.get(META_VALUE)))]
            # NOTE: a module's own float32 parameters (a call_module's META_PARAMS) promote too
            own = any(info.dtype == torch.float32 for _, info in node.meta.get(META_PARAMS, [])) \
                if node.op == "call_module" and node.meta.get(META_KIND) != "norm" else False
            rule = bool(floats) and all(a in low for a in floats) and not own
        if rule:
            low.add(node)
    return low


def _bytes(value: Any, low: bool) -> Dim:
    total: Dim = 0
    for t in tensors_in(value):
        itemsize = LOW_ITEMSIZE if low and t.dtype == torch.float32 else t.itemsize
        total = total + t.numel * itemsize
    return total


def wire_bytes(value: Any) -> Dim:
    """Bytes of `value` as a message under mixed precision: float32 tensors in the low dtype."""
    return _bytes(value, True)


def held_bytes(node: fx.Node, low: set[fx.Node]) -> Dim:
    """Bytes of `node`'s output as autocast holds it (`autocast_low`)."""
    return _bytes(node.meta.get(META_VALUE), node in low)


def weight_copy_bytes(node: fx.Node, weights: list[Any]) -> Dim:
    """The low-precision copies of a matmul-class node's float32 parameter weights (TensorInfo),
    saved for its backward once per micro-batch (module docstring); 0 for other nodes."""
    if _low_op(node) is not True:
        return 0
    total: Dim = 0
    for t in weights:
        if t.dtype == torch.float32 and t.requires_grad and len(t.shape) >= 2:  # NOTE: not a bias
            total = total + t.numel * LOW_ITEMSIZE
    return total


def kept_casts(node: fx.Node, keeps: tuple[fx.Node, ...], low: set[fx.Node],
               device_type: str = "cuda") -> tuple[tuple[fx.Node, ...], Dim]:
    """The operands `node`'s backward keeps (`pipecc.cost_saved`) under autocast: an operand held in
    another dtype than the op runs in (a float32 activation into a low-precision op, a low one into
    a float32-list op) is cast first, and the backward keeps the cast copy, a new storage of the
    op's dtype, not the operand. Returns (operands kept as they are, bytes of the copies)."""
    rule = _low_op(node, device_type)
    if rule is None:
        return keeps, 0
    kept, copies = [], 0
    for a in keeps:
        floats = [t for t in tensors_in(a.meta.get(META_VALUE)) if t.dtype == torch.float32]
        if floats and (a in low) != rule:
            copies = copies + sum((t.numel for t in floats), 0) * (LOW_ITEMSIZE if rule else 4)
        else:
            kept.append(a)
    return tuple(kept), copies
