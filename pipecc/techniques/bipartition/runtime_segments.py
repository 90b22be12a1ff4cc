"""Bi-Partition at run time ("ship" mode, spec §3.6 option A): a worker whose forward range and
backward range differ, and the explicit forward/backward graphs of its misplaced segments.

Shape (``pipecc.ir.plan.Plan.bipartition_pieces``). Worker j runs the forward of (a_{j-1}, a_j]
and the backward of (c_{j-1}, c_j]. The nodes between a_j and c_j form the *segment* of boundary
j (between workers j and j+1): if a_j > c_j its forward runs on j and its backward on j+1
("L": j+1 owns its parameters, j holds a replica), if c_j > a_j its forward runs on j+1 and its
backward on j ("R": j owns them). The rest of worker j's nodes, its *core*, runs forward and
backward on j under ordinary autograd.

A segment runs through the two graphs AOTAutograd splits it into (``functorch.compile.
aot_function`` with ``default_partition``): the forward graph ``(params, buffers, inputs) ->
(outputs, saved)`` on its forward worker, over the replica's (or owner's) weights and detached
inputs, and the backward graph ``(saved, output gradients) -> (parameter gradients, input
gradients)`` on its backward worker, which adds the parameter gradients to the owner's ``.grad``
and feeds the input gradients into its core's autograd backward (L) or sends them on (R). Both
workers trace the same generated segment module (``segment_<b>.py``, the same file in both stage
folders) at run time, once per micro-batch shape (the last micro-batch can be a sample smaller),
on dummy inputs of that shape, so both derive the same graphs and the same saved-tensor list
(count, shapes, dtypes: the receiver allocates its buffers from its own trace). Tracing is the
first thing a segment's first micro-batch does on both ranks (it costs about a second on CPU).

Messages (the schedule does not change: one SEND_F/RECV_F, one SEND_B/RECV_B per boundary and
micro-batch). Forward message at boundary j: the values crossing a_j (``ports.json`` sends), then,
if a_j > c_j, the segment's saved tensors. Backward message at boundary j: the gradients of the
values crossing c_j that carry one (``bipartition.grad_sends`` of worker j+1), then, if c_j > a_j,
the segment's saved tensors. Such a message travels as one packed payload of all its tensors
(``pipecc.runtime.wire.pack_tensors``; the receiver's values and saved tensors are views of it).
Saved tensors that are functions of the weights alone (a weight, its
transpose) do not travel: the backward worker recomputes them from the owner's weights, which
equal the replica's within a step (``Graphs.static_graph``); ``WorkerProgram.saved_bytes`` counts
what does travel.

Weights. The owner (backward worker) holds a segment's parameters and their gradients, and its
optimizer updates them; the forward worker holds a replica, not registered in its stage module
(so not in its optimizer, ``state_dict`` or checkpoints), refreshed from the owner after every
optimizer step (``PipelineRuntime.after_optimizer_step``; the replica's receive lands in its
parameters, posted after its worker's last forward of the step). ``--verify`` compares the owner's
gradients under the original parameter names (the worker module's ``PARAM_NAMES``).

Inference (``infer``) runs every piece eagerly under ``no_grad``; no saved tensors travel.
Imports torch and ``pipecc.runtime``/``pipecc.errors`` only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from pipecc.errors import PipeccError
from pipecc.runtime.ports import Port, StagePorts, as_tuple

__all__ = ["BipartitionWorker", "Graphs", "SegmentRunner", "WorkerProgram", "share_replicas", "trace_segment",
           "worker_class"]

Shape = tuple[int, ...]


# ---------------------------------------------------------------------------- the two graphs


@dataclass
class Graphs:
    """A segment's forward and backward graphs for one input shape.

    ``fw(*static, *inputs) -> (*outputs, *saved)``; ``bw(*saved, *tangents) -> (*static grads,
    *input grads)``. ``static`` = parameters then buffers. ``grad_outputs``: the outputs (indices
    into ``computed``) that get a tangent, in order. ``saved[i]``: (shape, dtype). ``sent``: the
    saved indices that travel; the others (``static_graph``'s outputs, in order) are recomputed
    on the backward worker from its own weights, and ``aliases`` {i: j}: saved tensor i is a
    detach of saved tensor j (AOTAutograd keeps a ReLU's output and its detach, one storage):
    it does not travel, the backward worker uses j for it.
    """

    fw: fx.GraphModule
    bw: fx.GraphModule
    n_out: int
    grad_outputs: list[int]
    saved: list[tuple[Shape, torch.dtype]]
    sent: list[int]
    static_graph: fx.GraphModule | None
    static_index: list[int]
    aliases: dict[int, int] = field(default_factory=dict)


def trace_segment(module: nn.Module, inputs: Sequence[tuple[Shape, torch.dtype, bool]], computed: Sequence[int],
                  device: torch.device) -> Graphs:
    """Trace ``module``'s outputs ``computed`` (indices into its returned tuple) for inputs of these
    (shape, dtype, requires_grad) into the forward and backward graphs (module docstring)."""
    from functorch.compile import aot_function, make_boxed_func
    from torch._functorch.partitioners import default_partition
    from torch.func import functional_call

    params = list(module.named_parameters())
    buffers = list(module.named_buffers())
    names = [n for n, _ in params] + [n for n, _ in buffers]
    k = len(names)
    found: dict[str, fx.GraphModule] = {}

    def keep(which: str) -> Callable:
        def compiler(gm: fx.GraphModule, _example: Any) -> Callable:
            found[which] = gm
            return make_boxed_func(gm.forward)
        return compiler

    def f(*args: torch.Tensor) -> tuple:
        outs = as_tuple(functional_call(module, dict(zip(names, args[:k])), tuple(args[k:])))
        # NOTE: a clone per output: no output aliases an input or another output, so the forward
        # graph returns exactly (outputs, saved) and nothing is regenerated outside it
        return tuple(outs[i].clone() for i in computed)

    traced = aot_function(f, fw_compiler=keep("fw"), bw_compiler=keep("bw"), partition_fn=default_partition)
    static = [p.detach().clone().requires_grad_(p.requires_grad) for _, p in params]
    static += [b.detach().clone() for _, b in buffers]
    dummy = [_dummy(shape, dtype, device).requires_grad_(grad and dtype.is_floating_point)
             for shape, dtype, grad in inputs]
    # NOTE: the trace runs the graphs once on dummy values; a random op among them (dropout) must
    # not move this rank's RNG, or a resumed run's masks would differ from an uninterrupted one's
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        outs = traced(*static, *dummy)
        wanted = [i for i, o in enumerate(outs) if o.requires_grad]
        if wanted:
            torch.autograd.backward([outs[i] for i in wanted], [torch.ones_like(outs[i]) for i in wanted])
    if "fw" not in found or (wanted and "bw" not in found):
        raise PipeccError("Bi-Partition: AOTAutograd produced no forward/backward graph for a segment; "
                          "compile without --bipartition")
    fw = found["fw"]
    if "bw" not in found:  # nothing differentiable: a backward that returns no gradient
        found["bw"] = fx.symbolic_trace(_NoGrad(k + len(inputs)))
    bw = found["bw"]
    holders = [n for n in bw.graph.nodes if n.op == "placeholder"]
    tangents = [n for n in holders if n.name.startswith("tangents")]
    n_saved = len(holders) - len(tangents)
    returned = list(next(n for n in fw.graph.nodes if n.op == "output").args[0])
    if len(tangents) != len(wanted) or len(returned) != len(computed) + n_saved:
        raise PipeccError(f"Bi-Partition: a segment's traced graphs do not have the expected form ({len(returned)} "
                          f"forward outputs for {len(computed)} outputs and {n_saved} saved tensors); compile "
                          "without --bipartition")
    saved_nodes = returned[len(computed):]
    saved = []
    for node in saved_nodes:
        val = node.meta.get("val") if isinstance(node, fx.Node) else None
        if not isinstance(val, torch.Tensor):
            raise PipeccError("Bi-Partition: a segment saves a non-tensor value for its backward; compile "
                              "without --bipartition")
        saved.append((tuple(int(d) for d in val.shape), val.dtype))
    static_graph, static_index = _static_part(fw, k, saved_nodes)
    aliases = _aliases(saved_nodes, static_index)
    sent = [i for i in range(n_saved) if i not in static_index and i not in aliases]
    return Graphs(fw, bw, len(computed), wanted, saved, sent, static_graph, static_index, aliases)


_ALIAS_OPS = ("aten.detach.default", "aten.alias.default")


def _aliases(saved: Sequence[Any], static_index: Sequence[int]) -> dict[int, int]:
    """{i: j}: saved tensor i is a detach (or alias) of saved tensor j, the same values in the
    same storage: sending it too would ship that storage twice."""
    index = {n: i for i, n in enumerate(saved) if isinstance(n, fx.Node)}
    out: dict[int, int] = {}
    for i, n in enumerate(saved):
        if i in static_index or not isinstance(n, fx.Node) or n.op != "call_function":
            continue
        if str(n.target) in _ALIAS_OPS and n.args and index.get(n.args[0], i) != i:
            out[i] = index[n.args[0]]
    return out


class _NoGrad(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def forward(self) -> tuple:
        return (None,) * self.n


def _dummy(shape: Shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A trace input: only its shape and dtype matter (the segment's code has no data-dependent
    control flow: it is straight-line generated code)."""
    if dtype.is_floating_point or dtype.is_complex:
        return torch.full(shape, 0.5, dtype=dtype, device=device)
    return torch.zeros(shape, dtype=dtype, device=device)


_RANDOM = ("rand", "dropout", "bernoulli", "normal", "uniform", "multinomial")


def _static_part(fw: fx.GraphModule, k: int, saved: Sequence[Any]) -> tuple[fx.GraphModule | None, list[int]]:
    """The saved tensors that depend on the weights alone (parameters, buffers), and a graph
    computing them from the weights: the backward worker runs it instead of receiving them."""
    holders = [n for n in fw.graph.nodes if n.op == "placeholder"]
    static: set[fx.Node] = set(holders[:k])
    for node in fw.graph.nodes:
        if node.op != "call_function" or not node.all_input_nodes:
            continue
        if any(r in str(node.target) for r in _RANDOM):
            continue
        if all(i in static for i in node.all_input_nodes):
            static.add(node)
    index = [i for i, n in enumerate(saved) if isinstance(n, fx.Node) and n in static]
    if not index:
        return None, []
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in holders[:k]:
        env[node] = g.placeholder(node.name)
    needed: set[fx.Node] = set()
    stack = [saved[i] for i in index]
    while stack:
        n = stack.pop()
        if n not in needed:
            needed.add(n)
            stack.extend(n.all_input_nodes)
    for node in fw.graph.nodes:
        if node in needed and node.op == "call_function":
            env[node] = g.node_copy(node, lambda x: env[x])
    g.output(tuple(env[saved[i]] for i in index))
    return fx.GraphModule(fw, g), index


# ---------------------------------------------------------------------------- one segment


class SegmentRunner:
    """One segment as seen by one of its two workers: ``role`` "fp" (runs its forward graph on
    ``module``, a replica unless owned) or "bp" (runs its backward graph, accumulating into
    ``module``'s parameters, which it owns)."""

    def __init__(self, info: dict[str, Any], module: nn.Module, worker: int) -> None:
        self.info, self.module, self.worker = info, module, worker
        self.boundary = int(info["boundary"])
        self.fp, self.bp = int(info["fp_worker"]), int(info["bp_worker"])
        self.role = "fp" if worker == self.fp else "bp"
        self.ports = StagePorts.from_json(info)
        self.receives = [p.name for p in self.ports.receives]
        self.sends = [p.name for p in self.ports.sends]
        self.computed = [i for i, n in enumerate(self.sends) if n not in self.receives]
        self._graphs: dict[tuple, Graphs] = {}

    @property
    def owner(self) -> bool:
        return self.role == "bp"

    def static(self) -> list[torch.Tensor]:
        return [p.detach() for p in self.module.parameters()] + [b.detach() for b in self.module.buffers()]

    def graphs(self, shapes: Sequence[Shape]) -> Graphs:
        key = tuple(shapes)
        if key not in self._graphs:
            device = next((t.device for t in self.static()), torch.device("cpu"))
            meta = [(s, p.dtype, p.carries_grad) for s, p in zip(shapes, self.ports.receives)]
            self._graphs[key] = trace_segment(self.module, meta, self.computed, device)
        return self._graphs[key]

    def saved_buffers(self, shapes: Sequence[Shape], device: torch.device) -> list[torch.Tensor]:
        """Empty tensors to receive the saved tensors that travel, for inputs of ``shapes``."""
        g = self.graphs(shapes)
        return [torch.empty(g.saved[i][0], dtype=g.saved[i][1], device=device) for i in g.sent]

    def forward(self, env: dict[str, Any], training: bool) -> list[torch.Tensor]:
        """Put the segment's outputs into ``env`` (by port name); returns the saved tensors that
        travel (training: the forward graph) or [] (otherwise the module runs eagerly)."""
        if not training:  # eager (inference runs under no_grad; pipecc.load differentiates through it)
            outs = as_tuple(self.module(*[env[n] for n in self.receives]))
            env.update((n, v) for n, v in zip(self.sends, outs) if n not in self.receives)
            return []
        inputs = [env[n].detach() for n in self.receives]
        g = self.graphs([tuple(x.shape) for x in inputs])
        with torch.no_grad():
            res = g.fw(*self.static(), *inputs)
        env.update((self.sends[i], res[j]) for j, i in enumerate(self.computed))
        saved = list(res[g.n_out:])
        return [saved[i] for i in g.sent]

    def backward(self, shapes: Sequence[Shape], sent: Sequence[torch.Tensor],
                 grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The backward graph: parameter gradients into the owner's ``.grad``; returns the
        gradients of the segment's inputs (by name, pass-through values included) given
        ``grads`` of its outputs (by name; a missing one counts as zeros)."""
        g = self.graphs(shapes)
        static = self.static()
        saved: list[Any] = [None] * len(g.saved)
        for i, t in zip(g.sent, sent):
            saved[i] = t
        if g.static_graph is not None:
            with torch.no_grad():
                for i, t in zip(g.static_index, as_tuple(g.static_graph(*static))):
                    saved[i] = t
        for i in g.aliases:  # a detach of another saved tensor (a chain of them ends in a filled one)
            j = i
            while j in g.aliases:
                j = g.aliases[j]
            saved[i] = saved[j]
        device = static[0].device if static else torch.device("cpu")
        returned = next(n for n in g.fw.graph.nodes if n.op == "output").args[0]
        tangents = []
        for j in g.grad_outputs:
            t = grads.get(self.sends[self.computed[j]])
            if t is None:  # an output nobody downstream differentiates
                val = returned[j].meta["val"]
                t = torch.zeros(tuple(val.shape), dtype=val.dtype, device=device)
            tangents.append(t.contiguous())
        with torch.no_grad():
            res = list(g.bw(*saved, *tangents))
        k = len(static)
        for p, grad in zip(self.module.parameters(), res[:k]):
            if grad is None or not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = grad.detach().clone()
            else:
                p.grad.add_(grad)
        out: dict[str, torch.Tensor] = {}
        for name, grad in zip(self.receives, res[k:]):
            if grad is not None:
                out[name] = grad
        for name in self.receives:  # a value passed through: its gradient from downstream too
            if name in self.sends and name in grads and grads[name] is not None:
                out[name] = out[name] + grads[name] if name in out else grads[name]
        return out


# ---------------------------------------------------------------------------- one worker


class BipartitionWorker(nn.Module):
    """A worker's stage module: its core and the segments it owns registered (their parameters
    are the worker's: optimizer, ``state_dict``, checkpoints, ``--verify``); the replicas of the
    segments it only runs forward held aside. ``forward`` is the eager forward of the worker's
    forward range (``infer``, ``--verify-stages-only``); training goes through ``WorkerProgram``."""

    PARAM_NAMES: dict[str, str] = {}

    def __init__(self, core: nn.Module, segments: Sequence[tuple[dict[str, Any], nn.Module]], spec: dict[str, Any],
                 worker: int) -> None:
        super().__init__()
        self.core = core
        self.spec, self.worker = spec, worker
        runners = []
        for info, module in segments:
            runner = SegmentRunner(info, module, worker)
            if runner.owner:
                self.add_module(f"segment_{runner.boundary}", module)
            runners.append(runner)
        object.__setattr__(self, "runners", runners)  # plain list: replicas stay unregistered

    def _apply(self, fn: Callable, recurse: bool = True) -> BipartitionWorker:  # type: ignore[override]
        super()._apply(fn, recurse)
        for r in self.runners:
            if not r.owner:
                r.module._apply(fn, recurse)
        return self

    def forward(self, *received: Any) -> tuple:
        env = dict(zip([p["name"] for p in self.spec["receives"]], received))
        program = WorkerProgram(self)
        if program.left is not None and program.left.role == "fp":
            program.left.forward(env, training=False)
        outs = as_tuple(self.core(*[env[n] for n in program.core_receives]))
        env.update(zip(program.core_sends, outs))
        if program.right is not None and program.right.role == "fp":
            program.right.forward(env, training=False)
        return tuple(env[p["name"]] for p in self.spec["sends"])


def share_replicas(modules: Sequence[nn.Module]) -> None:
    """One process (``pipecc.load``): every replica becomes its owner's module, so the eager
    forward's gradients reach the owner's parameters, the model's."""
    owners = {r.boundary: r.module for m in modules if isinstance(m, BipartitionWorker) for r in m.runners if r.owner}
    for m in modules:
        if isinstance(m, BipartitionWorker):
            for r in m.runners:
                if not r.owner and r.boundary in owners:
                    r.module = owners[r.boundary]


def worker_class(names: dict[str, str], shards: dict[str, tuple] | None = None) -> type:
    """A ``BipartitionWorker`` subclass whose ``PARAM_NAMES`` maps its attributes to the model's
    and ``SHARDS`` its split layers' slices (attribute -> (original name, dim, start, size))."""
    return type("BipartitionWorker", (BipartitionWorker,), {"PARAM_NAMES": dict(names), "SHARDS": dict(shards or {})})


@dataclass
class _Pending:
    """What one micro-batch of a worker keeps between its F and its B."""

    core_in: list[Any]
    core_out: list[Any]
    left_saved: list[torch.Tensor]    # L at the left boundary: received with the forward message
    left_shapes: list[Shape]
    right_shapes: list[Shape]
    left_send: list[torch.Tensor]     # R at the left boundary: to send with the backward message
    loss: torch.Tensor | None = None


class WorkerProgram:
    """Worker j's F and B over its pieces (module docstring), and its message layout."""

    def __init__(self, module: BipartitionWorker) -> None:
        self.module = module
        self.worker = module.worker
        spec = module.spec
        self.fwd_receives = [p["name"] for p in spec["receives"]]
        self.fwd_sends = [p["name"] for p in spec["sends"]]
        bip = spec["bipartition"]
        self.core_ports = StagePorts.from_json(bip["core"])
        self.core_receives = [p.name for p in self.core_ports.receives]
        self.core_sends = [p.name for p in self.core_ports.sends]
        self.left = next((r for r in module.runners if r.boundary == self.worker - 1), None)
        self.right = next((r for r in module.runners if r.boundary == self.worker), None)
        # the values whose gradients this worker sends upstream / receives from downstream
        self.grad_sends = [p for p in StagePorts.from_json({"receives": bip["grad_sends"]}).receives if p.carries_grad]
        self.grad_receives = [p for p in StagePorts.from_json({"receives": bip["grad_receives"]}).receives
                              if p.carries_grad]
        self._pending: dict[int, _Pending] = {}
        self.shape_of: Callable[[Port, int], Shape] = lambda port, mb: port.shape
        self.saved_bytes = 0  # saved-tensor bytes this worker has sent (forward and backward messages)
        self.device = torch.device("cpu")

    # -- message layout
    def _shapes(self, runner: SegmentRunner | None, mb: int) -> list[Shape]:
        return [self.shape_of(p, mb) for p in runner.ports.receives] if runner is not None else []

    def forward_extra(self, mb: int, device: torch.device) -> list[torch.Tensor]:
        """Buffers for the saved tensors that arrive with the forward message (L at the left)."""
        if self.left is None or self.left.role != "bp":
            return []
        return self.left.saved_buffers(self._shapes(self.left, mb), device)

    def backward_extra(self, mb: int, device: torch.device) -> list[torch.Tensor]:
        """Buffers for the saved tensors that arrive with the backward message (R at the right)."""
        if self.right is None or self.right.role != "bp":
            return []
        return self.right.saved_buffers(self._shapes(self.right, mb), device)

    # -- actions
    def forward(self, mb: int, leaves: Sequence[Any], training: bool, first: bool) -> tuple[list[Any], list[Any]]:
        """F: (the values crossing a_j, in ``sends`` order; the saved tensors to send after them)."""
        n = len(self.fwd_receives)
        env = dict(zip(self.fwd_receives, leaves[:n]))
        left_saved, left_send = list(leaves[n:]), []
        if self.left is not None and self.left.role == "fp":
            left_send = self.left.forward(env, training)
        core_in = []
        for name, port in zip(self.core_receives, self.core_ports.receives):
            v = env[name]
            if training and not first and port.carries_grad and isinstance(v, torch.Tensor):
                v = v.detach().requires_grad_(True)
            core_in.append(v)
        with torch.set_grad_enabled(training):
            core_out = list(as_tuple(self.module.core(*core_in)))
        env.update(zip(self.core_sends, core_out))
        extra: list[torch.Tensor] = []
        if self.right is not None and self.right.role == "fp":
            extra = self.right.forward(env, training)
            self.saved_bytes += sum(t.numel() * t.element_size() for t in extra)
        if training:
            self._pending[mb] = _Pending(core_in, core_out, left_saved, self._shapes(self.left, mb),
                                         self._shapes(self.right, mb), left_send)
            self.saved_bytes += sum(t.numel() * t.element_size() for t in left_send)
        return [env[name] for name in self.fwd_sends], extra

    def backward(self, mb: int, received: Sequence[Any] | None, loss: torch.Tensor | None,
                 first: bool) -> list[Any] | None:
        """B: the backward message for the worker upstream (None on worker 0)."""
        st = self._pending.pop(mb)
        if loss is not None:
            torch.autograd.backward(loss)
        else:
            received = list(received or ())
            n = len(self.grad_receives)
            grads = {p.name: g for p, g in zip(self.grad_receives, received[:n])}
            if self.right is not None and self.right.role == "bp":
                grads = self.right.backward(st.right_shapes, received[n:], grads)
            pairs = [(o, grads.get(name)) for o, name in zip(st.core_out, self.core_sends)]
            pairs = [(o, g) for o, g in pairs if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if first:
            return None
        grads = {}
        for name, x in zip(self.core_receives, st.core_in):
            if isinstance(x, torch.Tensor) and x.requires_grad:
                grads[name] = x.grad if x.grad is not None else torch.zeros_like(x)
        if self.left is not None and self.left.role == "bp":
            grads = self.left.backward(st.left_shapes, st.left_saved, grads)
        out: list[Any] = []
        for p in self.grad_sends:
            g = grads.get(p.name)
            out.append(g if g is not None else torch.zeros(self.shape_of(p, mb), dtype=p.dtype, device=self.device))
        return out + list(st.left_send)

    def pending(self) -> bool:
        return bool(self._pending)
