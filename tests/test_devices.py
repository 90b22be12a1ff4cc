"""Tests for pipecc.targets.devices: catalog completeness, spec parsing, time model, formatting."""

from __future__ import annotations

import json
import math
import time

import pytest

from pipecc.targets import devices as dv
from pipecc.targets.devices import DeviceSpecError, Link, load_catalog, parse_devices

BUILTIN = ("cpu", "v100", "a100", "h100", "h200", "u200", "u250", "u280", "vu9p")
LINKS = ("nvlink2", "nvlink3", "nvlink4", "pcie3x16", "pcie4x16", "pcie5x16",
         "ib_hdr", "ib_ndr", "eth100", "loopback", "shm")


# --- catalog -----------------------------------------------------------------------------

def test_catalog_has_every_builtin_with_kind():
    cat = load_catalog()
    kinds = {n: cat.devices[n]["kind"] for n in BUILTIN}
    assert kinds == {"cpu": "cpu", "v100": "gpu", "a100": "gpu", "h100": "gpu", "h200": "gpu",
                     "u200": "fpga", "u250": "fpga", "u280": "fpga", "vu9p": "fpga"}
    assert set(LINKS) <= set(cat.links)


@pytest.mark.parametrize("name", BUILTIN)
def test_every_device_has_all_figures_and_sources(name):
    d = load_catalog().device(name)
    assert d.memory_bytes > 0 and d.mem_bandwidth > 0
    dtypes = dv.FPGA_DTYPES if d.kind == "fpga" else dv.GPU_DTYPES
    for dt in dtypes:
        assert d.peak(dt) > 0 and d.peak(dt, matmul=False) > 0
    assert set(d.efficiency) == set(dv.EFFICIENCY_KEYS)
    assert all(0 < v <= 1 for v in d.efficiency.values())
    required = ["memory_bytes", "mem_bandwidth", "peak_flops", "peak_flops_other",
                "efficiency.matmul", "efficiency.other", "efficiency.memory"]
    if d.kind != "cpu":
        required.append("link")
    if d.kind == "fpga":
        required += ["dsp", "bram18", "uram", "clock_hz", "part"]
        required += [f"macs_per_dsp.{dt}" for dt in dv.FPGA_DTYPES]
        assert {"dsp", "bram18", "uram", "clock_hz", "part", "macs_per_dsp"} <= set(d.fpga)
    else:
        assert d.fpga is None
    for key in required:
        assert d.sources.get(key, "").strip(), f"{name}: no source for {key}"
    for key, src in d.sources.items():
        assert src.startswith(dv.SOURCE_PREFIXES), f"{name}.{key}: unmarked source {src!r}"


def test_every_link_has_figures_and_marked_source():
    for name, link in load_catalog().links.items():
        assert link.name == name and link.bandwidth > 0 and link.latency >= 0
        assert link.source.startswith(dv.SOURCE_PREFIXES)


def test_datasheet_figures():
    cat = load_catalog()
    a100, h100, h200, v100 = (cat.device(n) for n in ("a100", "h100", "h200", "v100"))
    assert a100.peak_flops == {"fp32": 19.5e12, "tf32": 156e12, "fp16": 312e12, "bf16": 312e12}
    assert a100.mem_bandwidth == 2039e9 and a100.memory_bytes == 80e9
    # dense, not the "with sparsity" figures
    assert h100.peak("bf16") == 989.5e12 and h100.peak("tf32") == 494.5e12
    assert h200.peak_flops == h100.peak_flops and h200.mem_bandwidth == 4.8e12
    assert h200.memory_bytes == 141e9
    assert v100.peak("fp16") == 125e12 and v100.peak("fp32") == 15.7e12
    assert cat.links["nvlink3"].bandwidth == 300e9  # 600 GB/s total -> per direction
    assert cat.links["ib_hdr"].bandwidth == 25e9


def test_cpu_memory_is_this_machines_ram():
    cpu = load_catalog().device("cpu")
    assert cpu.memory_bytes > 1e8
    assert cpu.sources["memory_bytes"].startswith(("host:", "assumption:"))


# --- time model --------------------------------------------------------------------------

def _toy(**kw) -> dv.Device:
    base = dict(name="toy", kind="gpu", placement=None, memory_bytes=1e9, mem_bandwidth=100.0,
                peak_flops={"fp32": 1000.0}, efficiency={"matmul": 0.5, "other": 0.25, "memory": 0.5},
                sources={}, fpga=None, peak_flops_other={"fp32": 200.0})
    base.update(kw)
    return dv.Device(**base)


def test_roofline_compute_bound():
    d = _toy()
    # matmul 1000 / (1000*0.5) = 2 s; other 100 / (200*0.25) = 2 s; memory 10/(100*0.5) = 0.2 s
    assert d.compute_time(1100, 1000, 10) == pytest.approx(4.0)


def test_roofline_memory_bound():
    d = _toy()
    # compute 100/(1000*0.5) = 0.2 s; memory 1000/(100*0.5) = 20 s
    assert d.compute_time(100, 100, 1000) == pytest.approx(20.0)


def test_roofline_edge_cases():
    d = _toy()
    assert d.compute_time(0, 0, 0) == 0.0
    # flops_matmul larger than flops (rounding elsewhere): other part clamps to zero
    assert d.compute_time(10, 20, 0) == pytest.approx(20 / 500)
    assert d.compute_time(1000, 1000, 0, dtype="float32") == d.compute_time(1000, 1000, 0)
    with pytest.raises(ValueError, match="no peak for dtype"):
        d.compute_time(1, 1, 0, dtype="int8")
    with pytest.raises(ValueError):
        d.compute_time(-1, 0, 0)


def test_gpu_fp32_uses_cuda_cores_tf32_uses_tensor_cores():
    a100 = load_catalog().device("a100")
    t32 = a100.compute_time(1e12, 1e12, 0, "fp32")
    ttf = a100.compute_time(1e12, 1e12, 0, "tf32")
    assert t32 == pytest.approx(1e12 / (19.5e12 * 0.7))
    assert ttf == pytest.approx(1e12 / (156e12 * 0.7))


def test_fpga_peak_formula():
    cat = load_catalog()
    for name in ("u200", "u250", "u280", "vu9p"):
        d = cat.device(name)
        f = d.fpga
        for dt in dv.FPGA_DTYPES:
            formula = 2 * f["macs_per_dsp"][dt] * f["dsp"] * f["clock_hz"]
            assert d.peak_flops[dt] == pytest.approx(formula)
            assert d.attainable_flops(dt) == pytest.approx(formula * d.efficiency["matmul"])
    u250 = cat.device("u250")
    assert u250.fpga["dsp"] == 11520 and u250.fpga["part"] == "xcu250-figd2104-2L-e"
    assert u250.peak("fixed16") == pytest.approx(2 * 1 * 11520 * 250e6)
    assert u250.peak("int8") == pytest.approx(2 * u250.peak("fixed16") / 2 * 2)
    assert u250.peak("fp32") < u250.peak("fixed16")  # an fp32 MAC costs several DSPs


def test_link_time():
    link = Link("l", bandwidth=1e9, latency=1e-6, source="assumption: test")
    assert link.time(0) == 0.0
    assert link.time(1e9) == pytest.approx(1.0 + 1e-6)
    assert link.time(1) == pytest.approx(1e-6 + 1e-9)
    with pytest.raises(ValueError):
        link.time(-1)


# --- spec parsing ------------------------------------------------------------------------

def test_parse_repeats_placements_and_default_links():
    cl = parse_devices("2xa100, V100@cuda:2,u250,cpu,cpu")
    assert [d.name for d in cl.devices] == ["a100", "a100", "v100", "u250", "cpu", "cpu"]
    assert [d.placement for d in cl.devices] == [None, None, "cuda:2", None, None, None]
    assert [cl.link(i, i + 1).name for i in range(5)] == [
        "nvlink3", "pcie3x16", "pcie3x16", "pcie3x16", "loopback"]
    assert cl.link(1, 0).name == "nvlink3"
    assert all(cl.links[i][i] is None for i in range(len(cl)))
    with pytest.raises(ValueError):
        cl.link(0, 0)


def test_parse_mixed_gpus_use_slower_pcie_and_same_placement_is_free():
    cl = parse_devices("a100,h100,h100")
    assert cl.link(0, 1).name == "pcie4x16" and cl.link(1, 2).name == "nvlink4"
    cl = parse_devices("2xa100@cuda:0")
    assert [d.placement for d in cl.devices] == ["cuda:0", "cuda:0"]
    assert cl.link(0, 1).name == "same_device" and cl.link(0, 1).time(1e9) < 1e-6


def test_parse_list_of_strings_equals_comma_spec():
    a = parse_devices(["cpu@cpu", "2xa100"])
    b = parse_devices("cpu@cpu,2xa100")
    assert a == b and len(a) == 3
    assert hash(a.devices[1]) == hash(b.devices[1])


def _write(tmp_path, text):
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return path


def test_cluster_file_consecutive_links(tmp_path):
    path = _write(tmp_path, """
devices = ["2xa100", "v100@cuda:2", "u250"]
links = ["nvlink3", "pcie4x16", ""]
""")
    cl = parse_devices(f"@{path}")
    assert [d.name for d in cl.devices] == ["a100", "a100", "v100", "u250"]
    assert [cl.link(i, i + 1).name for i in range(3)] == ["nvlink3", "pcie4x16", "pcie3x16"]
    assert cl.link(0, 3).name == "pcie3x16"  # non-consecutive pair: default rule


def test_cluster_file_matrix_custom_device_and_link(tmp_path):
    path = _write(tmp_path, """
devices = ["mygpu", "a100", "cpu"]
link_matrix = [["", "mylink", "pcie4x16"],
               ["nvlink3", "", ""],
               ["eth100", "pcie4x16", ""]]
[device.mygpu]
base = "a100"
memory_bytes = 40e9
efficiency = { matmul = 0.9 }
source = "user: A100 40GB"
[link.mylink]
bandwidth = 25e9
latency = 5e-6
source = "user: test link"
""")
    cl = parse_devices(f"@{path}")
    my = cl.devices[0]
    assert my.name == "mygpu" and my.kind == "gpu" and my.memory_bytes == 40e9
    assert my.peak_flops == load_catalog().device("a100").peak_flops
    assert my.efficiency["matmul"] == 0.9 and my.sources["memory_bytes"] == "user: A100 40GB"
    assert cl.link(0, 1).name == "mylink" and cl.link(0, 1).bandwidth == 25e9
    assert cl.link(1, 0).name == "nvlink3"
    assert cl.link(1, 2).name == "pcie4x16"  # "" -> default rule (cpu <-> a100 PCIe)
    assert cl.link(2, 0).name == "eth100"
    # the built-in catalog is untouched by a cluster file
    assert "mygpu" not in load_catalog().devices


def test_cluster_file_custom_fpga_recomputes_peak(tmp_path):
    path = _write(tmp_path, """
devices = ["slowu250"]
[device.slowu250]
base = "u250"
fpga = { clock_hz = 200e6 }
""")
    d = parse_devices(f"@{path}").devices[0]
    assert d.peak("fixed16") == pytest.approx(2 * 11520 * 200e6)
    assert d.sources["clock_hz"].startswith("user:")


@pytest.mark.parametrize("spec, match", [
    ("a10", r"unknown device 'a10' in --devices; known: cpu, v100, .*\(see `pipecc devices`\)"),
    ("", "empty --devices spec"),
    ("  ", "empty --devices spec"),
    ([], "empty --devices spec"),
    ("cpu,,cpu", "empty entry"),
    ("0xa100", "bad repeat count 0"),
    ("5000xa100", "bad repeat count 5000"),
    ("-1xa100", "cannot parse device '-1xa100'"),
    ("a100@", "cannot parse device"),
    ("@/nonexistent/cluster.toml", "not found"),
    ("@a.toml,cpu", "must be the whole --devices spec"),
])
def test_spec_errors(spec, match):
    with pytest.raises(DeviceSpecError, match=match) as info:
        parse_devices(spec)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("text, match", [
    ("devices = [", "not valid TOML"),
    ('devices = ["cpu", "cpu"]\nlinks = ["loopback", "shm"]', "links has 2 entries but 2 devices need 1"),
    ('devices = ["cpu", "cpu"]\nlinks = ["warp"]', "unknown link 'warp'"),
    ('devices = ["cpu", "x"]', r"unknown device 'x' in cluster file .*define it under \[device.NAME\]"),
    ('devices = []', "non-empty list"),
    ('device_list = ["cpu"]', "unknown key"),
    ('devices = ["cpu", "cpu"]\nlink_matrix = [["", "shm"]]', "link_matrix must have 2 rows"),
    ('devices = ["cpu", "cpu"]\nlinks = [""]\nlink_matrix = [["", ""], ["", ""]]',
     "both links and link_matrix"),
    ('devices = ["g"]\n[device.g]\nkind = "gpu"', "lacks memory_bytes"),
    ('devices = ["g"]\n[device.g]\nbase = "nope"', "unknown base 'nope'"),
    ('devices = ["g"]\n[device.g]\nbase = "a100"\nefficiency = { matmul = 2.0 }',
     r"efficiency.matmul must be in \(0, 1\]"),
    ('devices = ["cpu"]\n[link.l]\nbandwidth = 0\nlatency = 0', "bandwidth > 0"),
])
def test_cluster_file_errors(tmp_path, text, match):
    path = _write(tmp_path, text)
    with pytest.raises(DeviceSpecError, match=match) as info:
        parse_devices(f"@{path}")
    assert "\n" not in str(info.value)


# --- presentation and measurement --------------------------------------------------------

def test_format_catalog_mentions_every_device_link_and_source():
    cat = load_catalog()
    text = dv.format_catalog(cat)
    for name, entry in cat.devices.items():
        assert name in text and entry["description"] in text
        for src in entry["sources"].values():
            assert src in text
    for name, link in cat.links.items():
        assert name in text and link.source in text
    for eff in cat.efficiency.values():
        for src in eff["sources"].values():
            assert src in text


def test_catalog_json_is_strict_json_and_complete():
    data = dv.catalog_json()
    text = json.dumps(data, allow_nan=False)
    assert set(BUILTIN) <= set(data["devices"]) and set(LINKS) <= set(data["links"])
    assert json.loads(text)["devices"]["a100"]["peak_flops"]["bf16"] == 312e12


def test_cluster_to_json():
    data = parse_devices("cpu,cpu").to_json()
    assert [d["kind"] for d in data["devices"]] == ["cpu", "cpu"]
    assert data["links"] == [[None, "loopback"], ["loopback", None]]
    json.dumps(data, allow_nan=False)


def test_measure_cpu_is_fast_and_feeds_the_catalog():
    import torch  # noqa: F401  -- the import itself is not part of the measurement budget

    t0 = time.perf_counter()
    m = dv.measure_cpu()
    took = time.perf_counter() - t0
    # a fixed, small workload (~0.1 s on a quiet machine, returned as "seconds"); the
    # bound catches a workload grown by orders of magnitude, never load (issue 21)
    assert 0 < m["seconds"] <= took < 30.0
    assert m["fp32_flops"] > 1e8 and m["mem_bandwidth"] > 1e8
    cat = load_catalog().with_measured_cpu(m)
    cpu = parse_devices("cpu", cat).devices[0]
    assert cpu.peak("fp32") == m["fp32_flops"] and cpu.efficiency["matmul"] == 1.0
    assert cpu.sources["peak_flops"].startswith("measured:")
    assert math.isclose(cat.links["shm"].bandwidth, m["mem_bandwidth"] / 2)
    assert load_catalog().device("cpu").peak("fp32") == 160e9  # cached catalog untouched
