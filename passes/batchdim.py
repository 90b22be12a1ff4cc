"""Where the batch is, node by node: whether micro-batching along dim 0 keeps samples apart.

A pipeline splits every batched input along dim 0 into micro-batches, runs each through the
stages on its own and concatenates the outputs along dim 0 (`pipecc.runtime.ports`). That is
the model's computation only when no node mixes samples: a node that reduces over the batch
(`x - x.mean(0)`, a hand-written batch norm), scans or reorders along it (`cumsum(0)`, `flip`),
contracts it (`x.t() @ x`), runs a recurrence over it (a sequence-first GRU whose dim 0 is time,
not the batch), uses the batch size as a number (`y * x.shape[0]`) or returns the batch
somewhere other than dim 0 (`y.t()`). Such a model runs without an error and returns something
else; this pass finds the first such node so the driver can refuse it in one line.

How the batch is found: the frontend fitted every dimension as a polynomial in the symbol `B`
(`pipecc.frontend.torch_capture.propagate_shapes`), so a tensor's batch dim is the dim whose
size is `c·B`. The rules below (`_Walk`) say, per op, which dims an op combines across (its reduced,
scanned or contracted dims); the batch must not be one of them. Two facts shapes do not show
are propagated here: whether the batch is still the outermost factor of its dim after a view
merged it with another (`view_ok`: `(B, T)` -> `(B·T,)` is, `(T, B)` -> `(T·B,)` is not), and
which Python numbers are the batch size (`x.shape[0]`, `x.size(0)`, `sym_size`): as a size
(`view(b, -1)`, `expand(b, ...)`) a micro-batch's own size is right; as a value it is not.

The analysis is conservative: an op the tables (`batchdim_ops`) do not know is taken to mix samples
(`unknown`), so a new op is refused until it is listed with its rule; `_PER_SAMPLE` lists the
ops that treat dim 0 as the batch and each index of it alone (convolution, pooling, group norm,
resampling), which must keep the batch at dim 0 in and out. A batch merged inside another dim by
a view (multi-head attention's (T, B·H, d), its (T·B, D) output projection) is followed as a
`Layout` of factors, through per-row work, until a view splits it out again (`merged`). A
mixture of experts' routing (a sort of the tokens by expert over the whole batch, a grouped
matmul per expert, the rows put back) is followed by `routed` (these facts across nodes are kept
by `batchdim_track.BatchTracker`). BatchNorm is left to `driver.batchnorm_note` (a warning, or
`strict_batchnorm`), as before. Buffers written in forward (a step counter, an EMA) are written
once per micro-batch, so with several micro-batches they are refused too (BatchNorm's running
statistics excepted, as above).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from pipecc.ir.graph import META_OP, META_VALUE, AnnotatedGraph, TensorInfo, tensors_in
from pipecc.passes.batchdim_ops import (
    _ALONG_DIMS, _ALONG_DIM, _BATCH_NORM, _DATA_FREE, _DEFAULT_DIMS, _DEFAULT_DIM, _ELEMENTWISE, _FILLS,
    _LOSSES, _MOVES, _PADS, _PER_SAMPLE_MODULES, _PER_SAMPLE, _REDUCTIONS, _SHAPE_READS, _VIEWS, _arg,
    _factor, _flat, _is_index_use, _region_writes)
# the walk's state and the facts it follows across nodes (views, routing); its finding
from pipecc.passes.batchdim_mixing import Mixing  # torch-free: `pipecc run` refuses with them
from pipecc.passes.batchdim_track import BatchTracker, _Found

META_MIXING = "pipecc.batch_mixing"  # graph module meta: find_mixing's finding, for the folder

__all__ = ["META_MIXING", "Mixing", "find_mixing"]


def find_mixing(graph: AnnotatedGraph, *, training: bool = True) -> Mixing | None:
    """The first node (graph order) that mixes samples or moves the batch off dim 0 of an
    output, or None when micro-batches along dim 0 compute what the model does. `training`:
    whether the pipeline runs train mode (InstanceNorm's running statistics are then written)."""
    if "B" not in graph.symbols or graph.source == "onnx":
        return None  # no batch symbol: inputs are not split (ONNX: its own B, inference only)
    try:
        _Walk(graph, training).run()
    except _Found as found:
        return found.mixing
    return None


# ----------------------------------------------------------------------------- the walk
class _Walk(BatchTracker):
    """The rules per op family, applied to every node in graph order (`BatchTracker` holds what
    they learn)."""

    # --- the graph
    def run(self) -> None:
        for node in self.graph.gm.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                self.outputs(node)
            elif node.op != "get_attr":
                self.visit(node)

    def visit(self, node: fx.Node) -> None:
        op = str(node.meta.get(META_OP, ""))
        base = op[:-1] if op.endswith("_") and not op.startswith("_") else op
        inputs = [n for n in node.all_input_nodes if n.op != "get_attr"]
        if self.routed(node, base, inputs):
            return
        self.numbers(node, base, inputs)
        if node.op == "call_module":
            self.module(node, op)
        elif base in _BATCH_NORM:
            return  # driver.batchnorm_note: a warning, or strict_batchnorm refuses
        else:
            self.function(node, base, inputs)
        self.writes(node, op)
        self.vanished(node, base, inputs)
        self.resized(node, base)

    # --- Python numbers
    def numbers(self, node: fx.Node, op: str, inputs: list[fx.Node]) -> None:
        """Follow the batch size through shape reads and scalar arithmetic; refuse it as a
        tensor value."""
        args = list(node.args) + list(node.kwargs.values())
        if node.op == "call_function" and node.target is getattr and len(args) > 1 \
                and args[1] == "shape" and isinstance(args[0], fx.Node):
            p = self.bdim(args[0])
            if p is not None:
                self.shape_of[node] = p
            return
        if op in _SHAPE_READS or (node.op == "call_method" and node.target == "size"):
            src = args[0] if args else None
            p = self.bdim(src) if isinstance(src, fx.Node) else None
            dim = args[1] if len(args) > 1 else None
            if p is not None:
                rank = len(src.meta[META_VALUE].shape)
                if dim is None:
                    self.shape_of[node] = p
                elif isinstance(dim, int) and dim % rank == p:
                    self.size.add(node)
            return
        if node.op == "call_function" and node.target is operator.getitem and args \
                and args[0] in self.shape_of:
            p, index = self.shape_of[args[0]], args[1]
            if isinstance(index, int) and index == p:
                self.size.add(node)
            elif isinstance(index, slice):
                self.shape_of[node] = p  # a slice of a shape: still holds it (close enough)
            return
        if op == "numel" or (node.op == "call_function" and node.target is len):
            if inputs and self.bdim(inputs[0]) is not None:
                self.size.add(node)
            return
        carried = [n for n in _flat(args) if isinstance(n, fx.Node) and n in self.size]
        if not carried:
            if any(isinstance(n, fx.Node) and n in self.positions for n in _flat(args)):
                if op in _VIEWS or op in _MOVES or op in ("to", "_to_copy", "long", "int"):
                    self.positions.add(node)  # still positions: sliced, reshaped, expanded
                elif not _is_index_use(node):
                    self.found(node, "uses sample positions (arange of the batch size) as values")
                elif self.bdim(args[0]) is None:
                    self.found(node, "indexes a tensor without the batch by sample positions "
                               "(arange of the batch size)")
            return
        value = node.meta.get(META_VALUE)
        if not isinstance(value, TensorInfo) and not any(tensors_in(value)):
            self.size.add(node)  # arithmetic on sizes: still the batch size
            return
        fill = _FILLS.get(op)
        if op in ("arange", "range"):
            self.positions.add(node)
        elif op in _ELEMENTWISE or (fill is not None and _arg(node, *fill, None) in carried):
            self.found(node, "uses the batch size (x.shape[0]) as a value", "compute it from a "
                       "fixed number instead")

    # --- modules
    def module(self, node: fx.Node, op: str) -> None:
        m = self.graph.gm.get_submodule(str(node.target))
        x = node.args[0] if node.args else None
        p = self.bdim(x)
        if p is None or not isinstance(x, fx.Node):
            return
        rank = len(x.meta[META_VALUE].shape)
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            return  # driver.batchnorm_note
        if x in self.dirty:
            self.merged_module(node, m, x)
            return
        if isinstance(m, torch.nn.RNNBase):
            if rank == 2 or (p == 0 and not m.batch_first):
                self.found(node, f"({type(m).__name__}, batch_first=False) runs its recurrence "
                           "over dim 0 of its input, where pipecc splits the batch",
                           "batch_first=True with the batch at dim 0")
            if p != (0 if m.batch_first else 1):
                self.found(node, f"({type(m).__name__}) gets the batch at dim {p}")
            return
        if isinstance(m, torch.nn.MultiheadAttention):
            want = 0 if m.batch_first else 1
            if rank == 2 or p != want:
                self.found(node, f"(MultiheadAttention, batch_first={m.batch_first}) attends over "
                           f"dim {p} of its input, where the batch is", "put the batch where "
                           "batch_first says")
            return
        if isinstance(m, torch.nn.modules.instancenorm._InstanceNorm):
            if m.track_running_stats and self.training:
                self.found(node, f"({type(m).__name__}, track_running_stats=True) updates its "
                           "running statistics once per micro-batch in training mode",
                           "track_running_stats=False")
            self.at_zero(node, p, type(m).__name__)
            return
        if isinstance(m, (torch.nn.LayerNorm, torch.nn.RMSNorm)):
            shape = m.normalized_shape
            if p >= rank - len(tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)):
                self.found(node, f"({type(m).__name__}) normalises over the batch dim")
            return
        if type(m).__name__ in ("LinearShard", "Conv2dShard", "EmbeddingShard") and \
                hasattr(m, "pipecc_shard_of"):  # passes.split_layers: the layer's parameters in parts
            if type(m).__name__ == "LinearShard" and p == rank - 1:
                self.found(node, "(Linear) contracts the batch dim (its input's last dim)")
            elif type(m).__name__ == "Conv2dShard":
                self.at_zero(node, p, "Conv2d")
            return
        if isinstance(m, (torch.nn.Linear, torch.nn.Bilinear)):
            if p == rank - 1:
                self.found(node, "(Linear) contracts the batch dim (its input's last dim)")
            return
        if isinstance(m, (torch.nn.Softmax, torch.nn.LogSoftmax, torch.nn.Softmin, torch.nn.Softmax2d)):
            dim = -3 if isinstance(m, torch.nn.Softmax2d) else \
                m.dim if m.dim is not None else (0 if rank in (0, 1, 3) else 1)
            if dim % rank == p:
                self.found(node, f"({type(m).__name__}) normalises over the batch dim {p}")
            return
        if isinstance(m, (torch.nn.Flatten, torch.nn.Unflatten)):
            self.view(node, x)
            return
        if isinstance(m, torch.nn.Embedding) or op in _ELEMENTWISE or op in ("dropout", "identity") \
                or isinstance(m, (torch.nn.modules.dropout._DropoutNd, torch.nn.Identity)):
            return
        if isinstance(m, (torch.nn.GLU, torch.nn.CosineSimilarity)):
            if m.dim % rank == p:
                self.found(node, f"({type(m).__name__}) works along dim {p}, the batch")
            return
        if isinstance(m, torch.nn.PairwiseDistance) or isinstance(m, torch.nn.modules.loss._Loss):
            if isinstance(m, torch.nn.PairwiseDistance) and p == rank - 1:
                self.found(node, "(PairwiseDistance) works along the batch dim")
            return  # a loss's output has no batch: `vanished` says so
        if type(m).__module__ == "torch.nn.modules.activation":
            return  # elementwise (softmax-like ones and MultiheadAttention are above)
        if type(m).__module__ == "torch.nn.modules.padding":
            k = len(m.padding) // 2
            if p >= rank - k and any(m.padding[2 * (rank - 1 - p):2 * (rank - p)]):
                self.found(node, f"({type(m).__name__}) pads dim {p}, the batch")
            return
        if op in _PER_SAMPLE or type(m).__module__ in _PER_SAMPLE_MODULES:
            self.at_zero(node, p, type(m).__name__)  # conv, pooling, norms over channels
        else:
            self.unknown(node, type(m).__name__)

    def at_zero(self, node: fx.Node, p: int, what: str) -> None:
        """An op that treats dim 0 as the batch (convolution, pooling, group norm) or one the
        tables do not know: separable only with the batch at dim 0 in and out."""
        outs = [d for t in tensors_in(node.meta.get(META_VALUE)) for d in self.bdims(t)]
        if p != 0 or any(d != 0 for d in outs):
            self.found(node, f"({what}) gets or returns the batch at dim "
                       f"{p if p != 0 else next(d for d in outs if d != 0)}, not dim 0")

    # --- functions and methods
    def function(self, node: fx.Node, op: str, inputs: list[fx.Node]) -> None:
        batched = [n for n in inputs if self.bdim(n) is not None]
        if not batched:
            return
        if any(n in self.dirty for n in batched) and op not in _VIEWS:
            if not self.merged(node, op, batched):
                self.found(node, f"({op}) reads a tensor whose batch a view merged inside another dim")
            return
        x = node.args[0] if node.args else None
        p = self.bdim(x) if isinstance(x, fx.Node) else None
        rank = len(x.meta[META_VALUE].shape) if p is not None else 0
        if op in _DATA_FREE or op in _ELEMENTWISE:
            return
        if isinstance(node.target, type) and not isinstance(node.meta.get(META_VALUE), TensorInfo):
            return  # a container (a namedtuple, a ModelOutput) of its arguments: `outputs` checks them
        if op in _VIEWS:
            self.view(node, x)
            return
        if op == "renorm":
            dim = _arg(node, 2, "dim", None)
            if p is not None and not (isinstance(dim, int) and dim % rank == p):
                self.found(node, f"(renorm) caps the norm of each slice along dim {dim}, which "
                           "spans the batch")
            return
        if op in _ALONG_DIM and p is None and op not in ("cat", "concat", "concatenate"):
            return  # a batched index into an unbatched tensor; an output without the batch: vanished
        if op in _ALONG_DIM and p is not None:
            pos, key = _ALONG_DIM[op]
            dim = _arg(node, pos, key, _DEFAULT_DIM.get(op))
            if op in ("cat", "concat", "concatenate"):
                tensors = x if isinstance(x, (list, tuple)) else [x]
                first = next((t for t in tensors if self.bdim(t) is not None), None)
                p = self.bdim(first)
                rank = len(first.meta[META_VALUE].shape)
            if p is not None and (dim is None or (isinstance(dim, int) and dim % rank == p)):
                self.found(node, f"({op}) works along dim {p}, the batch")
            return
        if op in ("cat", "concat", "concatenate"):
            tensors = x if isinstance(x, (list, tuple)) else []
            dim = _arg(node, 1, "dim", 0)
            for t in tensors:
                q = self.bdim(t)
                if q is not None and isinstance(dim, int) and dim % len(t.meta[META_VALUE].shape) == q:
                    self.found(node, f"({op}) concatenates along dim {q}, the batch")
            return
        if op in _ALONG_DIMS and p is not None:
            pos, key = _ALONG_DIMS[op]
            dims = _arg(node, pos, key, _DEFAULT_DIMS.get(op))
            dims = [dims] if isinstance(dims, int) else list(dims or [])
            if not dims or any(d % rank == p for d in dims if isinstance(d, int)):
                self.found(node, f"({op}) works along dim {p}, the batch")
            return
        if op in _PADS and p is not None:
            pad = _arg(node, 1, "pad", None)
            if not isinstance(pad, (list, tuple)) or (len(pad) // 2 > rank - 1 - p and any(
                    not isinstance(n, int) or n != 0 for n in pad[2 * (rank - 1 - p):2 * (rank - p)])):
                self.found(node, f"({op}) pads dim {p}, the batch")
            return
        if op in _MOVES:
            return
        if op == "wrap_with_set_grad_enabled" or str(node.target).startswith("higher_order."):
            self.found(node, f"({op}: a region such as torch.no_grad() in forward) takes batched "
                       "inputs, and pipecc cannot tell whether it keeps samples apart",
                       "move the region out of forward")
        self.contraction(node, op, batched, p, rank)

    def contraction(self, node: fx.Node, op: str, batched: list[fx.Node], p: int | None,
                    rank: int) -> None:
        args = node.args
        if op in ("linear", "addmm", "mm", "matmul", "bmm", "baddbmm", "addbmm", "einsum_matmul"):
            a, b = (args[1], args[2]) if op in ("addmm", "baddbmm", "addbmm") else (args[0], args[1])
            if op == "linear":
                b = None
            for t, contracted in ((a, -1), (b, -2)):
                q = self.bdim(t)
                if q is None:
                    continue
                n = len(t.meta[META_VALUE].shape)
                if q == n + contracted or (n == 1 and q == 0) or (op == "linear" and q == n - 1):
                    self.found(node, f"({op}) sums over the batch dim of its operand")
            return
        if op == "einsum":
            self.einsum(node)
            return
        if op in ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                  "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu"):
            for t in args[:3]:
                q = self.bdim(t)
                if q is not None and q >= len(t.meta[META_VALUE].shape) - 2:
                    self.found(node, f"({op}) attends over dim {q}, the batch")
            return
        if op in ("layer_norm", "native_layer_norm", "rms_norm"):
            shape = _arg(node, 1, "normalized_shape", ())
            if isinstance(shape, fx.Node):  # x.shape[1:]: its value at capture
                shape = getattr(shape.meta.get(META_VALUE), "value", None)
            n = len(shape) if isinstance(shape, (list, tuple)) else \
                1 if isinstance(shape, int) else rank  # not known: every dim
            if p is not None and p >= rank - n:
                self.found(node, f"({op}) normalises over the batch dim")
            return
        if op in ("embedding", "embedding_bag"):
            aten = isinstance(node.target, torch._ops.OpOverload)  # aten.embedding(weight, indices)
            table = node.args[0] if aten and node.args else _arg(node, 1, "weight", None)
            if self.bdim(table) is not None:
                self.found(node, f"({op}) looks samples' rows up in a table that holds the batch")
            return
        if op in ("instance_norm",):
            running = _arg(node, 3, "running_mean", None)
            if running is not None and self.training and _arg(node, 5, "use_input_stats", True):
                self.found(node, "(instance_norm with running statistics) updates them once per "
                           "micro-batch in training mode", "track_running_stats=False")
        if op in ("lstm", "gru", "rnn_tanh", "rnn_relu") and node.op == "call_function":
            first = bool(_arg(node, 8, "batch_first", False))
            if p != (0 if first else 1) or rank == 2:
                self.found(node, f"({op}, batch_first={first}) runs its recurrence over dim 0 "
                           "of its input, where pipecc splits the batch", "batch_first=True")
            return
        if op in ("index", "_unsafe_index"):  # x[i0, i1, ...] with tensors: each sample its own
            indices = _arg(node, 1, "indices", ())
            pick = indices[p] if p is not None and isinstance(indices, (list, tuple)) \
                and p < len(indices) else None
            if pick is not None and pick not in self.positions:
                self.found(node, f"({op}) picks along dim {p}, the batch, by values")
            return
        if op in _REDUCTIONS or op in _LOSSES:
            return  # over the batch dim, the output lost it: `vanished` says so
        if op in _PER_SAMPLE and p is not None:
            self.at_zero(node, p, op)
        else:
            self.unknown(node, op or str(node.target))

    def unknown(self, node: fx.Node, what: str) -> None:
        """An op whose batch behaviour pipecc does not know: taken to mix samples."""
        self.found(node, f"({what}) is an op pipecc does not know to keep samples apart (so it "
                   "is taken to mix them)", "write it with torch ops pipecc knows")

    def einsum(self, node: fx.Node) -> None:
        spec = node.args[0] if node.args and isinstance(node.args[0], str) else None
        operands = node.args[1:] if spec else ()
        if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
            operands = tuple(operands[0])
        if spec is None or "->" not in spec or "..." in spec:
            for t in operands:
                q = self.bdim(t)
                if q is not None:
                    self.at_zero(node, q, "einsum")
            return
        ins, out = spec.replace(" ", "").split("->")
        for letters, t in zip(ins.split(","), operands):
            q = self.bdim(t)
            if q is not None and (q >= len(letters) or letters[q] not in out):
                self.found(node, f"(einsum {spec!r}) sums over the batch dim of an operand")

    # --- what a node writes, and what it loses
    def writes(self, node: fx.Node, op: str) -> None:
        """A buffer written in forward is written once per micro-batch."""
        if op == "wrap_with_set_grad_enabled" and len(node.args) > 1:
            for name in _region_writes(self.graph.gm, node):
                self.found(node, f"writes the buffer {name} in a torch.no_grad() region of "
                           "forward, which runs once per micro-batch", "keep the update out of forward")
        target = node.args[0] if node.args else None
        while isinstance(target, fx.Node) and target.op == "call_function" and \
                str(target.meta.get(META_OP)) in ("detach", "alias") and target.args:
            target = target.args[0]  # a write through a detached view writes the buffer
        inplace = (op.endswith("_") and not op.startswith("_")) or op in ("copy_", "copy")
        if not (inplace and isinstance(target, fx.Node) and target.op == "get_attr"):
            return
        owner, _, _ = str(target.target).rpartition(".")
        if owner in self.batchnorms:
            return  # its running statistics: driver.batchnorm_note
        self.found(node, f"writes the buffer {target.target} in forward, which runs once per "
                   "micro-batch", "keep the update out of forward")

    def vanished(self, node: fx.Node, op: str, inputs: list[fx.Node]) -> None:
        """Batched data in, no batch out: the node reduced or picked across samples."""
        if op in _DATA_FREE or node in self.size or node in self.shape_of:
            return
        if node.op == "call_function" and node.target is operator.getitem \
                and isinstance(node.args[0], fx.Node) and isinstance(node.args[0].meta.get(META_VALUE),
                                                                     (tuple, list)):
            return  # one element of a tuple: its producer was checked
        if node.op == "call_function" and node.target is getattr:
            return
        value = node.meta.get(META_VALUE)
        if not any(True for _ in tensors_in(value)) or self.batched(value):
            return
        if any(self.batched(n.meta.get(META_VALUE)) for n in inputs if n.op != "get_attr"):
            what = "reduces over the batch" if op in _REDUCTIONS else \
                "combines samples (a batched input, an output without the batch)"
            self.found(node, f"({op or node.target}) {what}", "reduce over the other dims only")

    def resized(self, node: fx.Node, op: str) -> None:
        """A dim of c·B samples is what micro-batches split; B - 1 or B + 1 (`x[1:]`, a row
        added to the batch) is a count of the whole batch's samples, not each micro-batch's."""
        for t in tensors_in(node.meta.get(META_VALUE)):
            for d in t.shape:
                if self.b in getattr(d, "free_symbols", ()) and _factor(d, self.b, self.graph.point) is None:
                    self.found(node, f"({op or node.target}) makes a dim of {d} from the batch of B "
                               "samples, which depends on the whole batch")

    def outputs(self, node: fx.Node) -> None:
        """Every tensor the model returns has the batch, clean, at dim 0 (the concat's)."""
        for leaf in _flat(node.args[0]):
            if not isinstance(leaf, fx.Node):
                continue
            if leaf in self.size:
                self.found(leaf, "returns the batch size (x.shape[0]) as a value")
            if leaf in self.route:
                self.misrouted(leaf, str(leaf.meta.get(META_OP, leaf.target)))
            value = leaf.meta.get(META_VALUE)
            if not isinstance(value, TensorInfo):
                continue
            dims = self.bdims(value)
            if not dims:
                if len(value.shape) and self.graph.batch_size > 0:
                    self.found(leaf, "is returned without the batch dim (micro-batches' outputs "
                               "are concatenated along dim 0)")
                continue
            if dims[0] != 0 or leaf in self.dirty:
                self.found(leaf, f"is returned with the batch at dim {dims[0]}"
                           + (" merged inside another dim" if dims[0] == 0 else "") +
                           ", but micro-batches' outputs are concatenated along dim 0",
                           "return it with the batch first")
