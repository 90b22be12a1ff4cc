"""`pipecc inspect OUT --run RUN.json [--report HTML]`: a run's loss per step and its measured
samples/s beside the plan's predicted (issue #34 item 4), from hand-written run documents (the
"pipecc-run" document of `pipecc run OUT --json` with its "history": one entry per step), and the
one-line refusals of a bad RUN.json.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from helpers import copy_folder, run_cli
from pipecc.runtime.timing import plan_identity, read_plan

BATCH = 8


@pytest.fixture(scope="module")
def out(mlp_folder: Path, tmp_path_factory) -> Path:
    """The shared tiny MLP folder (tests/conftest.py: batch BATCH, 2 micro-batches), a copy."""
    return copy_folder(mlp_folder, tmp_path_factory.mktemp("inspect_run") / "mlp")


def history(losses: list[float | None], warm_rate: float = 10.0, rate: float = 1000.0) -> list[dict]:
    """One entry per loss: step i, the first step slow (a warm-up), then `rate` and `rate` * 1.1
    in turn (median `rate` * 1.05 over an even count), lr 0.1 halving at the half."""
    rows = []
    for i, loss in enumerate(losses):
        r = warm_rate if i == 0 else rate * (1.0 if i % 2 else 1.1)
        rows.append({"step": i, "loss": loss, "wall_s": BATCH / r, "samples_per_s": r,
                     "lr": 0.1 if i < len(losses) // 2 else 0.05})
    return rows


def document(out: Path, steps: list[dict], **changes) -> dict:
    """A run document as `pipecc run OUT --json` writes it, with `history` and `changes`."""
    plan = read_plan(out)
    doc = {"format": "pipecc-run", "version": 1, "schedule": plan["schedule"], "microbatches": 2,
           "batch_size": BATCH, "steps": len(steps) - 1, "warmup_steps": 1,
           "step_s": {"median": 0.008, "all": [0.008] * (len(steps) - 1)},
           "predicted_step_s": plan["predicted_iteration_s"], "samples_per_s": 1000.0, "stages": [],
           "plan": plan_identity(out, plan), "history": steps}
    doc.update(changes)
    return doc


def write(path: Path, doc) -> Path:
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return path


LOSSES = [2.0 - 0.03 * i + (0.05 if i == 30 else 0.0) for i in range(45)]  # 2.0 .. 0.68, a bump at 30


# ----------------------------------------------------------------------------- the text view
def test_text_shows_the_loss_and_samples_per_second_beside_the_predicted(out, tmp_path, capsys):
    run = write(tmp_path / "run.json", document(out, history(LOSSES)))
    code, text, err = run_cli(["inspect", str(out), "--run", str(run)], capsys)
    assert code == 0, err
    lines = text.splitlines()
    assert lines[0].startswith(f"run {run}: 45 steps (steps 0..44, 1 warm-up), batch 8 in 2 micro-batches")
    assert lines[1] == f"loss: first 2 (step 0), last {LOSSES[44]:.4g} (step 44), min {LOSSES[44]:.4g} (step 44)"
    spark = lines[2].split()[0]
    assert len(spark) == 45 and spark[0] == "█" and spark[-1] == "▁" and set(spark) <= set("▁▂▃▄▅▆▇█")
    predicted_step = read_plan(out)["predicted_iteration_s"]
    predicted = BATCH / predicted_step
    measured = 1050.0  # the median of 1000 and 1100 over the 44 steps after the warm-up (not the 10/s one)
    rate = next(line for line in lines if line.startswith("samples/s:"))
    assert rate.startswith(f"samples/s: measured {measured:,.0f}/s (median of 44 steps after the warm-up); "
                           f"predicted {predicted:,.0f}/s (batch 8 / predicted step ")
    assert "; roofline cost model from datasheet figures of 2x cpu)" in rate
    assert rate.endswith(f"measured {measured / predicted:.2f}x predicted")
    header = lines.index(next(line for line in lines if line.startswith("step ")))
    assert lines[header].split() == ["step", "loss", "samples/s", "step", "time", "lr"]
    steps = [int(line.split()[0]) for line in lines[header + 2:]]
    assert steps == [0, 5, 10, 15, 20, 25, 30, 35, 40, 44]  # every 5th and the last: at most 10 rows + 1
    row_30 = lines[header + 2 + 6].split()
    assert row_30[:3] == ["30", f"{LOSSES[30]:.4g}", "1,100/s"] and row_30[-1] == "0.05"


def test_json_has_the_same_figures(out, tmp_path, capsys):
    run = write(tmp_path / "run.json", document(out, history(LOSSES)))
    code, text, err = run_cli(["inspect", str(out), "--run", str(run), "--format", "json"], capsys)
    assert code == 0, err
    data = json.loads(text)
    assert data["steps"] == 45 and data["warmup_steps"] == 1
    assert data["loss"]["first"] == {"step": 0, "loss": 2.0}
    assert data["loss"]["min"] == {"step": 44, "loss": LOSSES[44]} == data["loss"]["last"]
    rate = data["samples_per_s"]
    assert rate["measured_median"] == pytest.approx(1050.0) and rate["measured_steps"] == 44
    assert rate["predicted"] == pytest.approx(BATCH / read_plan(out)["predicted_iteration_s"])
    assert rate["basis"].startswith("roofline cost model")
    assert [r["step"] for r in data["table"]] == [0, 5, 10, 15, 20, 25, 30, 35, 40, 44]


def test_the_basis_names_a_calibration_or_a_profile(out, tmp_path, capsys):
    doc = document(out, history(LOSSES))
    doc["plan"]["calibration"] = {"source": "measured.json"}
    code, text, _ = run_cli(["inspect", str(out), "--run", str(write(tmp_path / "c.json", doc))], capsys)
    assert code == 0 and "; cost model calibrated from measured.json of 2x cpu)" in text
    doc["plan"]["calibration"], doc["plan"]["profile"] = None, "cpu.profile.json"
    code, text, _ = run_cli(["inspect", str(out), "--run", str(write(tmp_path / "p.json", doc))], capsys)
    assert code == 0 and "; cost model profiled in cpu.profile.json of 2x cpu)" in text
    doc["plan"]["profile"] = "\x1b[2Jevil.json"  # names in a run document reach the terminal escaped
    html = tmp_path / "e.html"
    code, text, _ = run_cli(["inspect", str(out), "--run", str(write(tmp_path / "e.json", doc)), "--report", str(html)],
                            capsys)
    assert code == 0 and "\x1b" not in text and "profiled in \\x1b[2Jevil.json" in text
    assert "\x1b" not in html.read_text()


def test_a_run_without_a_prediction_or_losses_says_so(out, tmp_path, capsys):
    doc = document(out, history([None] * 5), predicted_step_s=None, plan=None)
    code, text, err = run_cli(["inspect", str(out), "--run", str(write(tmp_path / "r.json", doc))], capsys)
    assert code == 0, err
    assert "loss: none of the 5 steps recorded a finite loss" in text
    assert "; no prediction (the folder had no plan.json)" in text
    assert "▁" not in text and "█" not in text


def test_a_diverged_run_is_shown_not_refused(out, tmp_path, capsys):
    """NaN (json.dumps writes it as NaN) is a loss a run can report: shown, and named."""
    losses = [2.0, 1.5, 1.2, float("nan"), float("nan")]
    run = tmp_path / "nan.json"
    run.write_text(json.dumps(document(out, history(losses))))  # allow_nan: NaN as pipecc run writes it
    html = tmp_path / "r.html"
    code, text, err = run_cli(["inspect", str(out), "--run", str(run), "--report", str(html)], capsys)
    assert code == 0, err
    assert "loss: first 2 (step 0), last 1.2 (step 2), min 1.2 (step 2)" in text
    assert "loss is not finite at step 3 (the run diverged there)" in text
    assert re.search(r"^ +3 +nan ", text, re.M)
    assert "The loss is not finite from step 3" in html.read_text()
    code, text, err = run_cli(["inspect", str(out), "--run", str(run), "--format", "json"], capsys)
    data = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in the JSON output"))
    assert data["loss"]["not_finite_from"] == 3 and [r["loss"] for r in data["table"]] == [2.0, 1.5, 1.2, None, None]


def test_steps_need_not_start_at_zero(out, tmp_path, capsys):
    """A run resumed from a checkpoint records the steps it executed: 100..119."""
    steps = [dict(h, step=h["step"] + 100) for h in history([1.0 - 0.01 * i for i in range(20)])]
    code, text, err = run_cli(["inspect", str(out), "--run", str(write(tmp_path / "r.json", document(out, steps)))],
                              capsys)
    assert code == 0, err
    assert "20 steps (steps 100..119, 1 warm-up)" in text and "first 1 (step 100)" in text


def test_a_one_step_run_is_a_point(out, tmp_path, capsys):
    """One step, a warm-up one: its rate is the median (nothing else was measured), its loss a dot."""
    html = tmp_path / "one.html"
    run = write(tmp_path / "one.json", document(out, history([2.5])))
    code, text, err = run_cli(["inspect", str(out), "--run", str(run), "--report", str(html)], capsys)
    assert code == 0, err
    assert "1 step (steps 0..0, 1 warm-up)" in text and "measured 10/s (median of 1 step);" in text
    loss_svg = re.search(r'<svg class="chart line loss-curve".*?</svg>', html.read_text(), re.S).group(0)
    assert loss_svg.count("<circle") == 1 and not _polylines(loss_svg)


# ----------------------------------------------------------------------------- the report page
def _polylines(svg: str) -> list[list[tuple[float, float]]]:
    return [[tuple(map(float, p.split(","))) for p in m.split()]
            for m in re.findall(r'<polyline class="series"[^>]* points="([^"]*)"', svg)]


def test_report_draws_the_loss_curve_and_the_rates(out, tmp_path, capsys):
    losses = LOSSES[:20] + [None] + LOSSES[21:]  # a step without a loss breaks the line
    run = write(tmp_path / "run.json", document(out, history(losses)))
    html = tmp_path / "report.html"
    code, text, err = run_cli(["inspect", str(out), "--run", str(run), "--report", str(html)], capsys)
    assert code == 0, err
    assert text.splitlines()[-1] == f"wrote {html.resolve()}: the loss curve and the samples/s per step against the predicted"
    page = html.read_text()
    assert page.startswith("<!DOCTYPE html>") and "<h2>Pipeline schedule</h2>" in page  # the folder's page
    assert page.index("<h2>Training run</h2>") < page.index("<h2>Pipeline schedule</h2>")
    loss_svg = re.search(r'<svg class="chart line loss-curve".*?</svg>', page, re.S).group(0)
    lines = _polylines(loss_svg)
    assert [len(p) for p in lines] == [20, 24]
    ys = [y for p in lines for _, y in p]  # SVG y grows downwards: the first loss highest
    xs = [x for p in lines for x, _ in p]
    assert xs == sorted(xs) and ys[0] == min(ys) and ys[-1] == max(ys)
    rate_svg = re.search(r'<svg class="chart line throughput".*?</svg>', page, re.S).group(0)
    assert [len(p) for p in _polylines(rate_svg)] == [45]
    predicted = BATCH / read_plan(out)["predicted_iteration_s"]
    assert f"predicted {predicted:,.0f}/s" in rate_svg and "median 1,050/s" in rate_svg
    assert rate_svg.count('class="level"') == 2 and 'class="shade"' in rate_svg  # the warm-up step shaded
    assert f"measured {1050.0 / predicted:.2f}x predicted" in page


def test_a_long_run_is_drawn_in_groups_of_steps(out, tmp_path, capsys):
    losses = [3.0 * math.exp(-i / 2000) for i in range(5000)]
    run = write(tmp_path / "long.json", document(out, history(losses)))
    html = tmp_path / "long.html"
    code, text, err = run_cli(["inspect", str(out), "--run", str(run), "--report", str(html)], capsys)
    assert code == 0, err
    spark = text.splitlines()[2]
    assert len(spark.split()[0]) == 60 and "each mark the mean of 84 steps" in spark
    page = html.read_text()
    loss_svg = re.search(r'<svg class="chart line loss-curve".*?</svg>', page, re.S).group(0)
    assert [len(p) for p in _polylines(loss_svg)] == [1667] and "each point the mean of 3 steps" in page
    table = [line.split()[0] for line in text.splitlines() if re.match(r"^ *\d+ ", line)]
    assert table == [str(s) for s in range(0, 5000, 500)] + ["4999"]


# ----------------------------------------------------------------------------- bad input
def _entry(**changes) -> dict:
    return {**history([1.0, 0.9])[1], **changes}


BAD = [
    ("{not json", "is not valid JSON"),
    ("[1, 2]", 'is not a `pipecc run --json` document (no "format": "pipecc-run")'),
    ({"format": "pipecc-trace"}, 'is not a `pipecc run --json` document'),
    ({"version": 2}, "is version 2 of the run document, this pipecc reads 1"),
    ({"history": "NO-HISTORY"}, 'has no "history" (a run from a pipecc that did not record'),
    ({"history": {"step": 0}}, '"history" is not a list of steps'),
    ({"history": []}, '"history" is empty (the run executed no step); run with --steps 1 or more'),
    ({"history": [[0, 1.0]]}, "history[0] is not an object"),
    ({"history": [_entry(step=True)]}, 'history[0] has true for "step", not a whole number >= 0'),
    ({"history": [_entry(step=-1)]}, 'history[0] has -1 for "step"'),
    ({"history": [_entry(step="3")]}, 'history[0] has "3" for "step"'),
    ({"history": [_entry(step=3), _entry(step=3)]}, "history[1] is step 3, after step 3: the steps are not in order"),
    ({"history": [_entry(loss="low")]}, 'history[0] has "low" for "loss", not a number or null'),
    ({"history": [_entry(wall_s=-0.1)]}, 'history[0] has -0.1 for "wall_s", not a non-negative number'),
    ({"history": [_entry(wall_s=None)]}, 'history[0] has null for "wall_s", not a non-negative number'),
    ({"history": [{k: v for k, v in _entry().items() if k != "samples_per_s"}]},
     'history[0] has nothing for "samples_per_s"'),
    ({"history": [{k: v for k, v in _entry().items() if k != "loss"}]}, 'history[0] has nothing for "loss"'),
    ({"history": [_entry(lr="0.1")]}, 'history[0] has "0.1" for "lr", not a non-negative number or null'),
    ({"batch_size": 0}, '"batch_size" is 0, not a positive whole number'),
    ({"warmup_steps": "1"}, '"warmup_steps" is "1", not a whole number >= 0'),
    ({"predicted_step_s": "fast"}, '"predicted_step_s" is "fast", not a non-negative number or null'),
    ({"plan": {"sha256": "0" * 64}}, "is a run of another plan than"),
]


@pytest.mark.parametrize("content, message", BAD, ids=[m.split(" (")[0][:40] for _, m in BAD])
def test_a_bad_run_document_is_one_line(out, tmp_path, capsys, content, message):
    if isinstance(content, dict):
        doc = document(out, history(LOSSES))
        for key, value in content.items():
            if value == "NO-HISTORY":
                del doc[key]
            else:
                doc[key] = value
        content = json.dumps(doc)
    run = write(tmp_path / "bad.json", content)
    html = tmp_path / "r.html"
    code, text, err = run_cli(["inspect", str(out), "--run", str(run), "--report", str(html)], capsys)
    assert code == 1 and not text and not html.exists()
    assert err.startswith(f"pipecc: error: --run {run}") and err.count("\n") == 1, err
    assert message in err and "Traceback" not in err


def test_an_unreadable_run_is_one_line(out, tmp_path, capsys):
    code, _, err = run_cli(["inspect", str(out), "--run", str(tmp_path / "none.json")], capsys)
    assert code == 1 and err.startswith("pipecc: error: --run ") and "cannot read it" in err and err.count("\n") == 1
    write(tmp_path / "bin.json", "")
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe{")
    code, _, err = run_cli(["inspect", str(out), "--run", str(tmp_path / "bin.json")], capsys)
    assert code == 1 and "is not text" in err and err.count("\n") == 1


def test_report_needs_a_writable_file(out, tmp_path, capsys):
    run = write(tmp_path / "run.json", document(out, history(LOSSES)))
    code, text, err = run_cli(["inspect", str(out), "--run", str(run), "--report", str(tmp_path)], capsys)
    assert code == 1 and "--report" in err and "cannot write a file there" in err and not text


@pytest.mark.parametrize("extra, message", [
    (["--trace", "t.json"], "give one of --trace and --run"),
    (["--stage", "0"], "--run shows the whole run; leave out --stage"),
    (["--format", "dot"], "--run shows the whole run"),
    (["--onnx", "x"], "--run shows the whole run"),
])
def test_run_with_a_view_of_another_kind_is_a_usage_error(out, tmp_path, capsys, extra, message):
    run = write(tmp_path / "run.json", document(out, history(LOSSES)))
    code, _, err = run_cli(["inspect", str(out), "--run", str(run), *extra], capsys)
    assert code == 2 and message in err


def test_report_alone_names_both_sources(out, tmp_path, capsys):
    code, _, err = run_cli(["inspect", str(out), "--report", str(tmp_path / "r.html")], capsys)
    assert code == 2 and "give --trace FILE" in err and "--run RUN.json" in err
