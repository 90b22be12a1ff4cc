"""`pipecc run OUT --trace FILE` (a Chrome/Perfetto trace of every action as it ran,
`pipecc.runtime.trace`) and `pipecc inspect OUT --trace FILE [--report HTML]` (the measured
timeline beside the predicted one, `pipecc.report.measured`); issue 23 item 2.

Three torchrun launches (the tiny MLP as 2 stages under its compiled schedule with --json and
--verify too, under zb-h1, and as 2 stages x 2 replicas), one in-process run of the interleaved
schedule, and the rest without any process: the merge of made-up rank payloads, bad inputs.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from helpers import compile_mlp as compile_tiny_mlp, run_cli
from helpers import pipecc_here as pipecc  # in this process: only torchrun and its ranks start
from pipecc.ir.schedule.text import parse
from pipecc.runtime import dist
from pipecc.runtime.trace import COMM_TID, STEP_TID, chrome_trace

pytestmark = pytest.mark.xdist_group(name="trace")

ROOT = Path(__file__).resolve().parents[1]


def compile_mlp(out: Path, *extra: str, devices: str = "2xcpu", replicas: int = 1) -> Path:
    """The tiny MLP, batch 8; `extra` gives the micro-batches (helpers.compile_mlp)."""
    return compile_tiny_mlp(out, *extra, devices=devices, replicas=replicas, microbatches=None)


def schedule_rows(out: Path) -> list[list[tuple[str, int, int]]]:
    schedule = parse((out / "schedule.txt").read_text())
    return [[(a.kind.value, a.stage, a.microbatch) for a in row] for row in schedule.actions]


def actions(trace: dict) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and "action" in e.get("args", {})]


def check_trace(trace: dict, out: Path, steps: int, replicas: int = 1) -> None:
    """Every action of schedule.txt, every step, on every rank; tracks monotone, never overlapping."""
    other = trace["otherData"]
    assert (other["format"], other["version"], other["steps"], other["replicas"]) == ("pipecc-trace", 1, steps,
                                                                                     replicas)
    rows = schedule_rows(out)
    assert other["num_ranks"] == len(rows) and other["clock"] == "shared" and other["barrier_skew_us"] >= 0
    pipeline_rank = {r["rank"]: r["pipeline_rank"] for r in other["ranks"]}
    assert sorted(pipeline_rank) == list(range(len(rows) * replicas))
    marker = json.loads((out / "pipecc.json").read_text())
    m = marker["microbatches"]
    for pid, prank in pipeline_rank.items():
        expected = Counter(a for a in rows[prank])
        for step in range(steps):
            ran = [e for e in actions(trace) if e["pid"] == pid and e["args"]["step"] == step]
            got = Counter((e["args"]["action"], e["args"]["stage"], e["args"]["microbatch"]) for e in ran)
            assert got == expected, (pid, step)
            kinds = Counter(e["args"]["action"] for e in ran)
            assert kinds["F"] == m and kinds["B"] + kinds["W"] == m  # one backward per micro-batch
        markers = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == pid and e["tid"] == STEP_TID]
        assert [e["args"]["step"] for e in markers] == list(range(steps))
        assert [e["args"]["warmup"] for e in markers] == [s < other["warmup_steps"] for s in range(steps)]
    tracks: dict[tuple[int, int], list[dict]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            assert e["dur"] >= 0
            tracks.setdefault((e["pid"], e["tid"]), []).append(e)
    for events in tracks.values():  # in the order recorded: monotone, never overlapping
        for before, after in zip(events, events[1:]):
            assert after["ts"] >= before["ts"] + before["dur"] - 1e-3
    sends = [e for e in actions(trace) if e["args"]["action"] in ("SEND_F", "SEND_B")]
    recvs = [e for e in actions(trace) if e["args"]["action"] in ("RECV_F", "RECV_B")]
    assert sends and recvs and all(e["tid"] == COMM_TID for e in sends + recvs)
    assert all(e["args"]["bytes"] > 0 for e in sends + recvs) and {e["cat"] for e in recvs} == {"recv wait"}


@pytest.fixture(scope="module")
def traced(tmp_path_factory) -> tuple[Path, Path, str]:
    """The MLP under its compiled schedule, traced with --json and --verify in the same launch."""
    root = tmp_path_factory.mktemp("trace")
    out = compile_mlp(root / "mlp", "-m", "2")
    trace = root / "trace.json"
    run = pipecc("run", str(out), "--trace", str(trace), "--steps", "3", "--json", "--verify", "--timeout", "30")
    assert run.returncode == 0, run.stderr[-3000:]
    return out, trace, run.stdout


# ---------------------------------------------------------------------------- launches


@pytest.mark.slow  # a torchrun launch of several processes (make test-fast leaves it out)
def test_trace_has_every_action_of_every_step(traced) -> None:
    out, path, stdout = traced
    trace = json.loads(path.read_text())
    check_trace(trace, out, steps=3)
    assert json.loads(stdout)["format"] == "pipecc-run"  # --json still prints its one document
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names[(0, 0)] == "stage 0" and names[(1, 1)] == "stage 1" and names[(0, COMM_TID)] == "comm"
    assert not list(path.parent.glob(".trace.json.*"))  # the temporary file was renamed


@pytest.mark.slow  # a torchrun launch of several processes (make test-fast leaves it out)
def test_zero_bubble_trace_has_i_and_w(tmp_path: Path) -> None:
    out = compile_mlp(tmp_path / "zb", "--schedule", "zb-h1", "-m", "4")
    path = tmp_path / "zb.json"
    run = pipecc("run", str(out), "--trace", str(path), "--steps", "2", "--timeout", "30")
    assert run.returncode == 0, run.stderr[-3000:]
    trace = json.loads(path.read_text())
    check_trace(trace, out, steps=2)
    kinds = Counter(e["args"]["action"] for e in actions(trace))
    assert kinds["I"] == kinds["W"] == 2 * 2 * 4 and kinds["B"] == 0  # ranks x steps x micro-batches


@pytest.mark.slow  # a torchrun launch of several processes (make test-fast leaves it out)
def test_replicated_trace_has_all_reduces(tmp_path: Path) -> None:
    out = compile_mlp(tmp_path / "pp_dp", "-m", "2", "--schedule", "1f1b", devices="4xcpu", replicas=2)
    path = tmp_path / "pp_dp.json"
    run = pipecc("run", str(out), "--trace", str(path), "--steps", "2", "--timeout", "60")
    assert run.returncode == 0, run.stderr[-3000:]
    trace = json.loads(path.read_text())
    check_trace(trace, out, steps=2, replicas=2)
    for pid in range(4):
        mine = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == pid]
        assert sum(e["args"].get("action") == "REDUCE" for e in mine) == 2  # one stage, two steps
        assert sum(e["name"] == "all-reduce wait" for e in mine) == 2
    code, text, _ = run_inspect(out, path)
    assert code == 0 and "largest differences" in text


def run_inspect(out: Path, trace: Path, *extra: str) -> tuple[int, str, str]:
    r = pipecc("inspect", str(out), "--trace", str(trace), *extra)
    return r.returncode, r.stdout, r.stderr


@pytest.mark.slow  # uses the launch of `traced`
def test_inspect_draws_both_gantts_and_names_differences(traced, tmp_path: Path, capsys) -> None:
    out, path, _ = traced
    code, text, err = run_cli(["inspect", str(out), "--trace", str(path)], capsys)
    assert code == 0, err
    assert "iteration: measured" in text and "predicted schedule:" in text and "measured schedule:" in text
    assert "largest differences (measured - predicted):" in text
    named = text.split("largest differences (measured - predicted):\n")[1].splitlines()
    assert len(named) == 3 and all(line.startswith("  stage ") and " predicted (" in line for line in named)
    assert text.count("(median per micro-batch)") >= 4 and "rank 1: compute " in text
    code, doc, _ = run_cli(["inspect", str(out), "--trace", str(path), "--format", "json"], capsys)
    data = json.loads(doc)
    assert code == 0 and data["step"] in (1, 2) and len(data["differences"]) == 3
    assert all(d["measured_s"] > 0 for d in data["differences"])
    html = tmp_path / "report.html"
    code, text, err = run_cli(["inspect", str(out), "--trace", str(path), "--report", str(html)], capsys)
    assert code == 0, err
    page = html.read_text()
    assert 'class="chart gantt"' in page and 'class="chart gantt measured"' in page
    measured = page.split('class="chart gantt measured"')[1].split("</svg>")[0]
    assert 'class="block F"' in measured and 'data-device="1"' in measured
    assert 'class="block B"' in measured or 'class="block W"' in measured  # the planner's schedule's backward
    assert "Largest differences" in page and f"wrote {html}" in text


@pytest.mark.slow  # uses the launch of `traced`
def test_inspect_refuses_another_folders_trace(traced, tmp_path: Path, capsys) -> None:
    _, path, _ = traced
    other = compile_mlp(tmp_path / "other", "-m", "4")
    code, _, err = run_cli(["inspect", str(other), "--trace", str(path)], capsys)
    assert code == 1 and err.count("\n") == 1 and "is of another pipeline" in err
    plain = compile_mlp(tmp_path / "plain", "--schedule", "gpipe", "-m", "2")  # not the planner's pick
    assert json.loads((plain / "pipecc.json").read_text())["schedule"] != json.loads(path.read_text())[
        "otherData"]["schedule"]
    code, _, err = run_cli(["inspect", str(plain), "--trace", str(path), "--report", str(tmp_path / "r.html")],
                           capsys)
    assert code == 1 and err.count("\n") == 1 and "ran another schedule" in err
    assert not (tmp_path / "r.html").exists()


# ---------------------------------------------------------------------------- in process


@pytest.fixture(scope="module")
def mlp_out(tmp_path_factory) -> Path:
    return compile_mlp(tmp_path_factory.mktemp("trace_ip") / "mlp", "-m", "2")


def test_interleaved_in_one_process_traces_both_stages(mlp_out: Path, tmp_path: Path, capsys) -> None:
    path = tmp_path / "t.json"
    assert dist.main([str(mlp_out), "--steps", "2", "--schedule", "interleaved", "--trace", str(path)]) == 0
    trace = json.loads(path.read_text())
    ran = actions(trace)
    assert {e["pid"] for e in ran} == {0} and {e["tid"] for e in ran if e["cat"] == "compute"} == {0, 1}
    assert Counter(e["args"]["action"] for e in ran) == Counter({"F": 8, "B": 8})  # 2 stages x 2 mb x 2 steps
    assert sum(e["name"] == "optimizer" for e in trace["traceEvents"]) == 2


# ---------------------------------------------------------------------------- the merge


def test_merge_aligns_the_clocks() -> None:
    def payload(rank: int, host: str, origin: int) -> dict:
        return {"rank": rank, "pipeline_rank": rank, "replica": 0, "stages": [rank], "host": host,
                "origin_ns": origin, "events": [["F mb 0", "compute", rank, origin + 1000, origin + 3000, {}]]}
    meta = {"replicas": 1}
    shared = chrome_trace([payload(0, "a", 5_000), payload(1, "a", 7_000)], meta)
    xs = [e for e in shared["traceEvents"] if e["ph"] == "X"]
    assert [(e["pid"], e["ts"], e["dur"]) for e in xs] == [(0, 1.0, 2.0), (1, 3.0, 2.0)]  # one clock, as read
    assert shared["otherData"]["clock"] == "shared" and shared["otherData"]["barrier_skew_us"] == 2.0
    apart = chrome_trace([payload(0, "a", 5_000), payload(1, "b", 900_000)], meta)
    assert [e["ts"] for e in apart["traceEvents"] if e["ph"] == "X"] == [1.0, 1.0]  # each from its barrier
    assert apart["otherData"]["clock"] == "barrier" and apart["otherData"]["barrier_skew_us"] is None


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("where", ["missing/trace.json", "folder"])
def test_run_refuses_an_unwritable_trace_path(mlp_out: Path, tmp_path: Path, where: str, capsys) -> None:
    (tmp_path / "folder").mkdir()
    code, out, err = run_cli(["run", str(mlp_out), "--trace", str(tmp_path / where)], capsys)
    assert code == 1 and err.count("\n") == 1 and err.startswith("pipecc: error: --trace ") and not out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder"] and not any((tmp_path / "folder").iterdir())


def test_run_refuses_a_read_only_folder(mlp_out: Path, tmp_path: Path, capsys) -> None:
    locked = tmp_path / "ro"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        import os
        if os.access(locked, os.W_OK):
            pytest.skip("running as root: every folder is writable")
        code, _, err = run_cli(["run", str(mlp_out), "--trace", str(locked / "t.json")], capsys)
        assert code == 1 and "cannot write in" in err and err.count("\n") == 1
    finally:
        locked.chmod(0o700)


def test_trace_needs_a_step(mlp_out: Path, tmp_path: Path, capsys) -> None:
    code, _, err = run_cli(["run", str(mlp_out), "--trace", str(tmp_path / "t.json"), "--steps", "0"], capsys)
    assert code == 2 and "--trace records the run's steps" in err and not (tmp_path / "t.json").exists()


@pytest.mark.parametrize("content, message", [
    ("{not json", "is not valid JSON"),
    ('{"traceEvents": []}', "is not a pipecc trace"),
    ('{"traceEvents": [], "otherData": {"format": "pipecc-trace", "version": 9}}', "version 9"),
    ('{"traceEvents": [{"ph": "X"}], "otherData": {"format": "pipecc-trace", "version": 1, "ranks": []}}',
     "is damaged"),
])
def test_inspect_refuses_a_bad_trace(mlp_out: Path, tmp_path: Path, content: str, message: str, capsys) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    code, out, err = run_cli(["inspect", str(mlp_out), "--trace", str(path), "--report", str(tmp_path / "r.html")],
                             capsys)
    assert code == 1 and message in err and err.count("\n") == 1 and not out
    assert not (tmp_path / "r.html").exists()


def test_inspect_report_needs_a_trace(mlp_out: Path, tmp_path: Path, capsys) -> None:
    code, _, err = run_cli(["inspect", str(mlp_out), "--report", str(tmp_path / "r.html")], capsys)
    assert code == 2 and "give --trace FILE" in err
    code, _, err = run_cli(["inspect", str(mlp_out), "--trace", str(tmp_path / "none.json")], capsys)
    assert code == 1 and "cannot read it" in err


# ---------------------------------------------------------------------------- the overhead bench


def test_bench_counts_the_recorders_cost(tmp_path: Path) -> None:
    """bench/bench_trace.py's in-process half: the recorder's cost per action, and the actions
    per rank and step it multiplies (what its numbers mean, not how large they are)."""
    import sys
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_trace

    cost = bench_trace.per_action_ns(n=2000, repeats=1)
    assert cost["traced_ns"] > 0 and cost["direct_ns"] > 0
    assert cost["overhead_ns"] == cost["traced_ns"] - cost["direct_ns"]
    payloads = [{"rank": r, "pipeline_rank": r, "replica": 0, "stages": [r], "host": "h", "origin_ns": 0,
                 "events": [["F mb 0", "compute", r, 0, 1, {"action": "F", "step": s}] for s in (0, 1)
                            for _ in range(3 + r)]} for r in (0, 1)]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(chrome_trace(payloads, {"replicas": 1})))
    assert bench_trace.actions_per_rank_step(path) == 4
