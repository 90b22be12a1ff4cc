"""Device and link catalog, ``--devices`` spec parsing, and the per-node time model.

The catalog is package data (``pipecc/targets/data/devices.toml``): every figure there carries a
source string that starts with ``datasheet:``, ``derived:`` (arithmetic on datasheet
figures), ``assumption:``, ``tool:`` (reported by Vivado/Vitis HLS) or ``host:`` (read
from this machine); ``measured:`` and ``user:`` mark measured CPUs and cluster-file
definitions.
``pipecc devices`` prints it with :func:`format_catalog`.

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

Spec syntax (``--devices`` and ``pipecc.compile(devices=...)``):

* a comma list, or a list of strings (each may itself be a comma list);
* ``NAME`` a catalog device, case-insensitive; ``NxNAME`` repeats it N times (1..1024);
* ``NAME@PLACE`` pins a local placement (``a100@cuda:1``, ``cpu@cpu``). ``2xa100@cuda:0``
  puts both stages on ``cuda:0``: allowed, the drop-in module may run several stages on
  one device (their link is then ``same_device``, i.e. free). The placement is not
  checked against the kind: ``a100@cpu`` models an A100 but runs on the CPU.
* ``@FILE.toml`` reads a cluster file (path relative to the working directory); it must
  be the whole spec::

    devices = ["2xa100", "v100@cuda:2", "u250"]   # pipeline order; tokens as above
    links = ["nvlink3", "pcie4x16", "pcie3x16"]   # optional, one per consecutive pair
                                                  # of the expanded list; "" = default
    # or link_matrix = [["", "nvlink3", ...], ...] # full n x n, diagonal "", "" = default
    [device.mygpu]                 # a custom device; `base` copies a catalog entry
    base = "a100"                  # kind, figures, links; then any field is overridden
    memory_bytes = 40e9            # fields: kind, description, memory_bytes,
    source = "vendor sheet ..."    # mem_bandwidth, peak_flops{}, peak_flops_other{},
                                   # efficiency{}, fpga{}, nvlink, pcie, sources{}
    [link.mylink]
    bandwidth = 25e9               # bytes/s per direction
    latency = 5e-6
    source = "..."

  A custom field without its own ``sources.<field>`` gets ``source`` (or "user: defined
  in <file>"). Without ``base`` a custom device needs ``kind`` and every figure.

Default link between two devices with none given: cpu-cpu -> ``loopback``; two GPUs
pinned to the same placement -> ``same_device``; two GPUs of the same model -> that
model's NVLink generation; anything else -> the slower of the two devices' PCIe links
(v100/u200/u250/u280/vu9p Gen3 x16, a100 Gen4 x16, h100/h200 Gen5 x16).
"""

from __future__ import annotations

import copy
import functools
import math
import os
import re
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Mapping, Sequence

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

KINDS = ("cpu", "gpu", "fpga")
GPU_DTYPES = ("fp32", "tf32", "fp16", "bf16")
FPGA_DTYPES = GPU_DTYPES + ("fixed16", "int8")
EFFICIENCY_KEYS = ("matmul", "other", "memory")
SOURCE_PREFIXES = ("datasheet:", "derived:", "assumption:", "tool:", "host:", "measured:", "user:")
DEFAULT_LINK_RULES = (
    "cpu <-> cpu: loopback",
    "gpu <-> gpu pinned to the same placement: same_device",
    "gpu <-> gpu of the same model: that model's NVLink generation",
    "anything else: the slower of the two devices' PCIe links (pcie3x16 if neither names one)",
)
_DTYPE_ALIASES = {
    "float32": "fp32", "float": "fp32", "f32": "fp32",
    "float16": "fp16", "half": "fp16", "f16": "fp16",
    "bfloat16": "bf16", "tensorfloat32": "tf32",
    "fixed": "fixed16", "int16": "fixed16", "qint8": "int8",
}
_TOKEN = re.compile(r"^(?:(?P<count>\d+)\s*[xX]\s*)?(?P<name>[A-Za-z_][\w\-.]*)"
                    r"(?:@(?P<place>[\w.:\-/]+))?$")
_MAX_REPEAT = 1024


class DeviceSpecError(ValueError):
    """A bad ``--devices`` spec, cluster file or custom definition (one-line message)."""


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


@dataclass(frozen=True)
class Cluster:
    """Devices in pipeline order (stage i runs on device i) and the full link matrix."""

    devices: tuple[Device, ...]
    links: tuple[tuple[Link | None, ...], ...]

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


@dataclass(frozen=True)
class Catalog:
    """Resolved catalog: ``devices`` name -> entry dict, ``links`` name -> Link.

    Entries are plain dicts; treat them as read-only (``load_catalog`` is cached).
    """

    devices: dict[str, dict]
    links: dict[str, Link]
    efficiency: dict[str, dict]
    fpga_macs_per_dsp: dict[str, Any]
    raw_devices: dict[str, dict] = field(repr=False, default_factory=dict)

    def device(self, name: str, placement: str | None = None) -> Device:
        e = self.devices[name]
        return Device(name=name, kind=e["kind"], placement=placement,
                      memory_bytes=e["memory_bytes"], mem_bandwidth=e["mem_bandwidth"],
                      peak_flops=dict(e["peak_flops"]), efficiency=dict(e["efficiency"]),
                      sources=dict(e["sources"]),
                      fpga=copy.deepcopy(e["fpga"]) if e["fpga"] else None,
                      peak_flops_other=dict(e["peak_flops_other"]),
                      description=e["description"])

    def default_link(self, a: Device, b: Device) -> Link:
        """The link assumed between ``a`` and ``b`` when none is given (module docstring)."""
        if a.kind == "cpu" and b.kind == "cpu":
            return self.links["loopback"]
        ea, eb = self.devices.get(a.name, {}), self.devices.get(b.name, {})
        if a.kind == "gpu" and b.kind == "gpu":
            if a.placement is not None and a.placement == b.placement:
                return self.links["same_device"]
            if ea.get("model") == eb.get("model") and ea.get("nvlink"):
                return self.links[ea["nvlink"]]
        pcie = [self.links[e["pcie"]] for e in (ea, eb) if e.get("pcie")]
        if not pcie:
            return self.links["pcie3x16"]
        return min(pcie, key=lambda link: link.bandwidth)

    def extended(self, devices: Mapping[str, dict], links: Mapping[str, dict],
                 origin: str) -> Catalog:
        """A new catalog with custom ``[device.*]``/``[link.*]`` definitions added."""
        new_links = dict(self.links)
        for name, raw in links.items():
            new_links[name.lower()] = _make_link(name.lower(), raw, f"user: defined in {origin}", origin)
        raw_devices = dict(self.raw_devices)
        for name, raw in devices.items():
            raw_devices[name.lower()] = _custom_raw(name.lower(), raw, raw_devices, origin)
        return _resolve(raw_devices, new_links, self.efficiency, self.fpga_macs_per_dsp, origin)

    def with_measured_cpu(self, measured: Mapping[str, float]) -> Catalog:
        """Replace the ``cpu`` figures (and ``shm`` bandwidth) by :func:`measure_cpu` results."""
        flops, bw = float(measured["fp32_flops"]), float(measured["mem_bandwidth"])
        note = f"measured: this machine by measure_cpu() ({measured.get('threads', '?')} threads)"
        raw = copy.deepcopy(self.raw_devices)
        cpu = raw["cpu"]
        cpu["peak_flops"] = {d: flops for d in GPU_DTYPES}
        cpu["peak_flops_other"] = {d: flops for d in GPU_DTYPES}
        cpu["mem_bandwidth"] = bw
        cpu["efficiency"] = {"matmul": 1.0, "memory": 1.0}
        cpu["sources"].update({
            "peak_flops": f"{note}: achieved 512x512 fp32 torch.mm rate, so efficiency.matmul = 1",
            "peak_flops_other": f"{note}: same achieved rate; efficiency.other keeps the cpu default",
            "mem_bandwidth": f"{note}: achieved tensor copy (read + write bytes), so efficiency.memory = 1",
            "efficiency.matmul": f"{note}: the peak is already an achieved figure",
            "efficiency.memory": f"{note}: the bandwidth is already an achieved figure"})
        links = dict(self.links)
        links["shm"] = Link("shm", bw / 2, self.links["shm"].latency,
                            f"{note}: one memcpy = half the read+write copy bandwidth; "
                            "latency as stated before")
        return _resolve(raw, links, self.efficiency, self.fpga_macs_per_dsp, "measure_cpu")


# ---------------------------------------------------------------------------------------
# Loading and resolving the catalog

@functools.lru_cache(maxsize=1)
def load_catalog() -> Catalog:
    """The built-in catalog (cached); CPU memory is this machine's RAM."""
    text = resources.files("pipecc.targets").joinpath("data/devices.toml").read_text(encoding="utf-8")
    data = tomllib.loads(text)
    links = {name: _make_link(name, raw, None, "devices.toml")
             for name, raw in data["link"].items()}
    efficiency = {}
    for kind in KINDS:
        eff = dict(data["efficiency"][kind])
        sources = eff.pop("sources")
        efficiency[kind] = {"values": {k: float(eff[k]) for k in EFFICIENCY_KEYS},
                            "sources": {k: sources[k] for k in EFFICIENCY_KEYS}}
    macs = dict(data["fpga_macs_per_dsp"])
    macs_sources = macs.pop("sources")
    fpga_macs = {"values": {k: float(v) for k, v in macs.items()}, "sources": macs_sources}
    raw = {name: dict(entry, model=name) for name, entry in data["device"].items()}
    return _resolve(raw, links, efficiency, fpga_macs, "devices.toml")


def _host_memory_bytes() -> tuple[float, str]:
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


def _make_link(name: str, raw: Mapping[str, Any], default_source: str | None, origin: str) -> Link:
    try:
        bandwidth, latency = float(raw["bandwidth"]), float(raw["latency"])
    except (KeyError, TypeError, ValueError):
        raise DeviceSpecError(f"link '{name}' in {origin} needs numeric bandwidth (bytes/s "
                              "per direction) and latency (s)") from None
    if not bandwidth > 0 or not latency >= 0 or math.isinf(latency):
        raise DeviceSpecError(f"link '{name}' in {origin} needs bandwidth > 0 and latency >= 0")
    source = raw.get("source") or default_source
    if not source:
        raise DeviceSpecError(f"link '{name}' in {origin} has no source")
    return Link(name, bandwidth, latency, str(source))


_MERGED_TABLES = ("peak_flops", "peak_flops_other", "efficiency", "fpga")
_CUSTOM_KEYS = {"base", "kind", "description", "memory_bytes", "mem_bandwidth", "nvlink",
                "pcie", "source", "sources", *_MERGED_TABLES}


def _custom_raw(name: str, raw: Mapping[str, Any], known: Mapping[str, dict], origin: str) -> dict:
    """Merge a cluster-file ``[device.NAME]`` table onto its ``base`` (if any)."""
    if not isinstance(raw, Mapping):
        raise DeviceSpecError(f"[device.{name}] in {origin} must be a table")
    unknown = sorted(set(raw) - _CUSTOM_KEYS)
    if unknown:
        raise DeviceSpecError(f"[device.{name}] in {origin} has unknown key(s) {', '.join(unknown)}; "
                              f"allowed: {', '.join(sorted(_CUSTOM_KEYS))}")
    user_source = str(raw.get("source") or f"user: defined in {origin}")
    if "base" in raw:
        base = str(raw["base"]).lower()
        if base not in known:
            raise DeviceSpecError(f"[device.{name}] in {origin}: unknown base '{base}'; "
                                  f"known: {', '.join(sorted(known))}")
        out = copy.deepcopy(known[base])
    else:
        out = {"model": name, "sources": {}}
    out["sources"] = dict(out.get("sources", {}))
    for key, value in raw.items():
        if key in ("base", "source", "sources"):
            continue
        if key in _MERGED_TABLES and isinstance(value, Mapping):
            out[key] = {**out.get(key, {}), **value}
            if key == "efficiency":
                out["sources"].update({f"efficiency.{k}": user_source for k in value})
            elif key == "fpga":
                out["sources"].update({k: user_source for k in value})
            else:
                out["sources"][key] = user_source
        else:
            out[key] = value
            out["sources"]["link" if key in ("nvlink", "pcie") else key] = user_source
    out["sources"].update(raw.get("sources", {}))
    out.setdefault("description", f"custom device from {origin}")
    return out


def _resolve(raw_devices: Mapping[str, dict], links: dict[str, Link], efficiency: dict,
             fpga_macs: dict, origin: str) -> Catalog:
    devices = {name: _resolve_device(name, raw, links, efficiency, fpga_macs, origin)
               for name, raw in raw_devices.items()}
    return Catalog(devices=devices, links=links, efficiency=efficiency,
                   fpga_macs_per_dsp=fpga_macs, raw_devices=dict(raw_devices))


def _positive(name: str, key: str, value: Any, origin: str) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        x = float("nan")
    if not (x > 0 and math.isfinite(x)):
        raise DeviceSpecError(f"device '{name}' in {origin}: {key} must be a positive number, got {value!r}")
    return x


def _resolve_device(name: str, raw: Mapping[str, Any], links: Mapping[str, Link],
                    efficiency: Mapping[str, dict], fpga_macs: Mapping[str, dict], origin: str) -> dict:
    """Raw TOML table -> entry with every figure and a source for each."""
    kind = raw.get("kind")
    if kind not in KINDS:
        raise DeviceSpecError(f"device '{name}' in {origin}: kind must be one of "
                              f"{', '.join(KINDS)} (or give base = 'a100'), got {kind!r}")
    sources = {k: str(v) for k, v in raw.get("sources", {}).items()}
    for key in ("memory_bytes", "mem_bandwidth"):
        if key not in raw:
            raise DeviceSpecError(f"device '{name}' in {origin} lacks {key}; "
                                  "give it or set base = '<catalog device>'")
    memory = raw["memory_bytes"]
    if memory == "host":
        memory, note = _host_memory_bytes()
        if note:
            sources["memory_bytes"] = note
    entry: dict[str, Any] = {
        "kind": kind, "model": raw.get("model", name),
        "description": str(raw.get("description", "")),
        "memory_bytes": _positive(name, "memory_bytes", memory, origin),
        "mem_bandwidth": _positive(name, "mem_bandwidth", raw["mem_bandwidth"], origin),
        "nvlink": raw.get("nvlink"), "pcie": raw.get("pcie"), "fpga": None,
    }
    for key in ("nvlink", "pcie"):
        if entry[key] is not None and entry[key] not in links:
            raise DeviceSpecError(f"device '{name}' in {origin}: {key} = '{entry[key]}' is not a "
                                  f"known link; known: {', '.join(sorted(links))}")
    if kind == "fpga":
        entry["fpga"], entry["peak_flops"] = _resolve_fpga(name, raw, sources, fpga_macs, origin)
        entry["peak_flops_other"] = dict(entry["peak_flops"])
        sources.setdefault("peak_flops_other", "derived: same DSP-derived peak as peak_flops; "
                           "efficiency.other accounts for LUT-built non-MAC layers")
    else:
        for table in ("peak_flops", "peak_flops_other"):
            values = dict(raw.get(table, {}))
            if table == "peak_flops_other" and not values:
                values = dict(entry["peak_flops"])
                sources.setdefault(table, sources.get("peak_flops", ""))
            missing = [d for d in GPU_DTYPES if d not in values]
            if missing:
                raise DeviceSpecError(f"device '{name}' in {origin}: {table} lacks "
                                      f"{', '.join(missing)}; give all of {', '.join(GPU_DTYPES)}")
            entry[table] = {d: _positive(name, f"{table}.{d}", v, origin) for d, v in values.items()}
    eff_default = efficiency[kind]
    eff = {**eff_default["values"], **raw.get("efficiency", {})}
    entry["efficiency"] = {}
    for key in EFFICIENCY_KEYS:
        value = _positive(name, f"efficiency.{key}", eff[key], origin)
        if value > 1:
            raise DeviceSpecError(f"device '{name}' in {origin}: efficiency.{key} "
                                  f"must be in (0, 1], got {value}")
        entry["efficiency"][key] = value
        sources.setdefault(f"efficiency.{key}", eff_default["sources"][key])
    required = ["memory_bytes", "mem_bandwidth", "peak_flops", "peak_flops_other"]
    required += [f"efficiency.{k}" for k in EFFICIENCY_KEYS]
    if entry["nvlink"] or entry["pcie"]:
        required.append("link")
    missing = [k for k in required if not sources.get(k)]
    if missing:
        raise DeviceSpecError(f"device '{name}' in {origin} has no source for {', '.join(missing)}")
    entry["sources"] = sources
    return entry


def _resolve_fpga(name: str, raw: Mapping[str, Any], sources: dict, fpga_macs: Mapping[str, dict],
                  origin: str) -> tuple[dict, dict]:
    fpga = dict(raw.get("fpga", {}))
    if "peak_flops" in raw:
        raise DeviceSpecError(f"device '{name}' in {origin}: an fpga's peak_flops is computed "
                              "from fpga.dsp, fpga.clock_hz and fpga.macs_per_dsp; set those instead")
    for key in ("dsp", "bram18", "uram", "clock_hz"):
        if key not in fpga:
            raise DeviceSpecError(f"fpga device '{name}' in {origin} lacks fpga.{key}")
        fpga[key] = _positive(name, f"fpga.{key}", fpga[key], origin)
        if key != "clock_hz":
            fpga[key] = int(fpga[key])
    fpga.setdefault("part", "unknown")
    macs = {**fpga_macs["values"], **fpga.get("macs_per_dsp", {})}
    fpga["macs_per_dsp"] = {d: _positive(name, f"macs_per_dsp.{d}", macs[d], origin) for d in FPGA_DTYPES}
    for d in FPGA_DTYPES:
        sources.setdefault(f"macs_per_dsp.{d}", fpga_macs["sources"][d])
    peak = {d: 2.0 * fpga["macs_per_dsp"][d] * fpga["dsp"] * fpga["clock_hz"] for d in FPGA_DTYPES}
    sources.setdefault("peak_flops", f"derived: 2 x macs_per_dsp[dtype] x {fpga['dsp']} DSP x "
                       f"{fpga['clock_hz'] / 1e6:g} MHz (see macs_per_dsp.*)")
    for key in ("dsp", "bram18", "uram", "clock_hz", "part", "link"):
        if not sources.get(key):
            raise DeviceSpecError(f"fpga device '{name}' in {origin} has no source for {key}")
    return fpga, peak


# ---------------------------------------------------------------------------------------
# Spec parsing

def parse_devices(spec: str | Sequence[str], catalog: Catalog | None = None) -> Cluster:
    """``"2xa100,v100@cuda:2"``, a list of such strings, or ``"@cluster.toml"`` -> Cluster."""
    catalog = catalog or load_catalog()
    tokens = _tokens(spec)
    if any(t.startswith("@") for t in tokens):
        if len(tokens) != 1:
            raise DeviceSpecError("a cluster file (@FILE.toml) must be the whole --devices spec, "
                                  f"got {', '.join(tokens)}")
        return _load_cluster_file(Path(tokens[0][1:]), catalog)
    devices = [d for t in tokens for d in _expand(t, catalog, "--devices")]
    return _cluster(devices, None, catalog, "--devices")


def _tokens(spec: str | Sequence[str]) -> list[str]:
    parts = [spec] if isinstance(spec, str) else list(spec)
    if not all(isinstance(p, str) for p in parts):
        raise DeviceSpecError(f"--devices takes a string or a list of strings, got {spec!r}")
    joined = ",".join(parts)
    if not joined.strip():
        raise DeviceSpecError("empty --devices spec; give e.g. 'cpu,cpu', '2xa100' or "
                              "'@cluster.toml' (see `pipecc devices`)")
    tokens = [t.strip() for t in joined.split(",")]
    if "" in tokens:
        raise DeviceSpecError(f"empty entry in --devices '{joined}'; remove the extra comma")
    return tokens


def _expand(token: str, catalog: Catalog, where: str) -> list[Device]:
    m = _TOKEN.match(token)
    if not m:
        raise DeviceSpecError(f"cannot parse device '{token}' in {where}; expected NAME, NxNAME "
                              "or NAME@PLACE (e.g. 4xa100, a100@cuda:1)")
    count = int(m["count"]) if m["count"] else 1
    if not 1 <= count <= _MAX_REPEAT:
        raise DeviceSpecError(f"bad repeat count {m['count']} in '{token}' in {where}; "
                              f"use 1..{_MAX_REPEAT}, e.g. 4xa100")
    name = m["name"].lower()
    if name not in catalog.devices:
        hint = ", or define it under [device.NAME]" if where != "--devices" else ""
        raise DeviceSpecError(f"unknown device '{m['name']}' in {where}; known: "
                              f"{', '.join(catalog.devices)} (see `pipecc devices`{hint})")
    return [catalog.device(name, m["place"]) for _ in range(count)]


def _cluster(devices: list[Device], given: list[list[Link | None]] | None,
             catalog: Catalog, where: str) -> Cluster:
    n = len(devices)
    if n == 0:
        raise DeviceSpecError(f"no devices in {where}")
    links = [[None if i == j else (given[i][j] if given and given[i][j] else
                                   catalog.default_link(devices[i], devices[j]))
              for j in range(n)] for i in range(n)]
    return Cluster(tuple(devices), tuple(tuple(row) for row in links))


def _load_cluster_file(path: Path, catalog: Catalog) -> Cluster:
    where = f"cluster file {path}"
    if not path.is_file():
        raise DeviceSpecError(f"{where} not found (from --devices @{path}); give an existing .toml path")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise DeviceSpecError(f"{where} is not valid TOML: {e}") from None
    unknown = sorted(set(data) - {"devices", "links", "link_matrix", "device", "link"})
    if unknown:
        raise DeviceSpecError(f"{where} has unknown key(s) {', '.join(unknown)}; allowed: "
                              "devices, links, link_matrix, [device.NAME], [link.NAME]")
    if "device" in data or "link" in data:
        catalog = catalog.extended(data.get("device", {}), data.get("link", {}), str(path))
    names = data.get("devices")
    if not isinstance(names, list) or not names or not all(isinstance(x, str) for x in names):
        raise DeviceSpecError(f"{where} needs devices = [\"NAME\", ...] (a non-empty list of strings)")
    devices = [d for token in _tokens(names) for d in _expand(token, catalog, where)]
    n = len(devices)
    if "links" in data and "link_matrix" in data:
        raise DeviceSpecError(f"{where} gives both links and link_matrix; keep one")
    given: list[list[Link | None]] = [[None] * n for _ in range(n)]
    if "links" in data:
        names_ = _link_names(data["links"], where, "links")
        if len(names_) != n - 1:
            raise DeviceSpecError(f"{where}: links has {len(names_)} entries but {n} devices need "
                                  f"{n - 1} (one per consecutive pair; \"\" = default)")
        for i, lname in enumerate(names_):
            given[i][i + 1] = given[i + 1][i] = _lookup_link(lname, catalog, where)
    elif "link_matrix" in data:
        rows = data["link_matrix"]
        if not isinstance(rows, list) or len(rows) != n:
            raise DeviceSpecError(f"{where}: link_matrix must have {n} rows (one per device)")
        for i, row in enumerate(rows):
            row = _link_names(row, where, f"link_matrix row {i}")
            if len(row) != n:
                raise DeviceSpecError(f"{where}: link_matrix row {i} has {len(row)} entries, need {n}")
            for j, lname in enumerate(row):
                if i == j:
                    if lname not in ("", "-"):
                        raise DeviceSpecError(f"{where}: link_matrix diagonal [{i}][{i}] must be \"\"")
                    continue
                given[i][j] = _lookup_link(lname, catalog, where)
    return _cluster(devices, given, catalog, where)


def _link_names(value: Any, where: str, what: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise DeviceSpecError(f"{where}: {what} must be a list of link names (strings)")
    return [x.strip().lower() for x in value]


def _lookup_link(name: str, catalog: Catalog, where: str) -> Link | None:
    if name in ("", "default"):
        return None
    if name not in catalog.links:
        raise DeviceSpecError(f"unknown link '{name}' in {where}; known: "
                              f"{', '.join(catalog.links)} (or define it under [link.NAME])")
    return catalog.links[name]


# ---------------------------------------------------------------------------------------
# Measuring this machine

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


# ---------------------------------------------------------------------------------------
# Presenting the catalog

def _si(x: float, unit: str) -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.4g} {prefix}{unit}"
    if 0 < abs(x) < 1e-3:
        return f"{x * 1e6:.4g} u{unit}"
    return f"{x:.4g} {unit}"


def format_catalog(catalog: Catalog | None = None) -> str:
    """Human-readable catalog for ``pipecc devices``: every figure and every source."""
    catalog = catalog or load_catalog()
    out = ["Devices (peak FLOP/s dense, no efficiency applied; matmul peak / non-matmul peak)", ""]
    header = f"{'name':8} {'kind':5} {'memory':>10} {'mem bw':>12}  " + "  ".join(
        f"{d:>17}" for d in GPU_DTYPES) + "  eff matmul/other/memory"
    out += [header, "-" * len(header)]
    for name, e in catalog.devices.items():
        peaks = "  ".join(f"{_si(e['peak_flops'][d], 'F'):>8}/{_si(e['peak_flops_other'][d], 'F'):>8}"
                          for d in GPU_DTYPES)
        eff = "/".join(f"{e['efficiency'][k]:g}" for k in EFFICIENCY_KEYS)
        out.append(f"{name:8} {e['kind']:5} {_si(e['memory_bytes'], 'B'):>10} "
                   f"{_si(e['mem_bandwidth'], 'B/s'):>12}  {peaks}  {eff}")
    fpgas = {n: e for n, e in catalog.devices.items() if e["fpga"]}
    if fpgas:
        out += ["", "FPGA resources (peak = 2 x MACs/DSP x DSP x clock)", ""]
        out.append(f"{'name':8} {'part':24} {'DSP':>6} {'BRAM18':>7} {'URAM':>5} {'clock':>9}  "
                   f"{'fixed16 peak':>13} {'int8 peak':>11}")
        for name, e in fpgas.items():
            f = e["fpga"]
            out.append(f"{name:8} {f['part']:24} {f['dsp']:>6} {f['bram18']:>7} {f['uram']:>5} "
                       f"{_si(f['clock_hz'], 'Hz'):>9}  {_si(e['peak_flops']['fixed16'], 'F'):>13} "
                       f"{_si(e['peak_flops']['int8'], 'F'):>11}")
    out += ["", "Device descriptions and sources", ""]
    for name, e in catalog.devices.items():
        out.append(f"{name}: {e['description']}")
        out += [f"    {key}: {src}" for key, src in e["sources"].items()]
    out += ["", "Links (bandwidth per direction)", ""]
    out.append(f"{'name':12} {'bandwidth':>12} {'latency':>9}  source")
    for name, link in catalog.links.items():
        out.append(f"{name:12} {_si(link.bandwidth, 'B/s'):>12} {_si(link.latency, 's'):>9}  {link.source}")
    out += ["", "Default efficiency per kind (achievable fraction of peak)", ""]
    for kind, eff in catalog.efficiency.items():
        for key in EFFICIENCY_KEYS:
            out.append(f"{kind:5} {key:7} {eff['values'][key]:<5g} {eff['sources'][key]}")
    out += ["", "Default link between consecutive devices when none is given", ""]
    out += [f"    {rule}" for rule in DEFAULT_LINK_RULES]
    return "\n".join(out) + "\n"


def catalog_json(catalog: Catalog | None = None) -> dict:
    """The catalog as a JSON-able dict (same content as :func:`format_catalog`)."""
    catalog = catalog or load_catalog()
    devices = {}
    for name, e in catalog.devices.items():
        d = copy.deepcopy(e)
        d.pop("model", None)
        devices[name] = d
    return {"source_prefixes": list(SOURCE_PREFIXES), "devices": devices,
            "links": {n: link.to_json() for n, link in catalog.links.items()},
            "efficiency": copy.deepcopy(catalog.efficiency),
            "fpga_macs_per_dsp": copy.deepcopy(catalog.fpga_macs_per_dsp),
            "default_link_rules": list(DEFAULT_LINK_RULES)}
