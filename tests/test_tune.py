"""`pipecc tune` (issue 20 item 4): the candidates, the measuring loop (failures, hangs, the
budget), the compiled folder it writes, and its bad input."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from helpers import ROOT, pipecc_here, rehash, run_cli

from pipecc import driver, tuning
from pipecc.errors import PipeccError
from pipecc.passes.plan_options import PlanOptions
from pipecc.targets.devices import parse_devices

MLP = str(ROOT / "models" / "mlp.py")


@pytest.fixture(scope="module")
def mlp_analysis():
    return driver.analyze(MLP, batch_size=8)


@pytest.fixture(scope="module")
def mlp_candidates(mlp_analysis):
    notes: list[str] = []
    options = PlanOptions(replicas="auto", use_all_devices=False)
    cands = tuning.candidates(mlp_analysis, parse_devices("2xcpu"), options, 3, note=notes.append)
    return cands, notes


# ----------------------------------------------------------------------------- candidates
def test_candidates_start_with_the_planners_choice_and_are_distinct(mlp_analysis, mlp_candidates) -> None:
    cands, notes = mlp_candidates
    chosen, _ = driver.plan(mlp_analysis, "2xcpu", replicas="auto", use_all_devices=False)
    assert cands[0].label == "planner's choice" and tuning.key(cands[0].plan) == tuning.key(chosen)
    keys = [tuning.key(c.plan) for c in cands]
    assert len(set(keys)) == len(keys)
    labels = [c.label for c in cands]
    # the baselines that fit, or a line saying why each is not there
    for base in ("equal-count", "torch.distributed.pipelining split", "data parallelism"):
        assert base in labels or any(n.startswith(base) for n in notes), (labels, notes)
    assert any(len(c.plan.stages) == 1 and c.plan.replicas == 2 for c in cands)  # data parallelism
    eq = next((c for c in cands if c.label == "equal-count"), None)
    assert eq is None or len(eq.plan.stages) == 2
    assert sum(c.label.startswith("planner") for c in cands) <= 3
    planners = [i for i, c in enumerate(cands) if c.label.startswith("planner #")]
    bases = [i for i, c in enumerate(cands) if not c.label.startswith("planner")]
    assert not planners or not bases or max(bases) < min(planners)  # a budget cuts the planner's first


def test_k_below_one_is_refused(mlp_analysis) -> None:
    with pytest.raises(PipeccError, match="-k 0"):
        tuning.candidates(mlp_analysis, parse_devices("2xcpu"), PlanOptions(), 0)


# ----------------------------------------------------------------------------- measuring
def _fake_run(outcomes: dict[int, object]):
    def run(folder: Path, steps: int, timeout: float) -> dict:
        i = int(folder.name.split("_")[1])
        what = outcomes.get(i, 0.5 + i)
        if isinstance(what, BaseException):
            raise what
        return {"step_s": {"median": what}}
    return run


def test_failing_and_hanging_candidates_are_reported_and_skipped(mlp_analysis, mlp_candidates, tmp_path,
                                                                 monkeypatch) -> None:
    cands = [tuning.Candidate(c.label, c.plan, c.graph) for c in mlp_candidates[0]]
    monkeypatch.setattr(tuning, "run_candidate", _fake_run({
        1: PipeccError("rank 0 failed: boom"), 2: TimeoutError("no result within 1 s")}))
    tuning.measure(mlp_analysis, cands, tmp_path, steps=2, timeout=1.0, budget_s=None)
    assert [c.status for c in cands[:3]] == ["ok", "failed", "timeout"]
    assert cands[1].reason == "rank 0 failed: boom" and "no result" in cands[2].reason
    assert tuning.fastest(cands) is cands[0]
    text = tuning.table(cands)
    assert "failed: rank 0 failed: boom" in text and "timeout: no result" in text and "fastest" in text
    rows = tuning.rows(cands)
    assert rows[0]["chosen"] and rows[1]["status"] == "failed" and rows[1]["measured_s"] is None


def test_a_candidate_that_fails_to_compile_is_skipped(mlp_analysis, mlp_candidates, tmp_path, monkeypatch) -> None:
    cands = [tuning.Candidate(c.label, c.plan, c.graph) for c in mlp_candidates[0][:2]]
    real = tuning.compile_candidate

    def compile_some(analysis, cand, folder):
        if folder.name == "cand_0":
            raise PipeccError("cannot write it")
        real(analysis, cand, folder)
    monkeypatch.setattr(tuning, "compile_candidate", compile_some)
    monkeypatch.setattr(tuning, "run_candidate", _fake_run({}))
    tuning.measure(mlp_analysis, cands, tmp_path, steps=2, timeout=1.0, budget_s=None)
    assert cands[0].status == "failed" and cands[0].reason == "cannot write it"
    assert tuning.fastest(cands) is cands[1]


def test_budget_stops_starting_candidates(mlp_analysis, mlp_candidates, tmp_path, monkeypatch) -> None:
    cands = [tuning.Candidate(c.label, c.plan, c.graph) for c in mlp_candidates[0]]
    assert len(cands) >= 3
    started: list[str] = []
    fake = _fake_run({})

    def run(folder, steps, timeout):
        started.append(folder.name)
        return fake(folder, steps, timeout)
    monkeypatch.setattr(tuning, "run_candidate", run)
    monkeypatch.setattr(tuning, "compile_candidate", lambda a, c, f: None)
    now = [0.0]

    def clock() -> float:  # each call: 10 s later
        now[0] += 10.0
        return now[0]
    tuning.measure(mlp_analysis, cands, tmp_path, steps=2, timeout=1.0, budget_s=15.0, clock=clock)
    # start at 10; candidate 1 checked at 20 (10 s in: within 15), candidate 2 at 30 (past it)
    assert started == ["cand_0", "cand_1"]
    assert all(c.status == "skipped" and "--budget-s 15" in c.reason for c in cands[2:])


def test_the_planners_choice_runs_even_past_the_budget(mlp_analysis, mlp_candidates, tmp_path, monkeypatch) -> None:
    cands = [tuning.Candidate(c.label, c.plan, c.graph) for c in mlp_candidates[0][:2]]
    monkeypatch.setattr(tuning, "run_candidate", _fake_run({}))
    monkeypatch.setattr(tuning, "compile_candidate", lambda a, c, f: None)
    clock = iter([0.0, 100.0, 200.0]).__next__
    tuning.measure(mlp_analysis, cands, tmp_path, steps=2, timeout=1.0, budget_s=1.0, clock=clock)
    assert [c.status for c in cands] == ["ok", "skipped"]


def test_a_hung_run_is_stopped_with_its_processes(tmp_path, monkeypatch) -> None:
    pid_file = tmp_path / "pid"
    script = (f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
              "os.system('sleep 600 &'); time.sleep(600)")
    monkeypatch.setattr(tuning, "RUN_COMMAND", [sys.executable, "-c", script])
    monkeypatch.setattr(tuning, "GRACE_S", 0.5)
    with pytest.raises(TimeoutError, match="no result within"):
        tuning.run_candidate(tmp_path, 2, 0.5)
    pid = int(pid_file.read_text())
    for _ in range(50):  # the group was killed; wait for the kernel to reap it
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"process {pid} still runs")


def test_a_failing_run_gives_its_error_line(tmp_path, monkeypatch) -> None:
    script = "import sys; sys.stderr.write('noise\\npipecc: error: rank 1 hung\\n'); sys.exit(1)"
    monkeypatch.setattr(tuning, "RUN_COMMAND", [sys.executable, "-c", script])
    with pytest.raises(PipeccError, match="^rank 1 hung$"):
        tuning.run_candidate(tmp_path, 2, 5.0)


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("argv, code, message", [
    (["-k", "0"], 2, "tune at least 1 candidate"),
    (["--budget-s", "0"], 2, "--budget-s: must be > 0"),
    (["--steps", "0"], 2, "--steps"),
    (["--dump-ir", "dumps"], 2, "--dump-ir applies to `pipecc plan` and `pipecc compile`"),
])
def test_bad_arguments_are_usage_errors(argv, code, message, tmp_path, capsys) -> None:
    got, out, err = run_cli(["tune", MLP, "--devices", "2xcpu", "-o", str(tmp_path / "o"), *argv], capsys)
    assert got == code and message in err and out == ""
    assert not (tmp_path / "o").exists()


def test_a_foreign_output_folder_is_refused_before_the_analysis(tmp_path, capsys) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    got, _, err = run_cli(["tune", MLP, "--devices", "2xcpu", "-o", str(out)], capsys)
    assert got == 1 and "was not written by pipecc; use --force" in err
    assert err.count("\n") == 1 and sorted(p.name for p in out.iterdir()) == ["notes.txt"]


# ----------------------------------------------------------------------------- end to end
@pytest.mark.slow  # several torchrun launches (make test-fast leaves it out)
def test_tune_mlp_on_two_cpus(tmp_path, capsys, monkeypatch) -> None:
    """A real tune (k=2, 2 steps) with one candidate made to fail: its stage file raises."""
    real = tuning.compile_candidate

    def broken_second(analysis, cand, folder):
        real(analysis, cand, folder)
        if folder.name == "cand_1":
            stage = folder / "stage_0" / "stage.py"
            stage.write_text("raise RuntimeError('injected failure')\n" + stage.read_text())
            rehash(folder)  # re-recorded: the stage fails as it runs, not at the hash check
    monkeypatch.setattr(tuning, "compile_candidate", broken_second)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "tuned"
    before = set(Path(os.environ.get("TMPDIR", "/tmp")).glob("pipecc-tune-*"))
    code, stdout, err = run_cli(["tune", MLP, "-b", "8", "--devices", "2xcpu", "-k", "2", "--steps", "2",
                                 "--timeout", "30", "-o", str(out), "--json"], capsys)
    assert code == 0, err
    doc = json.loads(stdout)
    rows = doc["candidates"]
    assert rows[1]["status"] == "failed" and rows[1]["reason"]
    assert any(r["status"] == "ok" for r in rows) and rows[doc["chosen"]]["status"] == "ok"
    chosen = rows[doc["chosen"]]
    assert chosen["measured_s"] == min(r["measured_s"] for r in rows if r["status"] == "ok")
    plan = json.loads((out / "plan.json").read_text())
    assert plan["decisions"][0].startswith("tuned: measured fastest of")
    assert any("failed" in d for d in plan["decisions"] if d.startswith("tuned: candidate 2"))
    assert set(Path(os.environ.get("TMPDIR", "/tmp")).glob("pipecc-tune-*")) == before  # cleaned up
    ran = pipecc_here("run", str(out), "--steps", "1", "--verify")
    assert ran.returncode == 0, ran.stderr
    assert "match the single-process run" in ran.stdout + ran.stderr
