"""bench/bench_papers_run.py's pure report functions on a hand-made report (no runs)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_papers_run as bp  # noqa: E402

META = {"date": "2026-12-01", "wall_s": 12.0, "cpus": 2, "torch": "2.13.0", "steps": 8, "warmup_steps": 2}


def _case(name: str, off: dict, on: dict, note: str = "") -> dict:
    return {"name": name, "title": f"{name} title", "model": "gpt", "devices": "2xcpu", "batch": 16,
            "off": off, "on": on, "decisions": [f"{name} decision"], **({"note": note} if note else {})}


def test_speedup_is_off_over_on():
    assert bp.speedup(2.0, 1.0) == 2.0
    assert bp.speedup(1.0, 0.0) == float("inf")
    s = bp.case_summary(_case("x", {"predicted_s": 0.04, "step_s": 0.09}, {"predicted_s": 0.05, "step_s": 0.18}))
    assert s["predicted"] == pytest.approx(0.8) and s["measured"] == pytest.approx(0.5)


def test_markdown_shows_both_sides_declines_and_errors():
    report = {"meta": META, "cases": [
        _case("recompute", {"predicted_s": 0.04, "step_s": 0.09}, {"predicted_s": 0.05, "step_s": 0.18}),
        _case("umpipe", {"predicted_s": 0.04, "step_s": 0.09}, {"predicted_s": 0.04},
              note="declined by the planner (equal sizes kept)"),
        _case("bpipe", {"error": "RuntimeError: pipecc run: boom"}, {"predicted_s": 0.05}),
    ]}
    text = bp.markdown(report, "python bench/bench_papers_run.py")
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    assert "40.0 / 90.0" in rows["recompute"] and "50.0 / 180.0" in rows["recompute"]
    assert "0.80x" in rows["recompute"] and "0.50x" in rows["recompute"]
    assert "declined by the planner" in rows["umpipe"] and "| 1.00x | - |" in rows["umpipe"]
    assert "off: RuntimeError: pipecc run: boom" in rows["bpipe"]
    assert "- **recompute**: recompute title. recompute decision" in text


def test_reading_counts_cases_within_ten_percent():
    cases = [_case("a", {"predicted_s": 1.0, "step_s": 2.0}, {"predicted_s": 1.0, "step_s": 2.1}),
             _case("b", {"predicted_s": 1.0, "step_s": 1.0}, {"predicted_s": 0.5, "step_s": 1.0}),
             _case("c", {"predicted_s": 1.0}, {"predicted_s": 1.0})]
    text = bp.reading(cases)
    assert "within 10 % of the predicted one in 1 of 2 cases (a)" in text
    assert "furthest: b, measured 0.50x" in text


def test_calibrated_column_and_the_bar_counts():
    """The calibrated re-plans' speed-ups sit beside the plain ones, and the reading counts, per
    basis, the cases whose predicted and measured gains agree in sign and lie within 5 points."""
    good = _case("bipartition", {"predicted_s": 1.0, "step_s": 1.3}, {"predicted_s": 0.9, "step_s": 1.2})
    good["calibrated"] = {"off": {"predicted_s": 1.3, "step_s": 1.3}, "on": {"predicted_s": 1.2, "step_s": 1.2}}
    bad = _case("bpipe", {"predicted_s": 1.0, "step_s": 1.0}, {"predicted_s": 0.9, "step_s": 1.2})
    bad["calibrated"] = {"off": {"predicted_s": 1.0, "step_s": 1.0}, "on": {"predicted_s": 1.1},
                         "note": "declined when calibrated (no pairs)"}
    text = bp.markdown({"meta": META, "cases": [good, bad]}, "python bench/bench_papers_run.py")
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    assert "| 1.08x / 1.08x |" in rows["bipartition"]
    assert "| 0.91x / - |" in rows["bpipe"] and "declined when calibrated" in rows["bpipe"]
    assert "profiled: sign agrees in 1 of 2, within 5 points in 1 of 2" in text
    assert "calibrated: sign agrees in 1 of 1, within 5 points in 1 of 1" in text
    assert bp._sign(1.005) == 0 and bp._sign(1.2) == 1 and bp._sign(0.8) == -1
