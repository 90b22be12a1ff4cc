"""The device and link catalog: figures with their sources, loaded and checked.

The catalog is package data (``pipecc/targets/data/devices.toml``): every figure there carries a
source string that starts with ``datasheet:``, ``derived:`` (arithmetic on datasheet
figures), ``assumption:``, ``tool:`` (reported by Vivado/Vitis HLS) or ``host:`` (read
from this machine); ``measured:`` and ``user:`` mark measured CPUs and cluster-file
definitions. ``pipecc devices`` prints it (`pipecc.targets.catalog_format`).

A cluster file's ``[device.NAME]``/``[link.NAME]`` tables extend it (`Catalog.extended`; the
file's syntax is in `pipecc.targets.spec`). `Catalog.with_measured_cpu` replaces the CPU
figures by measured ones (`pipecc.targets.measure`).

Default link between two devices with none given: cpu-cpu -> ``loopback``; two GPUs
pinned to the same placement -> ``same_device``; two GPUs of the same model -> that
model's NVLink generation; anything else -> the slower of the two devices' PCIe links
(v100/u200/u250/u280/vu9p Gen3 x16, a100 Gen4 x16, h100/h200 Gen5 x16).
"""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Mapping

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from pipecc.targets.hardware import (EFFICIENCY_KEYS, FPGA_DTYPES, GPU_DTYPES, KINDS, Device,
                                     Link)
from pipecc.targets.measure import host_memory_bytes

SOURCE_PREFIXES = ("datasheet:", "derived:", "assumption:", "tool:", "host:", "measured:", "user:")
DEFAULT_LINK_RULES = (
    "cpu <-> cpu: loopback",
    "gpu <-> gpu pinned to the same placement: same_device",
    "gpu <-> gpu of the same model: that model's NVLink generation",
    "anything else: the slower of the two devices' PCIe links (pcie3x16 if neither names one)",
)


class DeviceSpecError(ValueError):
    """A bad ``--devices`` spec, cluster file or custom definition (one-line message)."""


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


def _shown(value: Any) -> str:
    """A TOML value in a message, cut short."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _make_link(name: str, raw: Mapping[str, Any], default_source: str | None, origin: str) -> Link:
    if not isinstance(raw, Mapping):
        raise DeviceSpecError(f"[link.{name}] in {origin} must be a table, got {_shown(raw)}")
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
    sources = raw.get("sources", {})
    if not isinstance(sources, Mapping) or not all(isinstance(v, str) for v in sources.values()):
        raise DeviceSpecError(f"[device.{name}] in {origin}: sources must be a table of strings "
                              f"(sources.FIELD = \"datasheet: ...\"), got {_shown(sources)}")
    for key in _MERGED_TABLES:
        if key in raw and not isinstance(raw[key], Mapping):
            raise DeviceSpecError(f"[device.{name}] in {origin}: {key} must be a table "
                                  f"({key}.FIELD = ...), got {_shown(raw[key])}")
    for key in ("base", "kind", "description", "nvlink", "pcie", "source"):
        if key in raw and not isinstance(raw[key], str):
            raise DeviceSpecError(f"[device.{name}] in {origin}: {key} must be a string, "
                                  f"got {_shown(raw[key])}")
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
        memory, note = host_memory_bytes()
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
            if fpga[key] != int(fpga[key]):  # int(0.5) would be 0 DSPs: a division by zero later
                raise DeviceSpecError(f"device '{name}' in {origin}: fpga.{key} counts blocks, a "
                                      f"whole number >= 1, got {fpga[key]:g}")
            fpga[key] = int(fpga[key])
    fpga.setdefault("part", "unknown")
    if not isinstance(fpga.get("macs_per_dsp", {}), Mapping):
        raise DeviceSpecError(f"device '{name}' in {origin}: fpga.macs_per_dsp must be a table "
                              f"(macs_per_dsp.DTYPE = N), got {_shown(fpga['macs_per_dsp'])}")
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

