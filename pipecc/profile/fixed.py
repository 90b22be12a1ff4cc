"""The fixed costs of `pipecc.targets.fixed_costs`, measured on this machine with as many ranks
running at once as the plan will have (issue #20: a rank's per-call costs depend on how many
others share the cores).

`measure_fixed_costs(devices, threads)` starts one process per rank (rank 0 is the caller; the
others are spawned, as `pipecc.profile.link` spawns its rank 1), each pinned to `threads` intra-op
threads (`pipecc run` gives each rank OMP_NUM_THREADS=1) and to its torch device, in one private
gloo group (never the default group). Every rank measures at the same moment (a barrier starts
each phase), so the figures are those of a loaded machine:

    op_forward_s, op_backward_s   a chain of k tiny elementwise ops (k = 1, 2, 4, .., 32) on a
                                  leaf that needs a gradient; forward and `torch.autograd.backward`
                                  of it timed apart (median of `repeat`), each fitted to
                                  t(k) = a + c·k (`fit.fit_affine`): c is the cost per op call
    microbatch_s                  the two fits' a: what a micro-batch's forward and backward cost
                                  whatever their ops (the autograd engine's start, Python)
    step_s                        `optimizer.zero_grad(); optimizer.step()` of SGD (`pipecc run`'s
                                  default) on one parameter of n = 16 .. 64 Ki floats, fitted to
                                  a + c·n: a, the step's cost beyond its bytes
    message_s                     ranks paired (0,1), (2,3), ..: the host cost of one 4-byte
                                  message on each side, the gloo `isend` call on the sender and a
                                  `recv` whose data has already arrived on the receiver (the mean
                                  of the two medians); what the link's latency and bandwidth
                                  (`pipecc.profile.link`) do not cover. 0.0 with one rank: a
                                  one-stage plan sends nothing

On CUDA ranks the chain and the step are synchronised before each clock read (the figures are
then launch + sync costs). `fixed_costs_section` folds the ranks into the profile's
`"fixed_costs"` section, one entry per device name (the median over its ranks), in the format
`pipecc.targets.fixed_costs` documents and reads.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from datetime import timedelta
from typing import Any, Callable, Sequence

from pipecc.errors import PipeccError
from pipecc.profile.fit import fit_affine

__all__ = ["measure_fixed_costs", "fixed_costs_section", "measure_rank"]

HOST = "127.0.0.1"
CHAIN = (1, 2, 4, 8, 16, 32)
STEP_SIZES = (16, 1024, 65536)
MESSAGES = 40


def _clock(sync: Callable[[], None], fn: Callable[[], Any]) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def _median_time(sync: Callable[[], None], make: Callable[[], Callable[[], Any]], repeat: int,
                 warmup: int = 2) -> float:
    """Median seconds of `make()()` over `repeat` runs after `warmup` (make: untimed set-up)."""
    runs = []
    for i in range(warmup + repeat):
        fn = make()
        seconds = _clock(sync, fn)
        if i >= warmup:
            runs.append(seconds)
    return statistics.median(runs)


def measure_rank(device: str, repeat: int = 15) -> dict[str, float]:
    """One rank's op, micro-batch and step figures on torch device `device` (module docstring)."""
    import torch
    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    fwd_t, bwd_t = [], []
    for k in CHAIN:
        def forward(k: int = k) -> Callable[[], Any]:
            leaf = torch.ones(4, device=dev, requires_grad=True)

            def run() -> None:
                y = leaf
                for _ in range(k):
                    y = y * 1.0001
            return run

        def backward(k: int = k) -> Callable[[], Any]:
            leaf = torch.ones(4, device=dev, requires_grad=True)
            y = leaf
            for _ in range(k):
                y = y * 1.0001
            grad = torch.ones_like(y)
            return lambda: torch.autograd.backward(y, grad)
        with torch.enable_grad():
            fwd_t.append(_median_time(sync, forward, repeat))
            bwd_t.append(_median_time(sync, backward, repeat))
    f, b = fit_affine(list(CHAIN), fwd_t), fit_affine(list(CHAIN), bwd_t)
    step_t = []
    for n in STEP_SIZES:
        param = torch.nn.Parameter(torch.zeros(n, device=dev))
        opt = torch.optim.SGD([param], lr=1e-3)

        def step(param: Any = param, opt: Any = opt) -> Callable[[], Any]:
            param.grad = torch.ones_like(param)

            def run() -> None:
                opt.step()
                opt.zero_grad()
            return run
        step_t.append(_median_time(sync, step, repeat))
    s = fit_affine([n * 4 for n in STEP_SIZES], step_t)  # bytes of float32
    return {"op_forward_s": f.c, "op_backward_s": b.c, "microbatch_s": f.a + b.a, "step_s": s.a,
            "fit_error": max(f.error, b.error, s.error)}


def _messages(group: Any, rank: int, peer: int) -> float:
    """One side's median host cost of a 4-byte message (module docstring)."""
    import torch
    buf = torch.zeros(1, dtype=torch.int32)
    runs = []
    if rank < peer:  # the sender: the isend calls, then the last one's completion
        works = []
        for _ in range(MESSAGES):
            t0 = time.perf_counter()
            works.append(group.send([buf], peer, 7))
            runs.append(time.perf_counter() - t0)
        for w in works:
            w.wait()
    else:  # the receiver: once the sends are there, each receive of data already arrived
        time.sleep(0.05)
        for _ in range(MESSAGES):
            t0 = time.perf_counter()
            group.recv([buf], peer, 7).wait()
            runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def _rank_work(rank: int, world: int, store: Any, device: str, threads: int, timeout: timedelta,
               repeat: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=HOST)]
    options._timeout = timeout
    group = dist.ProcessGroupGloo(store, rank, world, options)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        group.barrier().wait()  # NOTE: every rank measures at once: the machine as a run loads it
        start = time.time()
        figures: dict[str, Any] = dict(measure_rank(device, repeat))
        figures["window"] = [start, time.time()]  # wall clock: the ranks' windows overlap
        group.barrier().wait()
        peer = rank + 1 if rank % 2 == 0 else rank - 1
        if peer < world:
            figures["message_s"] = _messages(group, rank, peer)
            figures["peer"] = peer
        group.barrier().wait()
    finally:
        torch.set_num_threads(before)
    figures["rank"], figures["device"] = rank, device
    return figures


def _child(_index: int, rank: int, world: int, port: int, device: str, threads: int, timeout_s: float,
           repeat: int) -> None:
    """Entry of a spawned rank: measure, put the figures in the store."""
    import torch.distributed as dist
    os.environ["OMP_NUM_THREADS"] = str(threads)
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(HOST, port, world, False, timeout=timeout)
    store.set(f"fixed/{rank}", json.dumps(_rank_work(rank, world, store, device, threads, timeout, repeat)))


def measure_fixed_costs(devices: Sequence[str], threads: int = 1, *, repeat: int = 15,
                        timeout_s: float = 60.0) -> list[dict[str, Any]]:
    """Per rank (one per torch device in `devices`, all at once): {rank, device, op_forward_s,
    op_backward_s, microbatch_s, step_s, fit_error, window: [start, end] (wall clock of its op and
    step measurements)[, message_s, peer]}. Raises PipeccError (one
    line) when a rank fails or the ranks do not meet in `timeout_s`."""
    import torch.distributed as dist
    import torch.multiprocessing as mp
    world = len(devices)
    if world == 0:
        return []
    timeout = timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(HOST, 0, world, True, timeout=timeout, wait_for_workers=False)
    except Exception as exc:
        raise PipeccError(f"measuring the fixed costs: cannot open a store on {HOST}: {exc}") from exc
    children = [mp.start_processes(_child, args=(r, world, store.port, devices[r], threads, timeout_s, repeat),
                                   nprocs=1, join=False, start_method="spawn") for r in range(1, world)]
    try:
        mine = _rank_work(0, world, store, devices[0], threads, timeout, repeat)
        out = [mine] + [json.loads(store.get(f"fixed/{r}")) for r in range(1, world)]
        for c in children:
            c.join(timeout=timeout_s)
    except Exception as exc:
        text = str(exc).strip()
        raise PipeccError(f"measuring the fixed costs on {world} ranks failed: "
                          f"{text.splitlines()[-1] if text else type(exc).__name__}") from exc
    finally:
        for c in children:
            for p in c.processes:
                if p.is_alive():
                    p.terminate()
                    p.join(5)
    return out


def fixed_costs_section(ranks: Sequence[dict[str, Any]], names: Sequence[str], host: str,
                        threads: int) -> dict[str, dict[str, Any]]:
    """The profile's "fixed_costs": per device name (`names[r]` is rank r's), the median of its
    ranks' figures, with "ranks" (how many ran at once) and "source"."""
    out: dict[str, dict[str, Any]] = {}
    world = len(ranks)
    for name in dict.fromkeys(names):
        mine = [r for r, n in zip(ranks, names) if n == name]
        entry: dict[str, Any] = {k: statistics.median(float(r[k]) for r in mine)
                                 for k in ("op_forward_s", "op_backward_s", "microbatch_s", "step_s")}
        sent = [float(r["message_s"]) for r in mine if "message_s" in r]
        entry["message_s"] = statistics.median(sent) if sent else 0.0
        where = ", ".join(sorted({str(r["device"]) for r in mine}))
        entry["ranks"] = world
        entry["fit_error"] = max(float(r["fit_error"]) for r in mine)
        out[name] = entry
        entry["source"] = (f"measured by pipecc profile on {host} ({where}): {world} rank(s) at once, {threads} "
                           f"thread(s) each; ops: a chain of k tiny ops fitted a + c*k (c per op, a per "
                           f"micro-batch); step: SGD step + zero_grad fitted a + c*bytes (a); message: a gloo "
                           + ("4-byte isend/recv call, mean of the two sides" if sent else
                              "message needs two ranks: none measured"))
    return out
