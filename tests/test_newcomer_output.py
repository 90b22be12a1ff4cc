"""The newcomer's list (issue 30): what pipecc prints, read by a person who follows the README.

`print(pm)` of an interleaved plan counts each device once; `pipecc plan` fits 100 columns, writes
its decisions in one unit scale, says BPipe once (and advises turning off nothing that is not on),
and names where its times come from (roofline, profile, calibration), as compile's summary and
report.html do; compile says when it used fewer devices than given; a folder planned for GPUs that
runs on the CPU says so; `pipecc profile` explains and flags its fit error; `pipecc cost` prints
no `warning: note:`; a replicated BatchNorm plan warns that each replica normalises its own slice.
These tests check what the lines say, not their exact layout (except the 100-column rule)."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import pipecc
from helpers import pipecc_here, run_cli
from pipecc import driver
from pipecc.report.figures import cost_basis
from pipecc.report.formatting import WIDTH, seconds_in_text, wrap
from pipecc.report.text import plan_table

RAW_SECONDS = re.compile(r"\b0\.\d+ s\b|\d+e-\d+ s\b")  # how the planner's decisions write seconds


class LongNames(nn.Module):
    """Module paths as long as a library's (`encoder.layers.0.self_attention...`)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder_with_a_long_name = nn.ModuleList(
            nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(4))
        self.classification_head_projection = nn.Linear(64, 10)

    def forward(self, x):
        for block in self.encoder_with_a_long_name:
            x = x + block(x)
        return self.classification_head_projection(x)


def _mlp_file(tmp_path: Path, body: str = "nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)") -> Path:
    path = tmp_path / "tiny.py"
    path.write_text(f"""import torch
from torch import nn
def build_model():
    torch.manual_seed(0)
    return nn.Sequential({body})
def example_inputs(batch_size=1):
    return (torch.randn(batch_size, 8),)
def example_target(batch_size=1):
    return torch.randint(0, 4, (batch_size,))
def loss_fn(o, t):
    return nn.functional.cross_entropy(o, t)
""")
    return path


# ----------------------------------------------------------------------------- the Python API
def test_print_of_an_interleaved_module_counts_each_device_once(one_thread) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(6)], nn.Linear(64, 10))
    pm = pipecc.compile(model, (torch.randn(16, 64),), "cpu,cpu", microbatches=2, schedule="interleaved")
    assert len(pm.plan.stages) == 4 and pm.plan.virtual_stages == 2
    text = repr(pm)
    assert "stages=4 (2 per device)" in text and "devices=[cpu, cpu]" in text, text
    assert "cpu, cpu, cpu" not in text


# ----------------------------------------------------------------------------- pipecc plan
@pytest.fixture(scope="module")
def wide_plan():
    graph = driver.analyze_module(LongNames(), (torch.randn(8, 64),))
    plan, _ = driver.plan(graph, "2xa100,2xv100", replicas=2, microbatches=1,
                          activation_balancing="auto")  # the CLI's default: BPipe is weighed
    return plan


def test_plan_table_fits_100_columns_and_keeps_every_node_range(wide_plan) -> None:
    text = plan_table(wide_plan, verbose=True)
    assert all(len(line) <= WIDTH for line in text.splitlines()), max(text.splitlines(), key=len)
    for stage in wide_plan.stages:  # the node range of each stage is still shown, on a line of its own
        assert f"first node {stage.nodes[0]}; last node {stage.nodes[-1]}" in " ".join(text.split()), stage.nodes
    assert "split layers" not in text.split("\n\n")[1] or wide_plan.split_layers  # the column only when used


def test_plan_decisions_use_one_unit_scale_and_say_bpipe_once(wide_plan) -> None:
    text = plan_table(wide_plan, verbose=True)
    assert any(RAW_SECONDS.search(d) for d in wide_plan.decisions)  # plan.json keeps seconds
    assert not RAW_SECONDS.search(text), text
    assert any(d.startswith("BPipe") for d in wide_plan.decisions)
    assert sum(line.lstrip().startswith("BPipe") for line in text.splitlines()) == 1, text
    assert seconds_in_text("predicted 0.002631 s per iteration vs 1.2e-05 s") == \
        "predicted 2.63 ms per iteration vs 12 µs"


def test_bpipe_weighed_by_default_advises_turning_off_nothing() -> None:
    graph = driver.analyze_module(LongNames(), (torch.randn(8, 64),))
    plan, _ = driver.plan(graph, "2xcpu", activation_balancing="auto", schedule="zb-h1", microbatches=2)
    line = next(d for d in plan.decisions if d.startswith("BPipe"))
    assert "not considered" in line and "--activation-balancing off" not in line, line
    assert "--activation-balancing off" not in plan_table(plan, verbose=True)


def test_every_view_names_where_its_times_come_from(wide_plan) -> None:
    assert "times           predicted from the roofline of the devices' datasheet figures" in \
        plan_table(wide_plan)
    profiled = dataclasses.replace(wide_plan, options={**wide_plan.options, "profile": "prof.json"})
    assert cost_basis(profiled).startswith("the profile prof.json (per-node times measured")
    calibrated = dataclasses.replace(wide_plan, options={**wide_plan.options, "calibration": {"source": "run.json"}})
    assert cost_basis(calibrated).startswith("calibrated from the run run.json")
    assert "times predicted from the roofline" in " ".join(wide_plan.summary_text().split())


def test_inspect_fits_100_columns_names_its_basis_and_says_bpipe_once(tmp_path, capsys) -> None:
    out = tmp_path / "out"
    code, _, err = run_cli(["compile", str(_mlp_file(tmp_path)), "-b", "8", "--devices", "2xa100",
                            "-o", str(out), "-q"], capsys)
    assert code == 0, err
    code, text, err = run_cli(["inspect", str(out), "-v"], capsys)
    assert code == 0, err
    assert all(len(line) <= WIDTH for line in text.splitlines() if str(out) not in line), text  # paths aside
    joined = " ".join(text.split())
    assert "times predicted from the roofline of the devices' datasheet figures" in joined
    assert sum(line.lstrip().startswith("BPipe") for line in text.splitlines()) <= 1, text
    assert not RAW_SECONDS.search(text), text


def test_wrap_keeps_units_and_commands_whole() -> None:
    lines = wrap("x" * 90 + " 328 µs and `pipecc profile` here", indent=4, width=100)
    assert lines[1].startswith("    328 µs") or "328 µs" in lines[0]
    assert all("`pipecc profile`" in ln or "`" not in ln for ln in lines), lines


# ----------------------------------------------------------------------------- pipecc compile
def test_compile_says_it_used_fewer_devices_and_what_it_predicts(tmp_path, capsys) -> None:
    out = tmp_path / "out"
    code, stdout, err = run_cli(["compile", str(_mlp_file(tmp_path)), "-b", "8", "--devices", "2xcpu",
                                 "--replicas", "1", "-o", str(out)], capsys)
    assert code == 0, err
    text = " ".join(stdout.split())
    assert "uses 1 of the 2 devices given" in text and "--use-all-devices" in text, stdout
    assert re.search(r"predicted \S+ \S?s per iteration, from the roofline of the devices' datasheet figures", text)
    html = (out / "report.html").read_text()
    assert "samples per second, predicted" in html and "Every time on this page is predicted, from the roofline" in html
    code, stdout, err = run_cli(["compile", str(_mlp_file(tmp_path)), "-b", "8", "--devices", "2xcpu",
                                 "--replicas", "1", "--use-all-devices", "-o", str(out), "--force"], capsys)
    assert code == 0 and "devices given" not in stdout, stdout


def test_a_replicated_batchnorm_plan_warns_that_each_replica_normalises_its_slice(tmp_path, capsys) -> None:
    model = _mlp_file(tmp_path, "nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4)")
    argv = ["compile", str(model), "-b", "8", "--devices", "2xcpu", "--replicas", "2", "-m", "1",
            "-o", str(tmp_path / "out")]
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    warning = next(line for line in err.splitlines() if line.startswith("pipecc: warning: BatchNorm"))
    assert "each of the 2 replicas' slices of the batch with its own statistics" in warning, warning
    assert "--replicas 1" in warning and "dropout" in warning
    code, _, err = run_cli(argv + ["--force", "--strict-batchnorm"], capsys)
    assert code == 1 and "strict_batchnorm" in err and "--replicas 1" in err, err


# ----------------------------------------------------------------------------- cost, profile, run
def test_cost_prints_a_note_once_not_warning_note(tmp_path, capsys) -> None:
    path = tmp_path / "attr.py"
    path.write_text("""import torch
from torch import nn
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = 2.0
    def forward(self, x):
        return self.lin(x) * self.scale
def build_model():
    return M()
def example_inputs(batch_size=1):
    return (torch.randn(batch_size, 4),)
""")
    code, out, err = run_cli(["cost", str(path), "-b", "2"], capsys)
    assert code == 0, err
    assert "note: forward reads the Python attribute scale" in out, out
    assert "warning: note:" not in out + err


def test_profile_table_explains_the_fit_error_and_flags_poor_fits() -> None:
    from pipecc.cli.profile import POOR_FIT, profile_table

    def node(name: str, error: float) -> dict:
        fit = {"a": 1e-6, "c": 2e-6, "error": error}
        return {"name": name, "op": "linear", "fit": {"fwd": fit, "bwd": fit}, "fit_error": error}

    data = {"model": {"name": "m"}, "batch_size": 8, "microbatch_sizes": [1, 2, 4, 8],
            "targets": [{"torch_device": "cpu", "hardware": "this CPU", "devices": ["cpu"],
                         "nodes": [node("good", 0.05), node("noisy", 0.78)]}]}
    text = profile_table(data)
    rows = {line.split()[0]: line for line in text.splitlines() if line.startswith(("good", "noisy"))}
    assert rows["noisy"].rstrip().endswith("78% !") and rows["good"].rstrip().endswith("5%")
    joined = " ".join(text.split())
    assert "fit err: the largest gap between a measured time and its line a + c*b" in joined
    assert f"1 of 2 nodes above {POOR_FIT:.0%} (marked !)" in joined


def test_device_note_for_a_gpu_folder_on_the_cpu() -> None:
    from pipecc.runtime.dist import device_note
    gpus = {"devices": [{"name": "a100", "kind": "gpu"}, {"name": "a100", "kind": "gpu"}]}
    note = device_note(gpus, torch.device("cpu"))
    assert note is not None and note.startswith("note: this folder was planned for 2x a100;") and "CPU" in note
    assert device_note(gpus, torch.device("cuda", 0)) is None
    assert device_note({"devices": [{"name": "cpu", "kind": "cpu"}]}, torch.device("cpu")) is None


@pytest.mark.slow
def test_a_folder_planned_for_gpus_says_it_runs_on_the_cpu(tmp_path) -> None:
    out = tmp_path / "out"
    done = pipecc_here("compile", str(_mlp_file(tmp_path)), "-b", "8", "--devices", "2xa100", "--replicas", "1",
                       "--use-all-devices", "-o", str(out), "-q")
    assert done.returncode == 0, done.stderr
    done = pipecc_here("run", str(out), "--steps", "1")  # in this process: torchrun is the launch
    assert done.returncode == 0, done.stdout + done.stderr
    if torch.cuda.is_available():  # a GPU machine runs it on the GPUs: no note
        assert "planned for" not in done.stdout
    else:
        assert "note: this folder was planned for 2x a100; without a CUDA device here" in done.stdout, done.stdout
