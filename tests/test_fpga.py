"""FPGA backend: beat packing agrees between Python and C++, generated stages C-simulate to the
torch output (float and fixed point), the threaded simulator finds a too-small FIFO, the
unsupported-op error, FpgaStageModule inside a CPU pipeline, and estimates.json == fpga_model.

g++ builds take seconds: each stage is written and built once per module (fixtures)."""
from __future__ import annotations

import copy
import ctypes
import json
import math
import re
import subprocess

import numpy as np
import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from pipecc.targets import fpga_model
from pipecc.backends.fpga import (SUPPORTED_KINDS, FpgaStageModule, UnsupportedOpError, csim,
                                  pack, supported, toolchain_problem, write_fpga_stage)
from pipecc.backends.fpga.csim import CXXFLAGS, find_ap_types, find_compiler
from pipecc.targets.devices import load_catalog
from pipecc.driver import analyze_module
from pipecc.ir.graph import META_NAME, META_OP
from pipecc.models import mlp, tiny_cnn, vgg16

pytestmark = pytest.mark.xdist_group(name="fpga")
PROBLEM = toolchain_problem()
needs_gxx = pytest.mark.skipif(PROBLEM is not None, reason=f"FPGA C simulation: {PROBLEM}")
HOSTILE = 'evil */ "name" \\\n#define X 1; {mod.path}/ünïcode'


def zoo_graph(mod, batch: int = 2):
    torch.manual_seed(0)
    model = mod.build_model(**mod.TINY).eval()
    x = mod.example_inputs(batch, **mod.TINY)
    return model, x[0], analyze_module(model, x, debug=True)


def slice_stage(gm: fx.GraphModule, first: str, last: str) -> fx.GraphModule:
    """The contiguous nodes first..last (by META_NAME) as a one-input, one-output stage."""
    nodes = list(gm.graph.nodes)
    names = [n.meta.get(META_NAME) for n in nodes]
    chosen = nodes[names.index(first): names.index(last) + 1]
    (ext,) = {a for n in chosen for a in n.all_input_nodes if a not in chosen}
    g = fx.Graph()
    env = {ext: g.placeholder("x")}
    env[ext].meta = copy.copy(ext.meta)
    for n in chosen:
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(env[chosen[-1]])
    return fx.GraphModule(gm, g)


class Kitchen(nn.Module):
    """Every template the zoo does not reach: stride/groups conv, standalone BN, relu6, both
    GELUs, padded max/avg pool, concat, fan-out of the input and of a middle tensor,
    adaptive pooling by an exact divisor."""

    def __init__(self) -> None:
        super().__init__()
        self.conv_a = nn.Conv2d(4, 8, 3, stride=2, padding=1, groups=2)
        self.bn = nn.BatchNorm2d(8)
        self.conv_b = nn.Conv2d(4, 8, 1)
        self.mp = nn.MaxPool2d(3, stride=2, padding=1)
        self.ap = nn.AvgPool2d(3, stride=1, padding=1)
        self.adapt = nn.AdaptiveAvgPool2d(2)
        self.fc = nn.Linear(64, 6)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.running_var.uniform_(0.5, 2.0)
            self.bn.weight.uniform_(0.5, 1.5)
            self.bn.bias.uniform_(-0.2, 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.bn(F.relu6(self.conv_a(x)))
        b = self.mp(F.gelu(self.conv_b(x)))
        y = torch.cat([a, b], 1)
        y = F.gelu(self.ap(y) + y, approximate="tanh")
        return self.fc(torch.flatten(self.adapt(y), 1))


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def cnn(tmp_path_factory):
    _, x, graph = zoo_graph(tiny_cnn)
    return graph, x, write_fpga_stage(tmp_path_factory.mktemp("cnn"), graph.gm, x, "u250")


@pytest.fixture(scope="module")
def vgg(tmp_path_factory):
    model, x, graph = zoo_graph(vgg16)
    stage = slice_stage(graph.gm, "features.0", "features.30")
    return model, x, graph, stage, write_fpga_stage(tmp_path_factory.mktemp("vgg"), stage, x,
                                                    "u250", stage_index=1)


@pytest.fixture(scope="module")
def kitchen_graph():
    torch.manual_seed(1)
    x = torch.randn(2, 4, 8, 8)
    graph = analyze_module(Kitchen().eval(), (x,), debug=True)
    for n in graph.gm.graph.nodes:  # names from module paths / ONNX may contain anything
        if n.op != "output":
            n.meta[META_NAME] = f"{HOSTILE} {n.name}"
    return graph, x


# ----------------------------------------------------------------------------- packing
PACK_MAIN = r"""
#include <cstdio>
#include <vector>
#include "pack.h"
template <class T> void run(unsigned n, const char* beats_in, const char* vals_out,
                            const char* vals_in, const char* beats_out) {
  const unsigned W = 512 / 64, nb = (n * pipecc::raw_bits<T>::width + 511) / 512;
  std::vector<uint64_t> words(nb * W); std::vector<float> v(n);
  FILE* f = std::fopen(beats_in, "rb"); std::fread(words.data(), 8, words.size(), f); std::fclose(f);
  hls::stream<ap_uint<512> > beats; hls::stream<T> vals;
  for (unsigned b = 0; b < nb; b++) beats.write(pipecc::beat_from_words<512>(&words[b * W]));
  pipecc::unpack_frame<T, 37, 512>(beats, vals);
  for (unsigned i = 0; i < n; i++) v[i] = pipecc::to_float(vals.read());
  f = std::fopen(vals_out, "wb"); std::fwrite(v.data(), 4, n, f); std::fclose(f);
  f = std::fopen(vals_in, "rb"); std::fread(v.data(), 4, n, f); std::fclose(f);
  for (unsigned i = 0; i < n; i++) vals.write(T(v[i]));
  pipecc::pack_frame<T, 37, 512>(vals, beats);
  for (unsigned b = 0; b < nb; b++) pipecc::beat_to_words<512>(beats.read(), &words[b * W]);
  f = std::fopen(beats_out, "wb"); std::fwrite(words.data(), 8, words.size(), f); std::fclose(f);
}
int main(int argc, char** argv) {
  if (argv[1][0] == 'f') run<float>(37, argv[2], argv[3], argv[4], argv[5]);
  else run<ap_fixed<18, 8, AP_RND_CONV, AP_SAT> >(37, argv[2], argv[3], argv[4], argv[5]);
  return 0;
}
"""


def test_beats_are_ceil_division():
    assert pack.beats_for(37, 32) == 3 and pack.beats_for(37, 18) == 2
    assert pack.beats_for(16, 32) == 1 and pack.beats_for(17, 32) == 2 and pack.beats_for(0, 32) == 0
    v = np.linspace(-3, 3, 37).astype(np.float32)
    for number in ("float", "ap_fixed<18,8>", "ap_fixed<16,6>"):
        words = pack.pack(v, number)
        assert words.shape == (pack.beats_for(37, fpga_model.parse_number(number).bits), 8)
        np.testing.assert_array_equal(pack.unpack(words, 37, number), pack.quantize(v, number))


@needs_gxx
def test_pack_round_trip_python_cpp(tmp_path):
    from pipecc.backends.fpga.codegen import TEMPLATES
    (tmp_path / "main.cpp").write_text(PACK_MAIN)
    (tmp_path / "inc").mkdir()
    (tmp_path / "inc" / "hls_stream.h").write_text((TEMPLATES / "hls_stream.h").read_text())
    exe = tmp_path / "roundtrip"
    subprocess.run([find_compiler(), *CXXFLAGS, "-pthread", f"-I{tmp_path / 'inc'}",
                    f"-I{TEMPLATES}", f"-I{find_ap_types()}", str(tmp_path / "main.cpp"),
                    "-o", str(exe)], check=True, capture_output=True)
    rng = np.random.default_rng(0)
    for number, flag in (("float", "f"), ("ap_fixed<18,8>", "x")):
        v = (rng.standard_normal(37) * 20).astype(np.float32)
        v[-1] = 99.0  # the last element lives in the tail beat (37*32 and 37*18 bits)
        pack.pack(v, number).tofile(tmp_path / "py_beats.bin")
        v.tofile(tmp_path / "py_vals.bin")
        subprocess.run([str(exe), flag, *(str(tmp_path / f) for f in
                        ("py_beats.bin", "cpp_vals.bin", "py_vals.bin", "cpp_beats.bin"))], check=True)
        cpp_vals = np.fromfile(tmp_path / "cpp_vals.bin", dtype=np.float32)
        cpp_beats = np.fromfile(tmp_path / "cpp_beats.bin", dtype="<u8").reshape(-1, 8)
        np.testing.assert_array_equal(cpp_vals, pack.quantize(v, number))  # C++ unpacked Python's
        np.testing.assert_array_equal(cpp_beats, pack.pack(v, number))     # identical beats
        np.testing.assert_array_equal(pack.unpack(cpp_beats, 37, number), pack.quantize(v, number))
        assert cpp_vals[-1] == pytest.approx(99.0)


# ----------------------------------------------------------------------------- C simulation
def _check_layout(stage_dir, top: str) -> None:
    for rel in (f"firmware/{top}.cpp", f"firmware/{top}.h", "firmware/defines.h",
                "firmware/parameters.h", f"tb/{top}_tb.cpp", "tb_data/input.bin",
                "tb_data/output.bin", "run_hls.tcl", "estimates.json"):
        assert (stage_dir / rel).is_file(), rel
    assert list((stage_dir / "firmware" / "weights").glob("*.h"))
    assert list((stage_dir / "firmware" / "weights").glob("*.bin"))
    src = (stage_dir / "firmware" / f"{top}.cpp").read_text()
    for pragma in ("INTERFACE axis port=in", "INTERFACE axis port=out", "DATAFLOW"):
        assert f"#pragma HLS {pragma}" in src
    layers = (stage_dir / "firmware" / "pipecc_layers.h").read_text()
    assert "PIPELINE II=" in layers and "ARRAY_PARTITION" in layers
    tcl = (stage_dir / "run_hls.tcl").read_text()
    for cmd in ("open_project", "set_top", "add_files", "open_solution", "set_part",
                "create_clock", "csim_design", "csynth_design", "cosim_design", "export_design"):
        assert cmd in tcl
    assert "vitis-run --mode hls --tcl run_hls.tcl" in tcl


def _labelled(path) -> bool:
    lines = path.read_text().splitlines()
    return all(re.match(r"^\s*\w+:\s*$", lines[i - 1]) for i, ln in enumerate(lines)
               if re.match(r"^\s*for \(", ln))


@needs_gxx
def test_tiny_cnn_float_matches_torch(cnn):
    graph, x, stage_dir = cnn
    _check_layout(stage_dir, "pipecc_stage0")
    assert _labelled(stage_dir / "firmware" / "pipecc_layers.h")
    assert _labelled(stage_dir / "firmware" / "pack.h")
    assert "xcu250-figd2104-2L-e" in (stage_dir / "run_hls.tcl").read_text()
    assert "create_clock -period 4 " in (stage_dir / "run_hls.tcl").read_text()
    r = csim(stage_dir)
    assert r.passed and r.max_rel_err <= 1e-5, r.message
    params = (stage_dir / "firmware" / "parameters.h").read_text()
    assert "bn2" in params and "conv2 [conv2d] <- conv2, bn2" in params  # BN folded
    assert "struct config_bn2" not in params and "struct config_conv2 " in params


@needs_gxx
def test_threaded_csim_sizes_fifos_and_finds_deadlock(cnn):
    _, _, stage_dir = cnn
    ok = csim(stage_dir, threaded=True)
    assert ok.passed and not ok.deadlock, ok.message
    skip = [k for k in ok.fifo_occupancy if "clone" in k]
    assert max(ok.fifo_occupancy[k] for k in skip) >= 1000  # the residual skip holds a frame
    planted = {max(skip, key=ok.fifo_occupancy.get): 64}     # too small for a 1024-value frame
    bad = csim(stage_dir, threaded=True, fifo_depth=planted)
    assert bad.deadlock and not bad.passed
    assert "DEADLOCK" in bad.message and re.search(r"fifo \S*clone\S*: 64/64", bad.message)
    assert bad.fifo_depth[next(iter(planted))] == 64


@needs_gxx
def test_mlp_float_matches_torch(tmp_path):
    _, x, graph = zoo_graph(mlp)
    stage_dir = write_fpga_stage(tmp_path, graph.gm, x, "u280")
    top = (stage_dir / "firmware" / "pipecc_stage0.cpp").read_text()
    # layers named after the model's (`4` -> `dense_4`, led by the kind), the name in a comment
    assert re.findall(r"PIPECC_PROCESS\((\w+), .*?(?:  // (\S+))?$", top, flags=re.M) == [
        ("input", ""), ("dense_0", "0"), ("relu_1", "1"), ("dense_2", "2"), ("relu_3", "3"),
        ("dense_4", "4"), ("output", "")]
    assert "pipecc::dense<config_dense_4>(s_relu_3, s_dense_4, w_dense_4, b_dense_4)" in top
    r = csim(stage_dir)
    assert r.passed and r.max_rel_err <= 1e-5, r.message
    print(f"mlp float: max abs err {r.max_abs_err:.3g}, compile {r.compile_s:.1f} s")


@needs_gxx
def test_vgg_block_stack_float_matches_torch(vgg):
    *_, stage_dir = vgg
    r = csim(stage_dir)
    assert r.passed and r.max_rel_err <= 1e-5, r.message


@needs_gxx
def test_all_templates_and_hostile_names_float(kitchen_graph, tmp_path):
    graph, x = kitchen_graph
    stage_dir = write_fpga_stage(tmp_path, graph.gm, x, "vu9p")
    for path in stage_dir.rglob("*"):
        if path.suffix in (".cpp", ".h", ".tcl"):
            text = path.read_text(encoding="ascii")  # raw names would bring non-ASCII
            assert "*/" not in text, path
            for line in text.splitlines():  # names only in // comments (some trail a line)
                code = line.split("//", 1)[0]
                assert "#define X" not in code and '"name"' not in code, (path, line)
    assert _labelled(stage_dir / "firmware" / "pipecc_layers.h")
    r = csim(stage_dir)
    assert r.passed and r.max_rel_err <= 1e-5, r.message
    kinds = {layer["kind"] for layer in json.loads((stage_dir / "stage.json").read_text())["layers"]}
    assert {"conv2d", "scale", "relu6", "gelu", "maxpool2d", "avgpool2d", "adaptive_avgpool2d",
            "add", "concat", "clone", "dense"} <= kinds


@needs_gxx
def test_fixed_point_within_stated_tolerance(kitchen_graph, tmp_path):
    graph, x = kitchen_graph
    stage_dir = write_fpga_stage(tmp_path, graph.gm, x, "u250", "ap_fixed<16,6>")
    meta = json.loads((stage_dir / "stage.json").read_text())
    assert meta["saturation"] == []
    defines = (stage_dir / "firmware" / "defines.h").read_text()
    assert "ap_fixed<16, 6, AP_RND_CONV, AP_SAT>" in defines
    assert "pipecc_gelu_tanh" in (stage_dir / "firmware" / "pipecc_stage0.cpp").read_text()
    r = csim(stage_dir)
    assert r.passed and r.max_abs_err <= r.tolerance, r.message  # the worst-case bound
    assert 0 < r.max_abs_err <= 6 * r.error_sigma                   # and the statistical size
    print(f"ap_fixed<16,6>: err {r.max_abs_err:.3g} bound {r.tolerance:.3g} sigma {r.error_sigma:.3g}")


# ----------------------------------------------------------------------------- errors
class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(4, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


def test_unsupported_op_is_named_and_nothing_is_written(tmp_path):
    model = nn.Sequential(nn.Linear(8, 4), nn.Softmax(dim=-1)).eval()
    x = torch.randn(2, 8)
    graph = analyze_module(model, (x,))
    soft = [n for n in graph.gm.graph.nodes if n.meta.get(META_OP) == "softmax"][0]
    assert not supported(soft) and soft.meta["pipecc.kind"] not in SUPPORTED_KINDS
    with pytest.raises(UnsupportedOpError, match=r"op 'softmax' at node '1'") as info:
        write_fpga_stage(tmp_path, graph.gm, x, "u250")
    assert "\n" not in str(info.value)
    assert not list(tmp_path.iterdir())  # never half a stage
    lstm = analyze_module(Recurrent().eval(), (torch.randn(2, 3, 4),))
    node = [n for n in lstm.gm.graph.nodes if n.meta.get(META_OP) == "lstm"][0]
    assert not supported(node)
    with pytest.raises(UnsupportedOpError, match="lstm"):
        fpga_model.plan_layers(lstm.gm)


# ----------------------------------------------------------------------------- runtime
@needs_gxx
def test_fpga_stage_module_in_a_cpu_pipeline(vgg, cnn):
    model, x, graph, stage, stage_dir = vgg
    fpga = FpgaStageModule(stage_dir)
    rest = nn.Sequential(model.avgpool, nn.Flatten(1), model.classifier)
    with torch.no_grad():
        y = rest(fpga(x))
        ref = model(x)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    xg = x.clone().requires_grad_(True)
    with pytest.raises(RuntimeError, match="inference-only"):
        fpga(xg).sum().backward()
    # packed beats through the C ABI, packed and unpacked by Python
    graph_c, xc, cnn_dir = cnn
    lib = ctypes.CDLL(str(FpgaStageModule(cnn_dir).build.lib))
    words_in = pack.pack(xc[0].numpy(), "float")
    words_out = np.zeros((pack.beats_for(10, 32), 8), dtype="<u8")
    assert lib.run_stage_beats(words_in.ctypes.data_as(ctypes.c_void_p),
                               words_out.ctypes.data_as(ctypes.c_void_p)) == 0
    out = pack.unpack(words_out, 10, "float")
    np.testing.assert_allclose(out, graph_c.gm(xc)[0].detach().numpy(), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- estimates
def test_vgg_estimates_json_matches_fpga_model(vgg):
    _, x, graph, stage, stage_dir = vgg
    est = json.loads((stage_dir / "estimates.json").read_text())
    assert est["source"] == "analytic" and est["card"] == "u250"
    u250 = load_catalog().device("u250")
    for key in ("dsp", "bram18", "lut"):
        assert est["total"][key] == sum(layer[key] for layer in est["layers"])
    assert est["capacity"]["dsp"] == u250.fpga["dsp"] == 11520
    assert est["capacity"]["bram18"] == u250.fpga["bram18"] == 4608
    assert est["fits"] == (est["total"]["dsp"] <= 11520 and est["total"]["bram18"] <= 4608)
    assert est["fits"] and est["total"]["dsp"] <= 0.8 * 11520   # folding stays in budget
    assert est["interval_cycles"] == max(layer["ii_cycles"] for layer in est["layers"])
    for layer in est["layers"]:
        if layer["kind"] in ("dense", "conv2d"):
            assert layer["dsp"] == math.ceil(layer["pe"] * layer["simd"] / 0.2)  # fp32: 5 DSP/MAC
    # the planner's entry points give the same numbers
    again = fpga_model.stage_estimate(fpga_model.plan_layers(stage), "u250", "float")
    assert json.loads(json.dumps(again)) == est
    nodes = [n for n in graph.gm.graph.nodes if str(n.meta.get(META_NAME, "")).startswith("features.")]
    t = fpga_model.stage_time_s(nodes, "u250", "fp32", batch=4, gm=graph.gm, point=graph.point)
    assert t == pytest.approx((est["latency_cycles"] + 3 * est["interval_cycles"]) / 250e6)
    # what the planner sums per unit: the MAC floor never exceeds the stage's real time
    # (the lower bound relies on it), and folding never raises BRAM above the unfolded sum
    per_node = [fpga_model.unit_cycles([n], "u250", "fp32", gm=graph.gm, point=graph.point)
                for n in nodes if n.op != "get_attr"]
    assert 0 < sum(4 * c[2] / c[3] for c in per_node) <= t
    least = sum(c[4] for c in per_node)
    assert est["total"]["bram18"] <= max(least + 2 * 16, 0.8 * 4608)
    print(f"VGG features on u250: {est['total']}, interval {est['interval_cycles']} cycles")
