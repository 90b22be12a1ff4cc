"""bench/bench_fidelity.py's pure functions on a hand-made `pipecc run --json` document (no runs)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_fidelity as bf  # noqa: E402

DOC = {"format": "pipecc-run", "version": 1, "schedule": "1f1b", "microbatches": 4, "batch_size": 32,
       "steps": 7, "warmup_steps": 3, "step_s": {"median": 0.011, "all": [0.011, 0.012, 0.010]},
       "predicted_step_s": 0.010, "samples_per_s": 2909.0,
       "stages": [{"index": 1, "rank": 1, "device": "cpu", "forward_s": 0.002, "backward_s": 0.004,
                   "forward_samples": 28, "backward_samples": 28, "predicted_forward_s": 0.001,
                   "predicted_backward_s": 0.002, "comm_wait_s": 0.0005},
                  {"index": 0, "rank": 0, "device": "cpu", "forward_s": 0.001, "backward_s": 0.002,
                   "forward_samples": 28, "backward_samples": 28, "predicted_forward_s": 0.001,
                   "predicted_backward_s": 0.002, "comm_wait_s": 0.001}]}


def _case(model: str = "vgg16") -> dict:
    equal = copy.deepcopy(DOC)
    equal["stages"][0]["forward_s"] = 0.004  # stage 1: 0.008 vs stage 0: 0.003
    return {"model": model, "devices": "2xcpu",
            "variants": {"analytic": {"run": DOC}, "profiled": {"run": DOC}, "equal": {"run": equal},
                         }}


def test_ratios_and_imbalance():
    s = bf.summarize(bf.check_run_doc(DOC))
    assert [r["index"] for r in s["stages"]] == [0, 1]          # sorted by index
    assert s["stages"][0]["ratio"] == pytest.approx(1.0)
    assert s["stages"][1]["ratio"] == pytest.approx(2.0)
    assert s["step_ratio"] == pytest.approx(1.1)
    assert s["worst_stage_ratio"] == pytest.approx(2.0)
    assert s["stages_within"] == 1
    assert s["imbalance_measured"] == pytest.approx(2.0)
    assert s["imbalance_predicted"] == pytest.approx(1.0)


def test_bad_documents_are_refused():
    with pytest.raises(ValueError):
        bf.check_run_doc({"format": "pipecc-run", "version": 2})
    broken = copy.deepcopy(DOC)
    del broken["stages"][0]["predicted_forward_s"]
    with pytest.raises(ValueError, match="predicted_forward_s"):
        bf.check_run_doc(broken)


def test_markdown_tables(tmp_path):
    report = {"meta": {"date": "2026-12-01", "cpus": 2, "machine": "x86_64", "torch": "2.x",
                       "load_before": [0.1, 0.1, 0.1], "load_after": [2.0, 1.0, 0.5], "wall_s": 1.0,
                       "schedule": "1f1b", "microbatches": 4, "steps": 10, "warmup_steps": 3, "gpu": False},
              "cases": [_case(), {"model": "mlp", "devices": "3xcpu",
                                  "variants": {"analytic": {"error": "RuntimeError: boom"}}}],
              "holdout": [{"model": "unet", "args": {}, "schedule": "gpipe", "microbatches": 64,
                           "split_layers": 0, "balance_ratio": 1.23},
                          {"model": "hf_bert", "args": {"n": 2}, "error": "PipeccError: nope"}]}
    text = bf.markdown(report, "python bench/bench_fidelity.py")
    assert "No GPU was available" in text
    assert "| vgg16 | 2xcpu | profiled | 4 | 10.00 / 11.00 | 1.10 | 1.00 / 2.00 ✗ | 1/2 | 1.00 / 2.00 |" in text
    assert "| vgg16 | 2xcpu | 2.00 / 2.67 | 11.00 / 11.00 | **missed** |" in text  # imbalance table
    assert "| mlp | 3xcpu | analytic | | not run: RuntimeError: boom |" in text
    assert "| unet | defaults | gpipe | 64 | 0 | 1.230 | **missed** |" in text
    assert "not planned: PipeccError: nope" in text
    assert "stages within ±15%: **3 of 4**" not in text  # analytic and profiled count separately
    assert "- profiled: stages within ±15%: **1 of 2**" in text
    path = tmp_path / "RESULTS.md"
    path.write_text("# Results\n\n<!-- other:begin -->\nkeep\n<!-- other:end -->\n")
    bf.write_section(path, text)
    bf.write_section(path, "second")  # rewrites its own section only
    out = path.read_text()
    assert "keep" in out and "second" in out and "No GPU" not in out
    assert out.count(bf.BEGIN) == 1


def test_retried_runs_are_reported():
    case = _case()
    case["variants"]["equal"]["failed_attempts"] = ["RuntimeError: pipecc run: rank 0 exited with code -6"]
    report = {"meta": {"date": "d", "cpus": 2, "machine": "m", "torch": "t", "load_before": [0.1] * 3,
                       "load_after": [0.1] * 3, "wall_s": 1.0, "schedule": "1f1b", "microbatches": 4,
                       "steps": 10, "warmup_steps": 3, "gpu": True}, "cases": [case], "holdout": []}
    text = bf.markdown(report, "cmd")
    assert "retried" in text and "1 of 3 (vgg16 2xcpu equal)" in text and "code -6" in text
    assert "No GPU" not in text
