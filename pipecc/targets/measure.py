"""Figures read from this machine: its RAM (the catalog's ``cpu`` memory) and, on request,
its achieved matmul rate and copy bandwidth (`Catalog.with_measured_cpu`)."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path


def host_memory_bytes() -> tuple[float, str]:
    """This machine's RAM in bytes, and "" or the source note of the default used instead."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), ""
    except (ValueError, OSError, AttributeError):
        pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024, ""
    except OSError:
        pass
    return 16e9, "assumption: host RAM could not be read; 16 GB stated default"


def measure_cpu() -> dict:
    """Achieved fp32 matmul FLOP/s and copy bandwidth of this machine.

    Takes well under 1 s once torch is imported (importing torch is not counted).

    ``fp32_flops``: best of a few 512x512 fp32 ``torch.mm``; ``mem_bandwidth``: best of a
    few 32 MiB tensor copies, counting read + write bytes (STREAM "copy" convention).
    """
    import torch

    start = time.perf_counter()
    n = 512
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)  # warm-up: thread pool, kernel selection
    best = math.inf
    for _ in range(8):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    flops = 2.0 * n ** 3 / best
    src = torch.ones(8 * 1024 * 1024)  # 32 MiB of fp32
    dst = torch.empty_like(src)
    dst.copy_(src)
    best_copy = math.inf
    for _ in range(4):
        t0 = time.perf_counter()
        dst.copy_(src)
        best_copy = min(best_copy, time.perf_counter() - t0)
    bandwidth = 2.0 * src.numel() * src.element_size() / best_copy
    return {"fp32_flops": flops, "mem_bandwidth": bandwidth, "threads": torch.get_num_threads(),
            "seconds": time.perf_counter() - start}
