"""Smoke test of bench/bench_balance.py: one tiny model at 2 devices gives sane rows, the exact
fluid bound agrees with a grid search, and only the balance section of RESULTS.md is rewritten."""
from __future__ import annotations

import importlib.util
import math
import sys

import numpy as np
import pytest

from helpers import ROOT, zoo_module, zoo_path
from pipecc import driver


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_balance", ROOT / "bench" / "bench_balance.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_balance"] = module  # dataclasses look their module up while executing
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_cnn():
    return driver.analyze(zoo_path("tiny_cnn"), model_args=dict(zoo_module("tiny_cnn").TINY),
                          batch_size=8)


@pytest.mark.parametrize("kind", ["homogeneous", "mixed", "gpu+fpga"])
def test_run_case_rows_are_sane(bench, tiny_cnn, kind):
    row = bench.run_case(tiny_cnn, "tiny_cnn", kind, 2, 8, auto=(kind == "homogeneous"))
    assert row["status"] == "ok", row["status"]
    assert row["devices"] == bench.device_spec(kind, 2) and row["microbatches"] == 4
    assert not row["notes"], row["notes"]  # the rebuilt problem agrees with the plan
    assert row["ratio"] >= 1 - 1e-9 and row["ratio"] <= row["planner_ratio"] * (1 + 1e-12)
    assert row["plan_s"] > 0 and row["iteration_s"] > 0 and row["pipe_memory_bytes"] > 0
    assert set(row["baselines"]) == set(bench.BASELINES)
    for name, b in row["baselines"].items():
        assert "error" not in b, (name, b)
        assert not b["beats_pipecc"], (name, b)
        assert b["unsupported"] or b["ratio"] >= row["ratio"] * (1 - 1e-9) or not b["fits_memory"]
    dp = row["dp"]
    assert 1 <= dp["n"] <= 2 and dp["fits"] and dp["serial_s"] >= dp["overlapped_s"] > 0
    assert dp["memory_bytes"] >= 4 * dp["param_bytes"] > 0
    if kind == "homogeneous":
        assert row["auto"]["iteration_s"] <= row["iteration_s"] * (1 + 1e-9)
    text = bench.render([row], None, "test", 0.0)
    assert "| tiny_cnn |" in text and "Costs are modelled, not measured" in text


def test_infeasible_case_is_recorded_not_raised(bench, tiny_cnn):
    row = bench.run_case(tiny_cnn, "tiny_cnn", "homogeneous", 64, 8, auto=False)
    assert row["status"].startswith("infeasible:")
    assert "not planned" in bench.render([row], None, "test", 0.0)


def test_fluid_bound_is_the_exact_two_type_optimum(bench):
    rng = np.random.default_rng(0)
    for _ in range(5):
        a, b = rng.random(12), rng.random(12) * 3
        b[rng.random(12) < 0.3] = 1e9  # "cannot run here" on the second type
        cost = np.array([a, a, a, b])
        s = np.linspace(0, 1, 100_001)[:, None]
        grid = float(np.minimum(s * a / 3, (1 - s) * b).sum(axis=1).max())
        got = bench.fluid_bound(cost, ["x", "x", "x", "y"])
        assert grid <= got * (1 + 1e-12) and math.isclose(got, grid, rel_tol=1e-4)
    assert bench.fluid_bound(np.array([[1.0, 2.0], [1.0, 2.0]]), ["x", "x"]) == 1.5


def test_layer_weights_count_top_level_modules(bench):
    names = [["wte"], ["blocks.0.ln_1"], ["blocks.0.attn.qkv"], ["blocks.0.add"],
             ["blocks.1.ln_1"], ["size"], ["lm_head"]]
    params = np.array([1, 1, 1, 0, 1, 0, 1.0])
    assert bench.layer_weights(names, params) == [1, 1, 0, 0, 1, 0, 1]


def test_write_section_keeps_other_sections(bench, tmp_path):
    path = tmp_path / "RESULTS.md"
    bench.write_section(path, "first\n")
    assert bench.BEGIN in path.read_text() and "first" in path.read_text()
    path.write_text("# R\n\n<!-- cost:begin -->\ncost\n<!-- cost:end -->\n\n"
                    f"{bench.BEGIN}\nold\n{bench.END}\n\ntail\n")
    bench.write_section(path, "new\n")
    text = path.read_text()
    assert "cost\n<!-- cost:end -->" in text and "tail" in text and "new" in text
    assert "old" not in text and text.count(bench.BEGIN) == 1


def test_big_graph_phase_runs(bench):
    big = bench.bench_big(20)
    assert big["nodes"] > 20 and big["plan_s"] > 0 and big["ratio"] >= 1 - 1e-9
    assert all(isinstance(v, float) for v in big["baselines"].values()), big["baselines"]
