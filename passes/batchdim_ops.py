"""The batch analysis's tables and helpers (``pipecc.passes.batchdim``): which ops keep samples
apart and how, and the arithmetic of a batch merged inside another dim (``Layout``)."""

from __future__ import annotations

import math
import operator
from typing import Any, Iterable

import sympy
import torch
import torch.fx as fx

from pipecc.ir.graph import META_OP, AnnotatedGraph

# ops whose output values do not depend on their inputs' values (sizes, dtypes, fresh tensors)
_DATA_FREE = frozenset(
    "getattr size dim numel sym_size sym_numel zeros_like ones_like empty_like full_like "
    "rand_like randn_like randint_like new_zeros new_ones new_empty new_full new_tensor "
    "zeros ones empty full rand randn randint arange scalar_tensor _assert_tensor_metadata "
    "_assert_scalar sym_constrain_range_for_size _guards_fn".split())
# ops that act on every element alone (or broadcast): the batch stays where shapes put it
_ELEMENTWISE = frozenset(
    "add sub mul truediv div floordiv neg pow sqrt rsqrt exp log log1p expm1 abs where masked_fill "
    "dropout native_dropout feature_dropout alpha_dropout iadd imul isub itruediv maximum minimum "
    "reciprocal rsub eq ne lt le gt ge and_ or_ xor not_ invert lerp addcmul addcdiv sign floor "
    "ceil round trunc frac sin cos tan asin acos atan atan2 sinh cosh tanh erf erfc erfinv "
    "sigmoid relu relu6 gelu silu elu leaky_relu hardtanh hardswish hardsigmoid mish softplus "
    "softsign selu celu prelu rrelu logsigmoid tanhshrink threshold clamp clip clamp_min "
    "clamp_max nan_to_num type_as to float half bfloat16 double long int bool short char byte "
    "alias clone contiguous copy mod remainder fmod logical_not logical_and logical_or "
    "logical_xor bitwise_not bitwise_and bitwise_or bitwise_xor isnan isinf isfinite "
    "detach _to_copy lift_fresh_copy masked_fill_ fill_ square positive fake_quantize_per_tensor_affine "
    "scaled_mul onnx_cast identity gelu_ relu_ sigmoid_ tanh_ hardtanh_ silu_ dropout_ "
    "bernoulli triu tril softmax_backward_data pixel_shuffle pixel_unshuffle __and__ __or__ __xor__ "
    "__invert__ __rand__ __ror__ __rxor__ channel_shuffle native_channel_shuffle".split())
# layout ops: shapes say where the batch went, `_view_ok` whether it stayed a clean factor
_VIEWS = frozenset("view reshape flatten unflatten _unsafe_view unsafe_view view_as reshape_as".split())
_MOVES = frozenset(
    "permute transpose t swapaxes swapdims movedim moveaxis squeeze unsqueeze expand expand_as "
    "repeat tile broadcast_to unbind split chunk split_with_sizes tensor_split unsafe_split "
    "narrow select slice getitem stack hstack vstack as_strided upsample_nearest2d "
    "upsample_bilinear2d interpolate _upsample_bilinear2d_aa upsample_nearest1d".split())
# ops along one dim argument (position, keyword): the batch must not be that dim
_ALONG_DIM = {name: (1, "dim") for name in
              "cumsum cumprod cummax cummin logcumsumexp softmax log_softmax _softmax _log_softmax "
              "softmin sort argsort topk kthvalue median mode nanmedian diff gather scatter "
              "scatter_add scatter_reduce index_select index_add index_copy index_fill "
              "take_along_dim glu cat concat concatenate".split()}
_ALONG_DIM.update({"topk": (2, "dim"), "kthvalue": (2, "dim"), "diff": (2, "dim"),
                   "cat": (1, "dim"), "concat": (1, "dim"), "concatenate": (1, "dim"),
                   "normalize": (2, "dim"), "cosine_similarity": (2, "dim"),
                   "pairwise_distance": (99, "dim")})
_ALONG_DIM.update({name: (2, "dim") for name in
                   "fft_fft fft_ifft fft_rfft fft_irfft fft_hfft fft_ihfft _fft_r2c _fft_c2r "
                   "_fft_c2c".split()})
_DEFAULT_DIM = {"sort": -1, "argsort": -1, "topk": -1, "kthvalue": -1, "median": -1,
                "mode": -1, "diff": -1, "cat": 0, "concat": 0, "concatenate": 0, "glu": -1,
                "normalize": 1, "cosine_similarity": 1, "pairwise_distance": -1,
                **{name: -1 for name in "fft_fft fft_ifft fft_rfft fft_irfft fft_hfft fft_ihfft".split()}}
_ALONG_DIMS = {"flip": (1, "dims"), "roll": (2, "dims"),  # a list of dims
               **{name: (2, "dim") for name in "fft_fft2 fft_ifft2 fft_rfft2 fft_irfft2 fft_fftn "
                  "fft_ifftn fft_rfftn fft_irfftn fft_hfft2 fft_ihfft2 fft_hfftn fft_ihfftn".split()}}
_DEFAULT_DIMS = {name: (-2, -1) for name in "fft_fft2 fft_ifft2 fft_rfft2 fft_irfft2 fft_hfft2 "
                 "fft_ihfft2".split()}  # fftn and the rest: every dim (None)
_PADS = frozenset("pad constant_pad_nd reflection_pad1d reflection_pad2d reflection_pad3d "
                  "replication_pad1d replication_pad2d replication_pad3d circular_pad1d "
                  "circular_pad2d circular_pad3d _pad_circular".split())
# ops that treat dim 0 as the batch and each index of it alone (`at_zero`): convolution, pooling,
# norms over a sample's own values, resampling, library blocks known to work per sample. An op
# in no table here is taken to mix samples (it is refused when the batch is split)
_PER_SAMPLE = frozenset(
    "conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d convolution "
    "_convolution conv_tbc max_pool1d max_pool2d max_pool3d max_pool1d_with_indices "
    "max_pool2d_with_indices max_pool3d_with_indices avg_pool1d avg_pool2d avg_pool3d "
    "adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d adaptive_max_pool1d "
    "adaptive_max_pool2d adaptive_max_pool3d _adaptive_avg_pool2d _adaptive_avg_pool3d lp_pool1d "
    "lp_pool2d lp_pool3d fractional_max_pool2d group_norm native_group_norm instance_norm "
    "local_response_norm upsample_nearest2d upsample_bilinear2d upsample_bicubic2d "
    "upsample_nearest1d upsample_nearest3d upsample_linear1d upsample_trilinear3d "
    "_upsample_nearest_exact2d _upsample_bilinear2d_aa interpolate grid_sample affine_grid "
    "fold unfold im2col col2im pixel_shuffle pixel_unshuffle one_hot bucketize searchsorted "
    "stochastic_depth shifted_window_attention _patch_merging_pad "
    "multi_head_attention".split())
_PER_SAMPLE_MODULES = frozenset(f"torch.nn.modules.{name}" for name in
                                "conv pooling normalization pixelshuffle channelshuffle fold "
                                "upsampling".split())
# losses reduce over the batch: `vanished` names them (their output has none)
_LOSSES = frozenset("cross_entropy mse_loss l1_loss nll_loss binary_cross_entropy "
                    "binary_cross_entropy_with_logits smooth_l1_loss huber_loss kl_div".split())
_BATCH_NORM = frozenset("batch_norm _native_batch_norm_legit _native_batch_norm_legit_functional "
                        "_native_batch_norm_legit_no_training native_batch_norm "
                        "cudnn_batch_norm miopen_batch_norm".split())
_REDUCTIONS = frozenset("sum mean amax amin max min var std norm argmax argmin prod all any "
                        "logsumexp count_nonzero var_mean std_mean nansum nanmean aminmax "
                        "linalg_vector_norm frobenius_norm".split())
# ops that make a tensor of a value (position, keyword of the value): the batch size as their
# size is a micro-batch's own, as their value it is not
_FILLS = {"full": (1, "fill_value"), "new_full": (2, "fill_value"), "full_like": (1, "fill_value"),
          "fill": (1, "value"), "scalar_tensor": (0, "s"), "tensor": (0, "data"),
          "as_tensor": (0, "data")}
_SHAPE_READS = frozenset("size sym_size".split())



# ----------------------------------------------------------------------------- helpers
# how the batch lies in a tensor: per dim, its factors (size at the sample point, whether it is
# the batch), outermost first; (T, B) viewed as (T·B,) is ((T, False), (B, True))
Layout = tuple[tuple[tuple[int, bool], ...], ...]


def _batch_at(layout: Layout) -> tuple[int, int] | None:
    found = [(d, j) for d, dim in enumerate(layout) for j, f in enumerate(dim) if f[1]]
    return found[0] if len(found) == 1 else None


def _leads(layout: Layout, bdims: list[int]) -> bool:
    """The batch is the outermost factor (but for 1s) of the one dim the shapes say holds it."""
    at = _batch_at(layout)
    return at is not None and bdims == [at[0]] and all(f[0] == 1 for f in layout[at[0]][:at[1]])


def _sizes(layout: Layout) -> tuple[int, ...]:
    return tuple(math.prod(f[0] for f in dim) for dim in layout)


def _order(node: fx.Node, op: str, rank: int) -> list[int] | None:
    """The input dim of each output dim of a permute or transpose, or None."""
    if op == "permute":
        dims = node.args[1:] if len(node.args) > 2 else _arg(node, 1, "dims", None)
        if not isinstance(dims, (list, tuple)) or not all(isinstance(d, int) for d in dims):
            return None
        return [d % rank for d in dims]
    if op == "t":
        a, b = 0, rank - 1
    else:
        a, b = _arg(node, 1, "dim0", None), _arg(node, 2, "dim1", None)
        if not isinstance(a, int) or not isinstance(b, int):
            return None
    order = list(range(rank))
    order[a % rank], order[b % rank] = order[b % rank], order[a % rank]
    return order


def _flat(value: Any) -> Iterable[Any]:
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _flat(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _flat(v)
    elif isinstance(value, slice):
        yield from _flat((value.start, value.stop, value.step))
    else:
        yield value


def _arg(node: fx.Node, pos: int, key: str, default: Any) -> Any:
    if key in node.kwargs:
        return node.kwargs[key]
    if len(node.args) > pos:
        return node.args[pos]
    return default


def _batchnorm_owners(graph: AnnotatedGraph) -> set[str]:
    """Module paths of the BatchNorms (their running statistics are theirs to write): the
    modules fx kept, and the owners of the buffers torch.export's batch_norm ops read."""
    owners = set()
    for node in graph.gm.graph.nodes:
        if node.op == "call_module" and isinstance(graph.gm.get_submodule(str(node.target)),
                                                   torch.nn.modules.batchnorm._BatchNorm):
            owners.add(str(node.target))
        elif node.op == "call_function" and str(node.meta.get(META_OP)) in _BATCH_NORM:
            owners |= {str(a.target).rpartition(".")[0] for a in node.all_input_nodes if a.op == "get_attr"}
    return owners


def _region_writes(gm: fx.GraphModule, node: fx.Node) -> list[str]:
    """The buffers (get_attr arguments) that a torch.export region's subgraph writes in place."""
    sub = node.args[1]
    region = getattr(gm, str(sub.target), None) if isinstance(sub, fx.Node) else None
    if not isinstance(region, fx.GraphModule):
        return []
    holders = [n for n in node.args[2:]]
    places = [n for n in region.graph.nodes if n.op == "placeholder"]
    written = []
    for inner in region.graph.nodes:
        name = getattr(inner.target, "__name__", str(inner.target)).split(".")[0]
        first = inner.args[0] if inner.args else None
        if inner.op == "call_function" and name.endswith("_") and first in places:
            outer = holders[places.index(first)] if places.index(first) < len(holders) else None
            if isinstance(outer, fx.Node) and outer.op == "get_attr":
                written.append(str(outer.target))
    return written


def _is_index_use(node: fx.Node) -> bool:
    """Positions used to index (a micro-batch indexes its own rows: the same rows)."""
    return (node.op == "call_function" and node.target in (operator.getitem, torch.ops.aten.index.Tensor)) \
        or (node.op == "call_method" and node.target == "__getitem__")


def _at(d: Any, point: dict) -> int:
    return int(d.subs(point)) if isinstance(d, sympy.Expr) else int(d)


def _factor(d: Any, b: sympy.Symbol, point: dict) -> int | None:
    """k when the dim is k·B exactly (no constant term, no other symbol), else None."""
    if not isinstance(d, sympy.Expr):
        return None
    k = sympy.simplify(d / b)
    if b in k.free_symbols:
        return None
    k = k.subs(point)
    return int(k) if k.is_Integer and int(k) > 0 else None
