"""Devices, links and the catalog behind ``--devices``: one import for all of it.

    hardware        Device (figures, roofline `compute_time`), Link, Cluster, dtype names
    catalog         Catalog, load_catalog: devices.toml with a source for every figure
    spec            parse_devices: ``--devices`` specs and ``@cluster.toml`` files -> Cluster
    measure         measure_cpu, host memory: figures read from this machine
    catalog_format  format_catalog, catalog_json: what ``pipecc devices`` prints

The names below are re-exported from those modules, so `from pipecc.targets.devices import X`
keeps working for every public name the one-file version of this module had.
"""

from __future__ import annotations

from pipecc.targets.catalog import (DEFAULT_LINK_RULES, SOURCE_PREFIXES, Catalog, DeviceSpecError,
                                    load_catalog)
from pipecc.targets.catalog_format import catalog_json, format_catalog
from pipecc.targets.hardware import (EFFICIENCY_KEYS, FPGA_DTYPES, GPU_DTYPES, KINDS, Cluster,
                                     Device, Link, normalize_dtype)
from pipecc.targets.measure import measure_cpu
from pipecc.targets.spec import parse_devices

__all__ = ["DEFAULT_LINK_RULES", "SOURCE_PREFIXES", "EFFICIENCY_KEYS", "FPGA_DTYPES",
           "GPU_DTYPES", "KINDS", "Catalog", "Cluster", "Device", "DeviceSpecError", "Link",
           "catalog_json", "format_catalog", "load_catalog", "measure_cpu", "normalize_dtype",
           "parse_devices"]
