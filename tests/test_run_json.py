"""`pipecc run OUT --json`: one JSON document of measured stage and step times beside the plan's
predictions (issue 11 item 5; `pipecc.runtime.timing`).

Two launches (a training MLP under 1F1B with --verify, an MLP compiled with --inference), one
in-process run of the interleaved schedule (one process holding both stages), and the rest
without any process: the document builder on made-up figures, usage errors, --help.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from helpers import compile_mlp, copy_folder, run_cli
from helpers import pipecc_here as pipecc  # in this process: only torchrun and its ranks start
from pipecc import cli
from pipecc.runtime import dist
from pipecc.runtime.timing import run_document

pytestmark = pytest.mark.xdist_group(name="run_json")

TOP = {"format", "version", "schedule", "microbatches", "batch_size", "steps", "warmup_steps", "step_s", "history", "precision",
       "predicted_step_s", "samples_per_s", "stages", "plan", "memory_source"}
STAGE = {"index", "rank", "replica", "device", "forward_s", "backward_s", "forward_samples", "backward_samples",
         "predicted_forward_s", "predicted_backward_s", "comm_wait_s", "host_s",
         "peak_memory_bytes", "peak_memory_at", "static_memory_bytes", "predicted_peak_memory_bytes"}  # memory: tests/test_memory.py


def document(result: subprocess.CompletedProcess) -> dict:
    """stdout as exactly one JSON document (json.loads refuses anything after it)."""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.strip(), result.stderr[-3000:]
    return json.loads(result.stdout)


def check_shape(doc: dict, plan: dict, steps: int, warmup: int) -> None:
    assert set(doc) == TOP
    assert (doc["format"], doc["version"]) == ("pipecc-run", 1)
    assert (doc["steps"], doc["warmup_steps"]) == (steps - warmup, warmup)
    assert len(doc["step_s"]["all"]) == steps - warmup and doc["step_s"]["median"] > 0
    assert doc["samples_per_s"] == pytest.approx(doc["batch_size"] / doc["step_s"]["median"])
    assert doc["predicted_step_s"] == plan["predicted_iteration_s"]
    assert [s["index"] for s in doc["stages"]] == list(range(len(plan["stages"])))
    for stage, planned in zip(doc["stages"], plan["stages"]):
        assert set(stage) == STAGE
        assert stage["device"] == plan["devices"][planned["device"]]["name"]
        assert stage["predicted_forward_s"] == planned["forward_s"]
        assert stage["predicted_backward_s"] == planned["backward_s"]
        assert stage["forward_s"] > 0 and stage["forward_samples"] == doc["microbatches"] * doc["steps"]
        assert stage["comm_wait_s"] >= 0 and stage["host_s"] >= 0
        held = [s["index"] for s in doc["stages"] if s["rank"] == stage["rank"]]  # the rank's stages: their sum
        assert stage["predicted_peak_memory_bytes"] == sum(plan["stages"][i]["peak_memory_bytes"] for i in held)


def loose_bound(doc: dict) -> None:
    """The step is not shorter than half the slowest stage's compute for all micro-batches (a
    sanity bound on what was measured, not a timing assertion)."""
    slowest = max(s["forward_s"] + s["backward_s"] for s in doc["stages"])
    assert doc["step_s"]["median"] >= slowest * doc["microbatches"] * 0.5


@pytest.fixture(scope="module")
def mlp_out(mlp_folder: Path, tmp_path_factory) -> Path:
    """The shared tiny MLP folder (tests/conftest.py), a copy: its runs write into it."""
    return copy_folder(mlp_folder, tmp_path_factory.mktemp("json") / "mlp")


# ---------------------------------------------------------------------------- launches


@pytest.mark.slow  # a torchrun launch of several processes (make test-fast leaves it out)
def test_training_run_prints_one_document(mlp_out: Path) -> None:
    result = pipecc("run", str(mlp_out), "--json", "--schedule", "1f1b", "--steps", "3", "--verify",
                    "--timeout", "30")
    doc = document(result)
    plan = json.loads((mlp_out / "plan.json").read_text())
    check_shape(doc, plan, steps=3, warmup=1)
    assert (doc["schedule"], doc["microbatches"], doc["batch_size"]) == ("1f1b", 2, 8)
    assert [s["rank"] for s in doc["stages"]] == [0, 1]
    for stage in doc["stages"]:
        assert stage["backward_s"] > 0 and stage["backward_samples"] == stage["forward_samples"]
    loose_bound(doc)
    assert doc["memory_source"] is None and all(s["peak_memory_bytes"] is None for s in doc["stages"])  # no --memory
    # the usual lines went to stderr, and nothing went wrong
    assert "step 2: loss" in result.stderr and "verify: outputs, loss and" in result.stderr
    assert "pipecc: error" not in result.stderr


@pytest.mark.slow  # a torchrun launch of several processes (make test-fast leaves it out)
def test_inference_folder_reports_no_backward(tmp_path: Path) -> None:
    out = compile_mlp(tmp_path / "infer", "--inference")
    doc = document(pipecc("run", str(out), "--json", "--steps", "3", "--warmup-steps", "2", "--timeout", "30"))
    check_shape(doc, json.loads((out / "plan.json").read_text()), steps=3, warmup=2)
    assert doc["schedule"] == "inference"
    assert all(s["backward_s"] == 0.0 and s["backward_samples"] == 0 for s in doc["stages"])
    loose_bound(doc)


# ---------------------------------------------------------------------------- in process


def test_interleaved_in_one_process_reports_each_stage(mlp_out: Path, capsys) -> None:
    """Without torchrun one process holds both stages (interleaved): one entry per stage, same rank."""
    assert dist.main([str(mlp_out), "--steps", "3", "--schedule", "interleaved", "--json"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    check_shape(doc, json.loads((mlp_out / "plan.json").read_text()), steps=3, warmup=1)
    assert doc["schedule"] == "interleaved"
    assert [(s["index"], s["rank"]) for s in doc["stages"]] == [(0, 0), (1, 0)]
    assert all(s["backward_s"] > 0 for s in doc["stages"])
    assert "step 2: loss" in captured.err


def test_json_needs_a_timed_step(mlp_out: Path, capsys) -> None:
    code, out, err = run_cli(["run", str(mlp_out), "--json", "--steps", "1"], capsys)
    assert code == 2 and out == ""
    assert err.startswith("pipecc: error: --json reports the steps after the 1 warm-up step") and err.count("\n") == 1


def test_help_lists_the_flags(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    text = capsys.readouterr().out
    assert "--json" in text and "--warmup-steps" in text


def test_document_from_figures() -> None:
    """Medians per stage, the step as the slowest rank's, a rank's wait on each of its stages."""
    plan = {"predicted_iteration_s": 0.5, "devices": [{"name": "a100"}, {"name": "u250"}],
            "stages": [{"index": 0, "device": 0, "forward_s": 0.1, "backward_s": 0.2},
                       {"index": 1, "device": 1, "forward_s": 0.3, "backward_s": 0.0},
                       {"index": 2, "device": 0, "forward_s": 0.1, "backward_s": 0.2}]}
    summaries = [{"rank": 1, "stages": [1], "forward": [[3.0, 1.0, 2.0]], "backward": [[]],
                  "step_s": [1.0, 4.0], "recv_wait_s": [0.5, 0.3], "warmup": 1},
                 {"rank": 0, "stages": [0, 2], "forward": [[1.0], [2.0]], "backward": [[1.0, 3.0], [4.0]],
                  "step_s": [2.0, 3.0], "recv_wait_s": [0.2, 0.4], "warmup": 1}]
    doc = run_document(summaries, plan, "interleaved", 2, 8)
    assert doc["step_s"] == {"median": 3.0, "all": [2.0, 4.0]}
    assert doc["samples_per_s"] == pytest.approx(8 / 3.0) and doc["predicted_step_s"] == 0.5
    stages = doc["stages"]
    assert [(s["index"], s["rank"], s["device"]) for s in stages] == [(0, 0, "a100"), (1, 1, "u250"), (2, 0, "a100")]
    assert [s["forward_s"] for s in stages] == [1.0, 2.0, 2.0]
    assert [s["backward_s"] for s in stages] == [2.0, 0.0, 4.0]
    assert [s["backward_samples"] for s in stages] == [2, 0, 1]
    assert [s["comm_wait_s"] for s in stages] == [pytest.approx(0.3), pytest.approx(0.4), pytest.approx(0.3)]
    assert run_document(summaries, {}, "1f1b", 2, 8)["stages"][0]["predicted_forward_s"] is None


def test_host_s_is_the_step_less_the_timed_actions_and_waits_per_micro_batch() -> None:
    """One rank, two micro-batches per step: (step 1.0 − wait 0.2 − 2·(0.1 + 0.2)) / 2 = 0.1 per
    micro-batch; never negative (a step that measures under its actions, timers overlapping)."""
    summary = {"rank": 0, "stages": [0], "forward": [[0.1] * 4], "backward": [[0.2] * 4],
               "step_s": [1.0, 1.0], "recv_wait_s": [0.2, 0.2], "warmup": 1}
    plan = {"stages": [{"index": 0, "device": 0}], "devices": [{"name": "cpu"}]}
    assert run_document([summary], plan, "1f1b", 2, 8)["stages"][0]["host_s"] == pytest.approx(0.1)
    summary["step_s"] = [0.5, 0.5]
    assert run_document([summary], plan, "1f1b", 2, 8)["stages"][0]["host_s"] == 0.0
