"""The devices a pipeline runs on, as the planner sees them: `Device` (figures and the
roofline time model), `Link` (a point-to-point link) and `Cluster` (devices in pipeline order
with the full link matrix). Where the figures come from is `pipecc.targets.catalog`.

Time model (roofline, per node or per stage)::

    t_compute = flops_matmul / (peak[dtype] * eff.matmul)
              + (flops - flops_matmul) / (peak_other[dtype] * eff.other)
    t_memory  = bytes_moved / (mem_bandwidth * eff.memory)
    time      = max(t_compute, t_memory)

``peak`` is the matmul-class peak (GPU: dense tensor-core figure; ``fp32`` is the
CUDA-core figure, ask for ``tf32`` to get TF32 tensor cores); ``peak_other`` is the
non-matmul peak (GPU: CUDA cores). Peaks never include efficiency. FPGA peaks are
computed, not listed: ``peak[dtype] = 2 * macs_per_dsp[dtype] * dsp * clock_hz``, so the
attainable rate is ``2 * macs_per_dsp * dsp * clock_hz * eff.matmul``
(:meth:`Device.attainable_flops`). A link moves ``n`` bytes in ``latency + n/bandwidth``
seconds, bandwidth per direction; zero bytes cost nothing.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Mapping

from pipecc.techniques import capabilities as _caps

KINDS = ("cpu", "gpu", "fpga")
GPU_DTYPES = ("fp32", "tf32", "fp16", "bf16")
FPGA_DTYPES = GPU_DTYPES + ("fixed16", "int8")
EFFICIENCY_KEYS = ("matmul", "other", "memory")
_DTYPE_ALIASES = {
    "float32": "fp32", "float": "fp32", "f32": "fp32",
    "float16": "fp16", "half": "fp16", "f16": "fp16",
    "bfloat16": "bf16", "tensorfloat32": "tf32",
    "fixed": "fixed16", "int16": "fixed16", "qint8": "int8",
}


def normalize_dtype(dtype: Any) -> str:
    """``"float32"``, ``torch.float32``, ``"fp32"`` -> ``"fp32"`` (lower-case short name)."""
    name = str(dtype).lower().removeprefix("torch.")
    return _DTYPE_ALIASES.get(name, name)


@dataclass(frozen=True)
class Link:
    """A point-to-point link; ``bandwidth`` in bytes/s per direction, ``latency`` in s."""

    name: str
    bandwidth: float
    latency: float
    source: str

    def time(self, nbytes: float) -> float:
        """Seconds to send one message of ``nbytes`` (0 bytes: no message, 0.0)."""
        if nbytes < 0:
            raise ValueError(f"negative message size {nbytes} on link {self.name}")
        if nbytes == 0:
            return 0.0
        return self.latency + nbytes / self.bandwidth

    def to_json(self) -> dict:
        return {"name": self.name, "bandwidth": self.bandwidth, "latency": self.latency,
                "source": self.source}


@dataclass(frozen=True)
class Device:
    """One pipeline device: figures from the catalog plus an optional placement."""

    name: str
    kind: str
    placement: str | None
    memory_bytes: float
    mem_bandwidth: float
    peak_flops: Mapping[str, float]
    efficiency: Mapping[str, float]
    sources: Mapping[str, str]
    fpga: Mapping[str, Any] | None
    # NOTE: non-matmul peak per dtype; empty means "same as peak_flops".
    peak_flops_other: Mapping[str, float] = field(default_factory=dict)
    description: str = ""

    def __hash__(self) -> int:  # mappings are plain dicts; hash the scalar identity
        return hash((self.name, self.kind, self.placement, self.memory_bytes,
                     self.mem_bandwidth, tuple(sorted(self.peak_flops.items()))))

    @property
    def capabilities(self) -> frozenset[str]:
        """What a stage on this device can do (`pipecc.techniques.capabilities`: by kind)."""
        return _caps.of_kind(self.kind)

    def can(self, capability: str) -> bool:
        return capability in self.capabilities

    def peak(self, dtype: Any = "fp32", matmul: bool = True) -> float:
        """Peak FLOP/s for ``dtype``, matmul-class or other (no efficiency applied)."""
        dt = normalize_dtype(dtype)
        table = self.peak_flops if matmul else (self.peak_flops_other or self.peak_flops)
        if dt not in table:
            raise ValueError(f"device '{self.name}' has no peak for dtype '{dtype}'; "
                             f"known: {', '.join(table)}")
        return float(table[dt])

    def attainable_flops(self, dtype: Any = "fp32", matmul: bool = True) -> float:
        """``peak * efficiency``: the rate the time model actually uses."""
        return self.peak(dtype, matmul) * self.efficiency["matmul" if matmul else "other"]

    def compute_time(self, flops: float, flops_matmul: float, bytes_moved: float,
                     dtype: str = "fp32") -> float:
        """Roofline time in seconds::

            max(flops_matmul / (peak * eff_matmul)
                + (flops - flops_matmul) / (peak_other * eff_other),
                bytes_moved / (mem_bandwidth * eff_memory))

        ``flops`` counts all work (a multiply-add is 2), ``flops_matmul`` the matmul-class
        part of it (clamped so the rest is never negative); ``bytes_moved`` is off-chip
        traffic (weights, inputs, outputs).
        """
        flops, flops_matmul, bytes_moved = float(flops), float(flops_matmul), float(bytes_moved)
        if min(flops, flops_matmul, bytes_moved) < 0:
            raise ValueError("compute_time needs non-negative flops, flops_matmul, bytes_moved")
        other = max(flops - flops_matmul, 0.0)
        t_compute = 0.0
        if flops_matmul:
            t_compute += flops_matmul / self.attainable_flops(dtype, matmul=True)
        if other:
            t_compute += other / self.attainable_flops(dtype, matmul=False)
        t_memory = bytes_moved / (self.mem_bandwidth * self.efficiency["memory"]) if bytes_moved else 0.0
        return max(t_compute, t_memory)

    def to_json(self) -> dict:
        return {"name": self.name, "kind": self.kind, "placement": self.placement,
                "memory_bytes": self.memory_bytes, "mem_bandwidth": self.mem_bandwidth,
                "peak_flops": dict(self.peak_flops),
                "peak_flops_other": dict(self.peak_flops_other or self.peak_flops),
                "efficiency": dict(self.efficiency), "sources": dict(self.sources),
                "fpga": copy.deepcopy(dict(self.fpga)) if self.fpga else None}


class LinkTable:
    """The n x n link matrix without n x n memory: the links a file gave (a dict of pairs) and
    the catalog's default rule for every other pair, computed when asked for. A cluster of
    thousands of devices (`4x1024xcpu`) is refused by the planner against the model's units; its
    table must not take gigabytes first. `table[i][j]` and iteration over rows work as on the
    tuple of tuples it replaces (the diagonal is None)."""

    def __init__(self, devices: tuple[Device, ...], given: Mapping[tuple[int, int], Link],
                 default: Any) -> None:
        self._devices, self._given, self._default = devices, dict(given), default
        self._asked: dict[tuple[int, int], Link] = {}  # the pairs asked for, each computed once

    def __len__(self) -> int:
        return len(self._devices)

    def __getitem__(self, i: int) -> "_LinkRow":
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        return _LinkRow(self, i % len(self))

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        """Equal to any table (a tuple of tuples too) with the same link at every pair."""
        try:
            if len(other) != len(self):  # type: ignore[arg-type]
                return False
            return all(tuple(a) == tuple(b) for a, b in zip(self, other))  # type: ignore[call-overload]
        except TypeError:
            return NotImplemented

    def __hash__(self) -> int:
        return hash(len(self))

    def at(self, i: int, j: int) -> Link | None:
        if i == j:
            return None
        link = self._given.get((i, j)) or self._asked.get((i, j))
        if link is None:
            link = self._asked[i, j] = self._default(self._devices[i], self._devices[j])
        return link


class _LinkRow:
    """One row of a `LinkTable` (`table[i]`), indexed and iterated like a tuple."""

    def __init__(self, table: LinkTable, i: int) -> None:
        self._table, self._i = table, i

    def __len__(self) -> int:
        return len(self._table)

    def __getitem__(self, j: int) -> Link | None:
        if not -len(self) <= j < len(self):
            raise IndexError(j)
        return self._table.at(self._i, j % len(self))

    def __iter__(self):
        return (self[j] for j in range(len(self)))


@dataclass(frozen=True)
class Cluster:
    """Devices in pipeline order (stage i runs on device i) and the full link matrix."""

    devices: tuple[Device, ...]
    links: Any  # a tuple of tuples or a `LinkTable`: links[i][j], None on the diagonal

    def __len__(self) -> int:
        return len(self.devices)

    def link(self, i: int, j: int) -> Link:
        if i == j:
            raise ValueError(f"no link from device {i} to itself")
        return self.links[i][j]  # type: ignore[return-value]

    def to_json(self) -> dict:
        n = len(self.devices)
        return {"devices": [d.to_json() for d in self.devices],
                "links": [[None if i == j else self.links[i][j].name for j in range(n)]
                          for i in range(n)]}

