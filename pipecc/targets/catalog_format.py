"""The catalog for people and programs: `format_catalog` (the text of ``pipecc devices``)
and `catalog_json` (``pipecc devices --json``), every figure with its source."""

from __future__ import annotations

import copy

from pipecc.targets.catalog import DEFAULT_LINK_RULES, SOURCE_PREFIXES, Catalog, load_catalog
from pipecc.targets.hardware import EFFICIENCY_KEYS, GPU_DTYPES


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
