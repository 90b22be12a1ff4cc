"""``--devices`` specs and cluster files -> `Cluster` (devices from `pipecc.targets.catalog`).

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
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Sequence

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from pipecc.targets.catalog import Catalog, DeviceSpecError, load_catalog
from pipecc.targets.hardware import Cluster, Device, Link, LinkTable

_TOKEN = re.compile(r"^(?:(?P<count>\d+)\s*[xX]\s*)?(?P<name>[A-Za-z_][\w\-.]*)"
                    r"(?:@(?P<place>[\w.:\-/]+))?$")
_MAX_REPEAT = 1024


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
    return [catalog.device(name, m["place"])] * count  # one frozen Device, repeated


def _cluster(devices: list[Device], given: dict[tuple[int, int], Link] | None,
             catalog: Catalog, where: str) -> Cluster:
    """Devices and their links; pairs not given take the catalog's default, computed when asked
    for (`LinkTable`: no n x n table in memory for a long --devices list)."""
    if not devices:
        raise DeviceSpecError(f"no devices in {where}")
    frozen = tuple(devices)
    return Cluster(frozen, LinkTable(frozen, given or {}, catalog.default_link))


def _load_cluster_file(path: Path, catalog: Catalog) -> Cluster:
    where = f"cluster file {path}"
    if not path.is_file():
        raise DeviceSpecError(f"{where} not found (from --devices @{path}); give an existing .toml path")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise DeviceSpecError(f"{where} is not valid TOML: {e}") from None
    except RecursionError:  # tomllib parses nested arrays and tables recursively
        raise DeviceSpecError(f"{where} nests arrays or tables too deeply to read; a cluster file "
                              "needs two levels at most (link_matrix)") from None
    unknown = sorted(set(data) - {"devices", "links", "link_matrix", "device", "link"})
    if unknown:
        raise DeviceSpecError(f"{where} has unknown key(s) {', '.join(unknown)}; allowed: "
                              "devices, links, link_matrix, [device.NAME], [link.NAME]")
    for table in ("device", "link"):
        value = data.get(table, {})
        if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
            raise DeviceSpecError(f"{where}: {table} must be tables [{table}.NAME] of fields, "
                                  f"got {table} = {_shown(value)}")
    if "device" in data or "link" in data:
        catalog = catalog.extended(data.get("device", {}), data.get("link", {}), str(path))
    names = data.get("devices")
    if not isinstance(names, list) or not names or not all(isinstance(x, str) for x in names):
        raise DeviceSpecError(f"{where} needs devices = [\"NAME\", ...] (a non-empty list of strings)")
    devices = [d for token in _tokens(names) for d in _expand(token, catalog, where)]
    n = len(devices)
    if "links" in data and "link_matrix" in data:
        raise DeviceSpecError(f"{where} gives both links and link_matrix; keep one")
    given: dict[tuple[int, int], Link] = {}
    if "links" in data:
        names_ = _link_names(data["links"], where, "links")
        if len(names_) != n - 1:
            raise DeviceSpecError(f"{where}: links has {len(names_)} entries but {n} devices need "
                                  f"{n - 1} (one per consecutive pair; \"\" = default)")
        for i, lname in enumerate(names_):
            link = _lookup_link(lname, catalog, where)
            if link is not None:
                given[i, i + 1] = given[i + 1, i] = link
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
                link = _lookup_link(lname, catalog, where)
                if link is not None:
                    given[i, j] = link
    return _cluster(devices, given, catalog, where)


def _shown(value: Any) -> str:
    """A TOML value in a message, cut short (it may be a 100 kB list)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


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

