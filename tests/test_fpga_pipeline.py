"""FPGA stages in a real pipeline: `compile` writes `stage_<i>/hls/` for a stage planned on an
FPGA card, `pipecc csim OUT` C-simulates it against the torch stage, and `pipecc.load(OUT)` /
`pipecc.compile(...)` run a mixed cpu,u250,cpu pipeline whose FPGA stage goes through the
C simulation (inference-only: a backward raises). Unsupported ops and multi-tensor stage
boundaries on an FPGA give one-line errors.

Model: the zoo MLP at in=64, hidden=256, depth=6, batch 2, planned with training=False. At
this size the analytic cost model puts a Linear(256, 256) + ReLU on the u250 (at the TINY
size it gives the FPGA only a ReLU; tiny_cnn gets only a flatten or a lone BatchNorm).
g++ builds take ~10 s each: the compiled folder is built once (module fixture), the drop-in
once more.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import pipecc
from helpers import ROOT
from pipecc import cli, driver
from pipecc.cli import csim as csim_cmd
from pipecc.backends.base import Target
from pipecc.backends.fpga import toolchain_problem
from pipecc.backends.fpga.backend import FpgaBackend
from pipecc.backends.fpga.pipeline import FpgaPipelineStage, check_boundary
from pipecc.backends.torch import cut_stages, write_output
from pipecc.errors import PipeccError
from pipecc.targets.fpga_model import UnsupportedOpError
from pipecc.ir.graph import META_OP
from pipecc.models import mlp
from pipecc.ir.plan import Plan, StagePlan

pytestmark = pytest.mark.xdist_group(name="fpga")
PROBLEM = toolchain_problem()
needs_gxx = pytest.mark.skipif(PROBLEM is not None, reason=f"FPGA C simulation: {PROBLEM}")

KW = dict(in_features=64, hidden=256, depth=6, num_classes=10)
BATCH = 2
DEVICES = "cpu,u250,cpu"
MODEL_ARGS = [f"--model-arg={k}={v}" for k, v in KW.items()]


def _csim(*args: str) -> int:
    """`pipecc csim ...` in-process: through the CLI once it knows the command."""
    known = "csim_cmd" in Path(cli.__file__).read_text()
    return cli.main(["csim", *args]) if known else csim_cmd.main(list(args))


def compile_out(out: Path) -> None:
    rc = cli.main(["compile", str(ROOT / "models" / "mlp.py"), "-b", str(BATCH), "--inference",
                   "--devices", DEVICES, "--use-all-devices", "-o", str(out), "-q", *MODEL_ARGS])
    assert rc == 0


def reference_model(state: dict) -> nn.Module:
    model = mlp.build_model(**KW).eval()
    model.load_state_dict(state)
    return model


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("fpga_pipeline") / "out"
    compile_out(folder)
    return folder


# ----------------------------------------------------------------------------- compile output
def test_plan_puts_a_linear_on_the_fpga(out):
    plan = Plan.from_json(json.loads((out / "plan.json").read_text()))
    assert plan.fpga_stages() == {1: "u250"}
    marker = json.loads((out / "pipecc.json").read_text())
    assert marker["inference_only"] is True and marker["fpga_stages"]["1"]["card"] == "u250"
    hls = out / "stage_1" / "hls"
    meta = json.loads((hls / "stage.json").read_text())
    assert "dense" in {layer["kind"] for layer in meta["layers"]}, meta["layers"]
    top = meta["top"]
    for rel in (f"firmware/{top}.cpp", f"firmware/{top}.h", "firmware/defines.h",
                "firmware/parameters.h", f"tb/{top}_tb.cpp", "tb_data/input.bin",
                "tb_data/output.bin", "run_hls.tcl", "estimates.json"):
        assert (hls / rel).is_file(), rel
    assert list((hls / "firmware" / "weights").glob("*.h"))
    est = json.loads((hls / "estimates.json").read_text())
    assert est["source"] == "analytic"
    # plan and estimates agree: the planner re-costs FPGA stages with the same model
    mb = plan.batch_size // plan.microbatches
    assert plan.stages[1].forward_s == pytest.approx(
        (est["latency_cycles"] + (mb - 1) * est["interval_cycles"]) / est["clock_hz"], rel=1e-9)
    assert (out / "stage_1" / "stage.py").is_file()  # the torch stage stays: weights, reference
    assert not (out / "stage_0" / "hls").exists() and not (out / "stage_2" / "hls").exists()


@needs_gxx
def test_csim_command_float_and_threaded(out, capsys):
    assert _csim(str(out)) == 0
    text = capsys.readouterr().out
    row = next(ln for ln in text.splitlines() if ln.startswith("1 "))
    assert "u250" in row and "float" in row and "pass" in row
    rel = float(row.split()[4])
    assert rel <= 1e-5
    assert "saved torch stage re-run: agrees" in text
    print(text)
    assert _csim(str(out), "--stage", "1", "--threaded") == 0
    text = capsys.readouterr().out
    occ = next(ln for ln in text.splitlines() if "FIFO occupancy" in ln)
    assert "/2" in occ and "cached" in text  # the threaded run reuses the build
    print(text)


@needs_gxx
def test_csim_command_failures(out, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)  # csim_build comes along: the build is cached by content
    golden = bad / "stage_1" / "hls" / "tb_data" / "output.bin"
    values = np.fromfile(golden, dtype=np.float32)
    values[0] += 1.0
    values.tofile(golden)
    assert _csim(str(bad)) == 1
    captured = capsys.readouterr()
    assert "FAIL" in captured.out
    assert captured.err.startswith("pipecc: error: C simulation failed: stage 1")
    assert captured.err.count("\n") == 1


def test_csim_command_without_fpga_stages(tmp_path, capsys):
    analysis = driver.analyze(ROOT / "models" / "mlp.py", model_args=mlp.TINY, batch_size=2)
    plan, graph = driver.plan(analysis, "cpu,cpu", training=False)
    stages = cut_stages(graph, plan.stage_of())
    target = Target(example_inputs=analysis.spec.example_inputs)
    FpgaBackend().check(graph, plan, stages, target)  # nothing to check without FPGA stages
    assert FpgaBackend().writers(graph, plan, stages, target) == []
    assert FpgaBackend().notes(plan) == []
    write_output(tmp_path / "cpu", graph, plan, stages)
    assert _csim(str(tmp_path / "cpu")) == 1
    err = capsys.readouterr().err
    assert "has no FPGA stages" in err and err.count("\n") == 1


# ----------------------------------------------------------------------------- mixed runs
@needs_gxx
def test_load_runs_the_mixed_pipeline(out):
    pm = pipecc.load(out)
    stages = pm.pipeline_info()["stages"]
    assert isinstance(stages[1], FpgaPipelineStage) and not isinstance(stages[0], FpgaPipelineStage)
    assert pm.inference_only and pm.fpga_stages == {1: "u250"}
    model = reference_model(pm.state_dict())  # the state_dict keys are the model's
    x = mlp.example_inputs(5, **KW)[0]        # another batch size than compiled
    with torch.no_grad():
        y, ref = pm(x), model(x)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    print(f"pipecc.load mixed {DEVICES}: max abs err {float((y - ref).abs().max()):.3g}")
    with pytest.raises(RuntimeError, match="inference-only"):
        pm(x).sum().backward()


@needs_gxx
def test_dropin_compile_runs_the_mixed_pipeline(tmp_path):
    torch.manual_seed(0)
    model = mlp.build_model(**KW).eval()
    x = mlp.example_inputs(BATCH, **KW)
    pm = pipecc.compile(model, x, DEVICES, training=False, fpga_dir=tmp_path / "hls")
    assert pm.fpga_stages == {1: "u250"}
    assert (tmp_path / "hls" / "stage_1" / "hls" / "firmware").is_dir()
    assert isinstance(pm.pipeline_info()["stages"][1], FpgaPipelineStage)
    assert set(pm.state_dict()) == set(model.state_dict())
    with torch.no_grad():
        y, ref = pm(*x), model(*x)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    print(f"pipecc.compile mixed {DEVICES}: max abs err {float((y - ref).abs().max()):.3g}")
    with pytest.raises(RuntimeError, match="inference-only"):
        pm(*x).sum().backward()


# ----------------------------------------------------------------------------- errors
SOFTMAX_MLP = """
import torch
from torch import nn
def build_model(**_):
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.Softmax(dim=-1))
def example_inputs(batch_size=1, **_):
    return (torch.randn(batch_size, 8, generator=torch.Generator().manual_seed(0)),)
"""


def test_unsupported_op_on_an_fpga_is_one_line_exit_1(tmp_path, capsys):
    model_file = tmp_path / "softmax_mlp.py"
    model_file.write_text(SOFTMAX_MLP)
    rc = cli.main(["compile", str(model_file), "--devices", "u250", "--inference",
                   "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("pipecc: error:") and err.count("\n") == 1
    assert "softmax" in err and "u250" in err
    assert not (tmp_path / "out").exists()


def _fpga_plan(stages, devices: list[str]) -> Plan:
    kinds = {"cpu": "cpu", "u250": "fpga"}
    return Plan(model="m", batch_size=2, microbatches=1, schedule="inference",
                devices=[{"name": d, "kind": kinds[d]} for d in devices],
                stages=[StagePlan(s.index, s.index, list(s.nodes)) for s in stages],
                split_layers=[], bottleneck_s=1.0, lower_bound_s=1.0,
                predicted_iteration_s=1.0, bubble_fraction=0.0)


def test_forced_softmax_on_an_fpga_stage_writes_nothing(tmp_path):
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.Softmax(dim=-1)).eval()
    x = (torch.randn(2, 8),)
    graph = driver.analyze_module(model, x)
    names = [n.meta["pipecc.name"] for n in graph.compute_nodes() if n.op != "get_attr"]
    stage_of = {name: (0 if i < 2 else 1) for i, name in enumerate(names)}  # cpu | u250
    stages = cut_stages(graph, stage_of)
    assert any(n.meta.get(META_OP) == "softmax" for n in stages[1].gm.graph.nodes)
    plan = _fpga_plan(stages, ["cpu", "u250"])
    FpgaBackend().check(graph, plan, stages, Target(example_inputs=x))  # softmax: found on writing
    writers = FpgaBackend().writers(graph, plan, stages, Target(example_inputs=x))
    with pytest.raises(UnsupportedOpError, match="softmax") as info:
        write_output(tmp_path / "out", graph, plan, stages, writers=writers)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if ".pipecc-" in p.name]


class Skip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        return self.c(self.b(h) + h)


def test_fpga_stage_boundary_must_be_one_tensor():
    graph = driver.analyze_module(Skip().eval(), (torch.randn(2, 8),))
    order = [n.meta["pipecc.name"] for n in graph.compute_nodes() if n.op != "get_attr"]
    cut = order.index("b")  # stage 1 = b (h is relayed past it), stage 2 = add, c
    stage_of = {name: 0 if i < cut else (1 if i == cut else 2) for i, name in enumerate(order)}
    stages = cut_stages(graph, stage_of)
    plan = _fpga_plan(stages, ["cpu", "u250", "cpu"])
    with pytest.raises(PipeccError, match=r"FPGA stage 1 \(u250\): the FPGA stage boundary "
                       r"must be a single float32 tensor.*sends \['relu' \(tensor float32\), "
                       r"'b' \(tensor float32\)\]"):
        FpgaBackend().check(graph, plan, stages, Target(example_inputs=(torch.randn(2, 8),)))
    check_boundary(stages[0], "cpu")  # one tensor in, one out: fine


def test_an_edited_or_added_hls_source_is_refused(out, tmp_path, capsys):
    """Issue 33 (trust): an FPGA stage's HLS project is hashed with the folder and checked before
    the C simulation builds it (it was the one part of a folder run unchecked)."""
    from pipecc.errors import PipeccError
    marker = json.loads((out / "pipecc.json").read_text())
    assert any("/hls/firmware/" in rel for rel in marker["sha256"])
    edited = tmp_path / "edited"
    shutil.copytree(out, edited, ignore=shutil.ignore_patterns("csim_build"))
    source = next((edited / "stage_1" / "hls" / "firmware").glob("*.cpp"))
    source.write_text(source.read_text() + "\n// planted\n")
    with pytest.raises(PipeccError, match="not the file the compile wrote"):
        pipecc.load(edited)
    added = tmp_path / "added"
    shutil.copytree(out, added, ignore=shutil.ignore_patterns("csim_build"))
    (added / "stage_1" / "hls" / "firmware" / "planted.h").write_text("#error planted\n")
    with pytest.raises(PipeccError, match="is not among the files"):
        pipecc.load(added)
    if PROBLEM is None:  # `pipecc csim` checks the sources it builds too
        capsys.readouterr()
        assert _csim(str(edited)) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "not the file the compile wrote" in err, err
