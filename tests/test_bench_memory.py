"""bench/bench_memory.py's pure functions on a hand-made `pipecc run --json --memory` document
(no runs): the per-stage rows and the markdown section."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_memory as bm  # noqa: E402

DOC = {"memory_source": "live-tensors",
       "stages": [{"index": 1, "rank": 1, "peak_memory_bytes": 2_400_000, "peak_memory_at": "1F3",
                   "static_memory_bytes": 1_600_000, "predicted_peak_memory_bytes": 2_000_000},
                  {"index": 0, "rank": 0, "peak_memory_bytes": 5_050_000, "peak_memory_at": "between actions",
                   "static_memory_bytes": 4_000_000, "predicted_peak_memory_bytes": 5_000_000}]}


def test_stage_rows() -> None:
    rows = bm.stage_rows(DOC, params=[1_000_000, 400_000])
    assert [r["index"] for r in rows] == [0, 1]
    assert rows[0]["ratio"] == pytest.approx(1.01) and rows[1]["ratio"] == pytest.approx(1.2)
    assert (rows[0]["static_predicted"], rows[0]["rest"], rows[0]["rest_predicted"]) == (4_000_000, 1_050_000,
                                                                                         1_000_000)
    assert rows[1]["peak_at"] == "1F3"


def test_markdown_counts_stages_within_the_target_and_shows_errors() -> None:
    case = {"model": "mlp", "variant": "1f1b", "stages": bm.stage_rows(DOC, [1_000_000, 400_000])}
    failed = {"model": "gpt", "variant": "bpipe", "error": "run: pipecc: error: boom"}
    report = {"meta": {"date": "2026-12-04", "machine": "x86_64, 2 cores", "torch": "2.13", "steps": 3},
              "cases": [case, failed]}
    text = bm.markdown(report, "python bench/bench_memory.py --models mlp")
    assert "**1 of 2 stages within 10%**" in text
    assert "| 1f1b | 2 | 1 | 1.10 | 1.01 | 1.20 |" in text
    assert "| mlp | 1f1b | 1 | 2.40 | 2.00 | 1.20 ✗ | 1F3 | 1.60 (1.60) | 0.80 (0.40) |" in text
    assert "| gpt | bpipe | – | run: pipecc: error: boom |" in text
    assert "Command: `python bench/bench_memory.py --models mlp`" in text
