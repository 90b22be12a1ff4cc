"""Point-to-point latency and bandwidth between two ranks over torch.distributed.

`measure_link()` is rank 0 itself and spawns one process as rank 1 on this host; they meet
at a `TCPStore` on 127.0.0.1 (port chosen by the OS), ping-pong messages of 4 B .. 16 MiB,
and the one-way time (half the median round trip) is fitted to t(n) = latency +
n / bandwidth with `fit.fit_affine` (relative error: the small messages pin the latency,
the large ones the bandwidth).

Backends: gloo between CPU processes; NCCL between two GPUs (`devices=("cuda:0",
"cuda:1")`), where the host clock is read after `torch.cuda.synchronize()` so the time is
that of the transfer, not of queueing it.

NOTE: the ranks talk through a private process group object, never
`init_process_group`: the caller's default group (if a script has one) stays untouched,
and the parent, with torch already imported, needs no second start-up. Rank 1 is spawned,
not forked (a fork of a process with CUDA or OpenMP state is unsafe), so it pays one torch
import, about two seconds. This measures within one host; across hosts (`pipecc profile
--nnodes N`, started on every host around node 0's store) is `pipecc.profile.crosshost`,
which reuses this module's `pair_group`, `ping_pong` and `link_record`.
"""

from __future__ import annotations

import statistics
import time
from datetime import timedelta
from typing import Any, Sequence

from pipecc.errors import PipeccError
from pipecc.profile.fit import fit_affine

__all__ = ["DEFAULT_SIZES", "link_record", "measure_link", "pair_group", "ping_pong"]

DEFAULT_SIZES = (4, 64, 1024, 16 * 1024, 256 * 1024, 4 * 2 ** 20, 16 * 2 ** 20)  # 4 B .. 16 MiB
HOST = "127.0.0.1"


def measure_link(backend: str = "gloo", devices: Sequence[str] = ("cpu", "cpu"),
                 sizes: Sequence[int] = DEFAULT_SIZES, *, warmup: int = 2, repeat: int = 5,
                 timeout_s: float = 60.0) -> dict[str, Any]:
    """{scope: "in-host", backend, devices, latency_s, bandwidth_Bps, fit_error, statistic,
    warmup, repeat, samples: [{bytes, seconds}]}.

    Raises PipeccError (one line) when rank 1 fails or the ranks do not meet in `timeout_s`."""
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if len(devices) != 2:
        raise ValueError(f"measure_link needs two devices, got {list(devices)}")
    timeout = timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(HOST, 0, 2, True, timeout=timeout, wait_for_workers=False)
    except Exception as exc:
        raise PipeccError(f"measuring the {backend} link: cannot open a store on {HOST}: {exc}") from exc
    child = mp.start_processes(_rank1, args=(backend, store.port, devices[1], list(sizes),
                                             warmup, repeat, timeout_s),
                               nprocs=1, join=False, start_method="spawn")
    try:
        device = torch.device(devices[0])
        group = pair_group(backend, store, 0, timeout, device)
        samples = ping_pong(group, 0, device, sizes, warmup, repeat)
        child.join(timeout=timeout_s)
    except mp.ProcessRaisedException as exc:
        raise PipeccError(f"measuring the {backend} link failed in rank 1: {_last_line(exc)}") from exc
    except Exception as exc:
        why = _child_failure(child) or f"{type(exc).__name__}: {_last_line(exc)}"
        raise PipeccError(f"measuring the {backend} link failed: {why}") from exc
    finally:
        for p in child.processes:
            if p.is_alive():
                p.terminate()
                p.join(5)
    return {"scope": "in-host", **link_record(backend, devices, samples, warmup, repeat)}


def link_record(backend: str, devices: Sequence[str], samples: list[dict[str, float]],
                warmup: int, repeat: int) -> dict[str, Any]:
    """The ping-pong samples (rank 0's) fitted to latency + bytes / bandwidth:
    {backend, devices, latency_s, bandwidth_Bps, fit_error, statistic, warmup, repeat, samples}."""
    fit = fit_affine([s["bytes"] for s in samples], [s["seconds"] for s in samples])
    # NOTE: a zero slope (noise made the largest message no slower per byte than the
    # smallest) would be an infinite bandwidth; fall back to the largest message's rate
    largest = max(samples, key=lambda s: s["bytes"])
    bandwidth = 1.0 / fit.c if fit.c > 0 else largest["bytes"] / largest["seconds"]
    latency = fit.a if fit.a > 0 else min(s["seconds"] for s in samples)
    return {"backend": backend, "devices": list(devices), "latency_s": latency,
            "bandwidth_Bps": bandwidth, "fit_error": fit.error, "statistic": "median",
            "warmup": warmup, "repeat": repeat, "samples": samples}


def pair_group(backend: str, store: Any, rank: int, timeout: timedelta, device: Any,
               hostname: str = HOST, interface: str | None = None) -> Any:
    """A two-rank process group that is not the default group; gloo binds to `interface`
    if given, else to `hostname` (loopback here; for a cross-host link, the address this
    host reaches the other through)."""
    import torch
    import torch.distributed as dist
    if backend == "nccl":
        torch.cuda.set_device(device)
        return dist.ProcessGroupNCCL(store, rank, 2)
    if backend != "gloo":
        raise PipeccError(f"unknown link backend {backend!r}; pipecc profile uses gloo or nccl")
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(interface=interface) if interface
                        else dist.ProcessGroupGloo.create_device(hostname=hostname)]
    options._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, 2, options)


def ping_pong(group: Any, rank: int, device: Any, sizes: Sequence[int], warmup: int,
              repeat: int) -> list[dict[str, float]]:
    """Rank 0 sends and times the round trip; rank 1 echoes. Samples on rank 0 only."""
    import torch
    cuda = device.type == "cuda"
    peer = 1 - rank
    out: list[dict[str, float]] = []

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    for n in sizes:
        buf = torch.zeros(n, dtype=torch.uint8, device=device)
        runs: list[float] = []
        for i in range(warmup + repeat):
            if rank == 0:
                sync()
                t0 = time.perf_counter()
                group.send([buf], peer, 0).wait()
                group.recv([buf], peer, 0).wait()
                sync()
                if i >= warmup:
                    runs.append((time.perf_counter() - t0) / 2)  # one way
            else:
                group.recv([buf], peer, 0).wait()
                group.send([buf], peer, 0).wait()
                sync()
        if rank == 0:
            out.append({"bytes": n, "seconds": statistics.median(runs)})
    return out


def _rank1(_index: int, backend: str, port: int, device: str, sizes: list[int], warmup: int,
           repeat: int, timeout_s: float) -> None:
    """Entry of the spawned process (`_index` is torch.multiprocessing's process index)."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(HOST, port, 2, False, timeout=timeout)
    dev = torch.device(device)
    ping_pong(pair_group(backend, store, 1, timeout, dev), 1, dev, sizes, warmup, repeat)


def _child_failure(child: Any) -> str | None:
    """Rank 1's error, if it has died with one."""
    import torch.multiprocessing as mp
    try:
        child.join(timeout=1)
    except mp.ProcessRaisedException as exc:
        return f"rank 1: {_last_line(exc)}"
    except mp.ProcessExitedException as exc:
        return f"rank 1 exited: {exc}"
    return None


def _last_line(exc: BaseException) -> str:
    """A child's exception arrives as its whole traceback; the last line is the error."""
    text = str(exc).strip()
    return text.splitlines()[-1] if text else type(exc).__name__
