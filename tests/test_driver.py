"""The driver as a list of named steps: the progress lines they show, the IR dumps
(`--dump-ir`), the verifier after each step under `debug` (split-search clones included),
and the backends it picks for a plan; `compile` and `compile_module` on one plan."""
from __future__ import annotations

import io
import json
import re

import pytest
import torch

from helpers import MLP_ARGS, ROOT
from pipecc import cli, driver, progress
from pipecc.driver import Instruments, State, Step
from pipecc.ir.graph import IRError
from pipecc.models import mlp
from pipecc.passes.contract import Contract

MLP = ROOT / "models" / "mlp.py"
MLP_FLAGS = [f"--model-arg={arg}" for arg in MLP_ARGS]


@pytest.fixture(scope="module")
def analysis() -> driver.Analysis:
    return driver.analyze(MLP, model_args=dict(mlp.TINY), batch_size=4, debug=True)


@pytest.fixture
def shown():
    """What progress draws (forced on, as on a terminal): the finished steps' labels."""
    stream = io.StringIO()
    progress.configure(stream=stream, force=True)
    yield lambda: [re.sub(r"  [0-9.]+ s$", "", line.split("\r")[-1].removeprefix("\033[K✓ "))
                   for line in stream.getvalue().split("\n") if "✓" in line]
    progress.configure(quiet=True)


def test_progress_lines_are_the_steps_labels(tmp_path, shown):
    a = driver.analyze(MLP, model_args=dict(mlp.TINY), batch_size=4)
    plan, graph = driver.plan(a, "2xcpu")
    driver.compile(a, plan, graph, tmp_path / "out")
    lines = shown()
    # capture and costs share "tracing"; cutting, checking and writing show no line of their own
    assert lines[:3] == ["building mlp.py", "tracing mlp.py", "planning on 2 devices"]
    assert lines[-1] == "writing report"
    assert lines[3:-1] and all(s.startswith("splitting layers (") for s in lines[3:-1])


def test_dump_ir_writes_one_numbered_file_per_step(tmp_path):
    dump = tmp_path / "ir"
    assert cli.main(["compile", str(MLP), "-b", "4", *MLP_FLAGS, "--devices", "2xcpu", "--use-all-devices", "--replicas", "1", "-q",
                     "--dump-ir", str(dump), "-o", str(tmp_path / "out")]) == 0
    files = sorted(p.name for p in dump.iterdir())
    assert files == ["000_build.txt", "001_capture.txt", "002_costs.txt", "003_recost.txt",
                     "004_balance.txt", "005_split_layers.txt", "006_cut_stages.txt", "007_report.txt",
                     "008_check.txt", "009_write.txt"]
    assert (dump / "000_build.txt").read_text().endswith("(no graph yet)\n")
    capture = (dump / "001_capture.txt").read_text()
    assert "call_module[target=0]" in capture and "linear" in capture and "FLOPs" not in capture
    costs = (dump / "002_costs.txt").read_text()
    assert "fwd 1056*B FLOPs" in costs and "plan:" not in costs  # Linear(16, 32): 2*16*32+32
    planned = (dump / "005_split_layers.txt").read_text()
    text = planned[planned.index("plan:\n") + 6:]
    saved = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert json.loads(text)["stages"] == saved["stages"]
    cut = (dump / "006_cut_stages.txt").read_text()
    assert "stage 0: receives [input.input]" in cut and "stage 1: receives" in cut
    # plan alone: its own steps, numbered on after what the folder holds
    assert cli.main(["plan", str(MLP), *MLP_FLAGS, "--devices", "2xcpu", "--use-all-devices", "-q", "--json",
                     "--dump-ir", str(dump)]) == 0
    assert sorted(p.name for p in dump.iterdir())[10:] == [
        "010_build.txt", "011_capture.txt", "012_costs.txt", "013_recost.txt", "014_balance.txt",
        "015_split_layers.txt"]


def test_debug_runs_the_verifier_after_each_step(analysis):
    def lose_a_node(state: State) -> None:
        state.plan.stages[0].nodes.pop(0)

    def fresh() -> State:
        plan, graph = driver.plan(analysis, "2xcpu", split_layers=False)
        return State(graph=graph, costed=True, plan=plan)

    steps = [Step("lose a node", lose_a_node, contract=Contract("lose a node", ("graph", "plan"), ("plan",),
                                                                "tests.test_driver:lose_a_node"))]
    Instruments(debug=False).run(steps, fresh())  # nothing notices
    with pytest.raises(IRError, match="is placed in no stage"):
        Instruments(debug=True).run(steps, fresh())


def test_split_search_clones_are_verified_under_debug(monkeypatch):
    # NOTE: hidden 1024: with the fixed costs counted the split search tries no split of the
    # TINY MLP's layers (a split only adds calls there); at 1024 it tries 16 and keeps one
    analysis = driver.analyze(MLP, model_args=dict(mlp.TINY, hidden=1024), batch_size=4, debug=True)
    graphs, plans = [], []
    real_verify, real_verify_plan = driver.verify, driver.verify_plan

    def verify(g, costed=False):
        graphs.append(g)
        real_verify(g, costed)

    def verify_plan(g, p, stages=None):
        plans.append(g)
        real_verify_plan(g, p, stages)

    monkeypatch.setattr(driver, "verify", verify)
    monkeypatch.setattr(driver, "verify_plan", verify_plan)
    plan, graph = driver.plan(analysis, "2xcpu", debug=True)
    clones = {id(g) for g in graphs} - {id(analysis.graph), id(graph)}
    assert clones, "the split search tried no split: pick a model where it does"
    assert clones <= {id(g) for g in plans}  # and the plan made for each clone


def test_backends_follow_the_plans_fpga_stages(analysis):
    cpu, _ = driver.plan(analysis, "2xcpu", training=False)
    fpga, _ = driver.plan(analysis, "cpu,u250,cpu", training=False, split_layers=False)
    assert [b.name for b in driver.backends_for(cpu)] == ["torch"]
    assert fpga.fpga_stages() == {1: "u250"}
    assert [b.name for b in driver.backends_for(fpga)] == ["torch", "fpga"]
    notes = driver.backends_for(fpga)[-1].notes(fpga, "OUT")
    assert notes[0].startswith("stage 1 on u250: HLS project OUT/stage_1/hls")


def test_compile_and_compile_module_run_the_same_plan(tmp_path, analysis):
    plan, graph = driver.plan(analysis, "2xcpu", debug=True)
    done = driver.compile(analysis, plan, graph, tmp_path / "out", debug=True)
    assert done.out == tmp_path / "out" and done.notes == [] and len(done.stages) == 2
    assert (tmp_path / "out" / "report.html").is_file()
    model = analysis.spec.model
    pm = driver.compile_module(model, graph, plan, analysis.spec.example_inputs, debug=True)
    assert pm.plan is plan
    x = analysis.spec.example_inputs
    torch.testing.assert_close(pm(*x), model(*x))
