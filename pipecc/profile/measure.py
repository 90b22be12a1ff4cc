"""Timing every node of a captured graph, forward and backward, on one real device.

`time_nodes(gm, make_inputs, device, sizes)` runs the graph once per micro-batch size with
`NodeTimer`, an `fx.Interpreter` that times each call node (call_module, call_function,
call_method) in isolation:

  forward   the node's op on its actual inputs, `warmup` untimed runs then the median of
            `repeat` timed runs, autograd recording on (as in training);
  backward  `torch.autograd.grad` of the node's outputs, with random output gradients,
            with respect to its floating-point inputs that need a gradient and the
            parameters of its module (autograd.grad leaves `.grad` untouched), with the same
            warm-up and median; 0.0 when nothing needs a gradient.

Each timed run gets fresh copies of the inputs (made before the clock starts): in-place ops
(`ReLU(inplace=True)`, `add_`) would otherwise change the values the next run sees, and an
in-place op on an autograd leaf is an error. The copies are leaves cut from the rest of the
graph, so a node's backward is its own and nothing else's. Values passed on to later nodes
are detached (a node's autograd graph is freed as soon as it is timed).

The model is left as found: `preserved_state` snapshots every parameter and buffer and
restores them afterwards (training-mode BatchNorm updates its running statistics on every
timed run), then checks they are bit-identical; the random number generators are forked,
so dropout draws during profiling do not shift the caller's random stream.

Preconditions: the graph runs at every size in `sizes` (`make_inputs(b)` returns inputs of
batch b); the caller moved `gm` to `device`.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_map

from pipecc.errors import PipeccError
from pipecc.ir.graph import META_NAME, META_OP

__all__ = ["Sample", "NodeTimer", "preserved_state", "time_nodes", "microbatch_sizes"]

TIMED_OPS = ("call_module", "call_function", "call_method")


@dataclass(frozen=True)
class Sample:
    mb: int
    fwd_s: float
    bwd_s: float

    def to_json(self) -> dict[str, Any]:
        return {"mb": self.mb, "fwd_s": self.fwd_s, "bwd_s": self.bwd_s}


def microbatch_sizes(batch_size: int) -> list[int]:
    """1, 2, 4, ... below `batch_size`, then `batch_size` itself."""
    sizes, b = [], 1
    while b < batch_size:
        sizes.append(b)
        b *= 2
    return sizes + [batch_size]


# ------------------------------------------------------------------------------ clocks
Clock = Callable[[Callable[[], Any]], "tuple[float, Any]"]


def cpu_clock(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def cuda_clock(device: torch.device) -> Clock:
    """Times with CUDA events on the device's current stream; synchronises before and after
    so queued work of earlier runs is not billed to this one."""
    def clock(fn: Callable[[], Any]) -> tuple[float, Any]:
        with torch.cuda.device(device):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3, out
    return clock


def clock_for(device: torch.device) -> Clock:
    if device.type == "cuda":
        return cuda_clock(device)
    if device.type == "cpu":
        return cpu_clock
    raise PipeccError(f"cannot time on torch device {device}: pipecc profile supports cpu and cuda")


# ------------------------------------------------------------------------------ timing
class NodeTimer(fx.Interpreter):
    """Runs the graph once; `times[name] = (fwd_s, bwd_s)` for every call node."""

    def __init__(self, gm: fx.GraphModule, clock: Clock, *, warmup: int, repeat: int) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.clock, self.warmup, self.repeat = clock, warmup, repeat
        self.extra_traceback = False  # errors are reported by node name, one line
        self.times: dict[str, tuple[float, float]] = {}
        self.node: fx.Node | None = None  # the node running now (for error messages)

    def run_node(self, n: fx.Node) -> Any:
        self.node = n
        if n.op not in TIMED_OPS:
            return super().run_node(n)
        with self._set_current_node(n):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            call = getattr(self, n.op)
            params = ([p for p in self.fetch_attr(n.target).parameters() if p.requires_grad]
                      if n.op == "call_module" else [])
            with torch.enable_grad():
                fwd_runs: list[float] = []
                for i in range(self.warmup + self.repeat):
                    (a, k), leaves = _fresh((args, kwargs))
                    seconds, out = self.clock(lambda: call(n.target, a, k))
                    if i >= self.warmup:
                        fwd_runs.append(seconds)
                bwd_s = self._backward(out, leaves + params)
            self.times[n.meta.get(META_NAME, n.name)] = (statistics.median(fwd_runs), bwd_s)
            # later nodes see plain tensors that keep only whether they need a gradient
            return tree_map(_cut, out)

    def _backward(self, out: Any, wrt: list[torch.Tensor]) -> float:
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if not outs or not wrt:
            return 0.0
        grads = [torch.randn_like(t) for t in outs]
        runs: list[float] = []
        for i in range(self.warmup + self.repeat):
            seconds, _ = self.clock(lambda: torch.autograd.grad(
                outs, wrt, grads, retain_graph=True, allow_unused=True))
            if i >= self.warmup:
                runs.append(seconds)
        return statistics.median(runs)


def _fresh(tree: Any) -> tuple[Any, list[torch.Tensor]]:
    """Copies of the tensors in `tree`; those needing a gradient become leaves (returned)
    seen through a clone, so in-place ops are legal and gradients reach the leaves."""
    leaves: list[torch.Tensor] = []

    def copy(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if x.requires_grad:
            leaf = x.detach().requires_grad_(True)
            leaves.append(leaf)
            return leaf.clone()
        return x.clone()
    return tree_map(copy, tree), leaves


def _cut(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().requires_grad_(x.requires_grad)
    return x


# ------------------------------------------------------------------------------ state
@contextmanager
def preserved_state(module: torch.nn.Module) -> Iterator[None]:
    """Restore every parameter and buffer of `module` on exit; then check bit-identity."""
    saved: dict[str, tuple[torch.Tensor, torch.Tensor]] = {
        name: (t, t.detach().clone()) for name, t in module.state_dict(keep_vars=True).items()
        if isinstance(t, torch.Tensor)}
    cpu_rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.random.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        with torch.no_grad():
            for live, copy in saved.values():
                live.copy_(copy)
    changed = [name for name, (live, copy) in saved.items()
               if not torch.equal(live.detach(), copy) and not _both_nan(live.detach(), copy)]
    if changed:  # a bug in this module, not the user's: name it
        raise AssertionError(f"profiling changed the model's state: {', '.join(changed[:5])}")


def _both_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                and torch.equal(a.nan_to_num(), b.nan_to_num()))


def time_nodes(gm: fx.GraphModule, make_inputs: Callable[[int], tuple], device: torch.device,
               sizes: Sequence[int], *, warmup: int = 2, repeat: int = 5,
               on_size: Callable[[int], None] = lambda b: None) -> list[dict[str, Any]]:
    """Per call node in graph order: {name, op, samples: [Sample]} at every size in `sizes`.

    A node that fails, or inputs that cannot be made, raise a PipeccError naming the node,
    the device and the micro-batch size."""
    clock = clock_for(device)
    nodes = [n for n in gm.graph.nodes if n.op in TIMED_OPS]
    samples: dict[str, list[Sample]] = {n.meta.get(META_NAME, n.name): [] for n in nodes}
    with preserved_state(gm):
        for b in sizes:
            try:
                inputs = tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x,
                                  tuple(make_inputs(b)))
            except Exception as exc:
                raise PipeccError(f"example_inputs({b}) failed: {type(exc).__name__}: "
                                  f"{_first_line(exc)}") from exc
            timer = NodeTimer(gm, clock, warmup=warmup, repeat=repeat)
            try:
                timer.run(*inputs)
            except PipeccError:
                raise
            except Exception as exc:
                node = timer.node
                where = node.meta.get(META_NAME, node.name) if node is not None else "?"
                raise PipeccError(f"node {where} failed on {device} at micro-batch {b}: "
                                  f"{type(exc).__name__}: {_first_line(exc)}") from exc
            for name, (fwd, bwd) in timer.times.items():
                samples[name].append(Sample(b, fwd, bwd))
            on_size(b)
    return [{"name": n.meta.get(META_NAME, n.name), "op": n.meta.get(META_OP, str(n.target)),
             "samples": samples[n.meta.get(META_NAME, n.name)]} for n in nodes]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""
