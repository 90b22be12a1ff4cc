"""A run's loss curve and throughput: ``pipecc inspect OUT --run RUN.json``.

RUN.json is the document ``pipecc run OUT --json`` prints (``pipecc.runtime.timing``, format
"pipecc-run"); its ``history`` has one entry per step the run executed, warm-up steps included,
in order::

    {"step": int, "loss": float | null, "wall_s": float, "samples_per_s": float, "lr": float | null}

``wall_s`` is the step's wall time, ``loss`` the loss the unsplit model reports for the step's
batch (null where the run computed none), ``lr`` the learning rate it stepped with. A loss that
is not finite (NaN or infinity: a run that diverged) is kept and shown as such.

``load_run`` reads RUN.json as untrusted data: a file that is not JSON, not a pipecc-run document,
of another version, without a history, or with an entry of the wrong type is a one-line error
naming the field. ``check_folder`` refuses a run of another plan than OUT's (plan.json's sha256).

``summary`` condenses it: the first, last and lowest loss, the median measured samples/s over the
steps after the warm-up, and the predicted samples/s (``batch_size / predicted_step_s``, where
the document has a prediction) with the cost model it came from (``basis``: the plan's
calibration, its profile, else the roofline of the devices' datasheet figures). ``history_text``
is the terminal view (a sparkline and every k-th step as a table), ``history_json`` the
machine-readable one; ``pipecc.report.html.report_with_run`` draws the curves. A run with
``--memory`` (``pipecc.runtime.memory``) also gets ``memory_text``: per stage the rank's measured
peak beside plan.json's, their ratio, its static bytes and where the peak was (``memory`` in
the JSON view; null without ``--memory``).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from pipecc.errors import PipeccError
from pipecc.report.formatting import count, human, printable, seconds, text_table

__all__ = ["basis", "check_folder", "history_json", "history_text", "load_run", "memory_text", "sparkline",
           "summary", "table_steps"]

FORMAT, VERSION = "pipecc-run", 1
MAKE = "give the file `pipecc run OUT --json > RUN.json` wrote"
BARS = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 60
TABLE_ROWS = 10


# ----------------------------------------------------------------------------- reading
def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _field(where: str, entry: dict[str, Any], i: int, key: str, *, null: bool, finite: bool = True) -> float | None:
    """``entry[key]`` checked: a number (>= 0 and finite where ``finite``), or None where ``null``."""
    value = entry.get(key)
    if value is None and null and key in entry:
        return None
    if not _is_number(value) or (finite and not (math.isfinite(value) and value >= 0)):
        want = "a number or null" if null and not finite else \
            "a non-negative number or null" if null else "a non-negative number"
        shown = json.dumps(value)[:40] if key in entry else "nothing"
        raise PipeccError(f"--run {where}: history[{i}] has {shown} for \"{key}\", not {want}; the file is damaged, "
                          "run the folder again with --json")
    return float(value)


def load_run(path: str | Path) -> dict[str, Any]:
    """RUN.json checked (module docstring), as {path, batch_size, microbatches, schedule,
    warmup_steps, predicted_step_s, plan, history: [{step, loss, wall_s, samples_per_s, lr}]}."""
    where = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise PipeccError(f"--run {where}: cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise PipeccError(f"--run {where} is not text (not UTF-8); {MAKE}") from None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise PipeccError(f"--run {where} is not valid JSON ({e}); {MAKE}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise PipeccError(f"--run {where} is not a `pipecc run --json` document (no \"format\": \"{FORMAT}\"); {MAKE}")
    if data.get("version") != VERSION:
        raise PipeccError(f"--run {where} is version {json.dumps(data.get('version'))[:20]} of the run document, "
                          f"this pipecc reads {VERSION}; run the folder again with --json")
    if "history" not in data:
        raise PipeccError(f"--run {where} has no \"history\" (a run from a pipecc that did not record each step's "
                          "loss); run the folder again with `pipecc run OUT --json > RUN.json`")
    history = data["history"]
    if not isinstance(history, list):
        raise PipeccError(f"--run {where}: \"history\" is not a list of steps; the file is damaged, run the folder "
                          "again with --json")
    if not history:
        raise PipeccError(f"--run {where}: \"history\" is empty (the run executed no step); run with --steps 1 or more")
    batch = data.get("batch_size")
    if not _is_number(batch) or batch != int(batch) or batch < 1:
        raise PipeccError(f"--run {where}: \"batch_size\" is {json.dumps(batch)[:40]}, not a positive whole number; "
                          "the file is damaged, run the folder again with --json")
    warmup = data.get("warmup_steps", 0)
    if not _is_number(warmup) or warmup != int(warmup) or warmup < 0:
        raise PipeccError(f"--run {where}: \"warmup_steps\" is {json.dumps(warmup)[:40]}, not a whole number >= 0; "
                          "the file is damaged, run the folder again with --json")
    predicted = data.get("predicted_step_s")
    if predicted is not None and not (_is_number(predicted) and math.isfinite(predicted) and predicted >= 0):
        raise PipeccError(f"--run {where}: \"predicted_step_s\" is {json.dumps(predicted)[:40]}, not a non-negative "
                          "number or null; the file is damaged, run the folder again with --json")
    steps = []
    for i, entry in enumerate(history):
        if not isinstance(entry, dict):
            raise PipeccError(f"--run {where}: history[{i}] is not an object {{\"step\", \"loss\", \"wall_s\", "
                              "\"samples_per_s\", \"lr\"}; the file is damaged, run the folder again with --json")
        step = entry.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise PipeccError(f"--run {where}: history[{i}] has {json.dumps(step)[:40]} for \"step\", not a whole "
                              "number >= 0; the file is damaged, run the folder again with --json")
        if steps and step <= steps[-1]["step"]:
            raise PipeccError(f"--run {where}: history[{i}] is step {step}, after step {steps[-1]['step']}: the steps "
                              "are not in order; the file is damaged, run the folder again with --json")
        steps.append({"step": step, "loss": _field(where, entry, i, "loss", null=True, finite=False),
                      "wall_s": _field(where, entry, i, "wall_s", null=False),
                      "samples_per_s": _field(where, entry, i, "samples_per_s", null=False),
                      "lr": _field(where, entry, i, "lr", null=True)})
    plan = data.get("plan") if isinstance(data.get("plan"), dict) else None
    return {"path": where, "batch_size": int(batch), "microbatches": data.get("microbatches"),
            "schedule": str(data.get("schedule", "")), "warmup_steps": int(warmup),
            "predicted_step_s": float(predicted) if predicted else None, "plan": plan, "history": steps,
            "memory": _memory(where, data)}


def _bytes(where: str, stage: dict[str, Any], i: int, key: str) -> float | None:
    """``stage[key]``: a byte count (a number >= 0) or null/absent."""
    value = stage.get(key)
    if value is None:
        return None
    if not _is_number(value) or not (math.isfinite(value) and value >= 0):
        raise PipeccError(f"--run {where}: stages[{i}] has {json.dumps(value)[:40]} for \"{key}\", not a byte count "
                          "or null; the file is damaged, run the folder again with --json --memory")
    return float(value)


def _memory(where: str, data: dict[str, Any]) -> dict[str, Any] | None:
    """``--memory``'s figures (``pipecc.runtime.memory``): {source, stages: [{index, rank, replica,
    measured, predicted, static, at}]}; None when the run measured none."""
    source = data.get("memory_source")
    if source is None:
        return None
    if not isinstance(source, str):
        raise PipeccError(f"--run {where}: \"memory_source\" is {json.dumps(source)[:40]}, not a string; the file "
                          "is damaged, run the folder again with --json --memory")
    stages = data.get("stages")
    if not isinstance(stages, list) or not all(isinstance(s, dict) for s in stages):
        raise PipeccError(f"--run {where}: \"stages\" is not a list of objects; the file is damaged, run the folder "
                          "again with --json --memory")
    rows = []
    for i, st in enumerate(stages):
        index = st.get("index")
        if not isinstance(index, int) or isinstance(index, bool):
            raise PipeccError(f"--run {where}: stages[{i}] has {json.dumps(index)[:40]} for \"index\", not a whole "
                              "number; the file is damaged, run the folder again with --json --memory")
        at = st.get("peak_memory_at")
        rows.append({"index": index, "rank": st.get("rank"), "replica": st.get("replica", 0),
                     "measured": _bytes(where, st, i, "peak_memory_bytes"),
                     "predicted": _bytes(where, st, i, "predicted_peak_memory_bytes"),
                     "static": _bytes(where, st, i, "static_memory_bytes"),
                     "at": at if isinstance(at, str) else None})
    return {"source": source, "stages": rows}


def check_folder(run: dict[str, Any], out: str | Path) -> None:
    """Refuse a run of another plan than ``OUT/plan.json`` (both sha256s known and different)."""
    from pipecc.runtime.folder import plan_sha256
    ran = (run["plan"] or {}).get("sha256")
    here = plan_sha256(Path(out))
    if here is None:
        return
    if isinstance(ran, str) and ran and ran != here:
        raise PipeccError(f"--run {run['path']} is a run of another plan than {out}'s (plan.json sha256 {ran[:12]}, "
                          f"{out}'s {here[:12]}); give the folder that ran, or run {out} again with --json")


# ----------------------------------------------------------------------------- figures
def basis(run: dict[str, Any]) -> str:
    """Where the prediction came from: the plan's calibration, its profile, or the roofline."""
    plan = run["plan"] or {}
    devices = [str(d) for d in plan.get("devices") or []]
    names = sorted(set(devices))
    on = (" of " + ", ".join(f"{devices.count(n)}x {n}" if devices.count(n) > 1 else n for n in names)) \
        if names else ""
    calibration = plan.get("calibration")
    if isinstance(calibration, dict) and calibration.get("source"):
        return f"cost model calibrated from {calibration['source']}{on}"
    if plan.get("profile"):
        return f"cost model profiled in {plan['profile']}{on}"
    if not plan:
        return "cost model of the run's plan"
    return f"roofline cost model from datasheet figures{on}"


def _finite_losses(history: list[dict[str, Any]]) -> list[tuple[int, float]]:
    return [(h["step"], h["loss"]) for h in history if h["loss"] is not None and math.isfinite(h["loss"])]


def summary(run: dict[str, Any]) -> dict[str, Any]:
    """The figures both views print (module docstring)."""
    history = run["history"]
    losses = _finite_losses(history)
    timed = history[run["warmup_steps"]:] or history  # every step a warm-up one: all of them
    measured = float(statistics.median(h["samples_per_s"] for h in timed))
    step_s = run["predicted_step_s"]
    predicted = run["batch_size"] / step_s if step_s else None
    bad = next((h["step"] for h in history if h["loss"] is not None and not math.isfinite(h["loss"])), None)

    def at(pair: tuple[int, float] | None) -> dict[str, Any] | None:
        return {"step": pair[0], "loss": pair[1]} if pair else None
    return {"steps": len(history), "first_step": history[0]["step"], "last_step": history[-1]["step"],
            "warmup_steps": min(run["warmup_steps"], len(history)),
            "loss": {"first": at(losses[0] if losses else None), "last": at(losses[-1] if losses else None),
                     "min": at(min(losses, key=lambda p: (p[1], p[0])) if losses else None),
                     "recorded": sum(h["loss"] is not None for h in history), "not_finite_from": bad},
            "samples_per_s": {"measured_median": measured, "measured_steps": len(timed), "predicted": predicted,
                              "predicted_step_s": step_s, "basis": basis(run) if predicted else None,
                              "measured_over_predicted": measured / predicted if predicted else None},
            "wall_s": sum(h["wall_s"] for h in history)}


def sparkline(history: list[dict[str, Any]], width: int = SPARK_WIDTH) -> tuple[str, int]:
    """The finite losses as block characters, one per group of consecutive entries (their mean),
    the lowest ▁ and the highest █; a group without a finite loss is a space. Also the group size."""
    per = max(1, math.ceil(len(history) / width))
    means: list[float | None] = []
    for k in range(0, len(history), per):
        group = [h["loss"] for h in history[k:k + per] if h["loss"] is not None and math.isfinite(h["loss"])]
        means.append(sum(group) / len(group) if group else None)
    known = [m for m in means if m is not None]
    if not known:
        return "", per
    low, high = min(known), max(known)
    span = high - low
    marks = "".join(" " if m is None else BARS[0] if span <= 0 else
                    BARS[min(len(BARS) - 1, int((m - low) / span * len(BARS)))] for m in means)
    return marks, per


def table_steps(history: list[dict[str, Any]], rows: int = TABLE_ROWS) -> list[dict[str, Any]]:
    """Every k-th entry (k a 1-2-5 number giving at most ``rows`` rows) and the last one."""
    n = len(history)
    k = 1
    while math.ceil(n / k) > rows:
        k = next(m * 10 ** e for e in range(12) for m in (1, 2, 5) if m * 10 ** e > k)
    picked = history[::k]
    return picked if picked[-1] is history[-1] else picked + [history[-1]]


# ----------------------------------------------------------------------------- views
def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _rate(value: float) -> str:
    return f"{value:,.0f}/s" if value >= 100 else f"{value:.3g}/s"


def history_text(run: dict[str, Any]) -> str:
    """The terminal view: the run, the loss figures and sparkline, samples/s against the plan's
    prediction, and every k-th step as a table."""
    s = summary(run)
    history = run["history"]
    mb = run["microbatches"]
    head = (f"run {run['path']}: {count(s['steps'], 'step')} (steps {s['first_step']}..{s['last_step']}, "
            f"{s['warmup_steps']} warm-up), batch {run['batch_size']}"
            + (f" in {count(mb, 'micro-batch')}" if isinstance(mb, int) and mb > 0 else "")
            + (f", schedule {run['schedule']}" if run["schedule"] else "")
            + f", {seconds(s['wall_s'])} of steps")
    lines = [head]
    loss = s["loss"]
    if loss["first"] is None:
        lines.append(f"loss: none of the {count(s['steps'], 'step')} recorded a finite loss")
    else:
        lines.append(f"loss: first {_loss(loss['first']['loss'])} (step {loss['first']['step']}), last "
                     f"{_loss(loss['last']['loss'])} (step {loss['last']['step']}), min {_loss(loss['min']['loss'])} "
                     f"(step {loss['min']['step']})")
        marks, per = sparkline(history)
        if len(marks.strip()) > 1:
            each = f"each mark the mean of {count(per, 'step')}" if per > 1 else "one mark a step"
            lines.append(f"      {marks}  ({each}; ▁ lowest, █ highest)")
    if loss["not_finite_from"] is not None:
        lines.append(f"loss is not finite at step {loss['not_finite_from']} (the run diverged there)")
    rate = s["samples_per_s"]
    line = (f"samples/s: measured {_rate(rate['measured_median'])} (median of {count(rate['measured_steps'], 'step')}"
            f"{' after the warm-up' if rate['measured_steps'] < s['steps'] else ''})")
    if rate["predicted"]:
        line += (f"; predicted {_rate(rate['predicted'])} (batch {run['batch_size']} / predicted step "
                 f"{seconds(rate['predicted_step_s'])}; {rate['basis']}): measured "
                 f"{rate['measured_over_predicted']:.2f}x predicted")
    else:
        line += "; no prediction (the folder had no plan.json)"
    lines.append(line)
    rows = [[str(h["step"]), _loss(h["loss"]), _rate(h["samples_per_s"]), seconds(h["wall_s"]),
             "-" if h["lr"] is None else f"{h['lr']:.3g}"] for h in table_steps(history)]
    table = text_table(["step", "loss", "samples/s", "step time", "lr"], rows, left=0)
    return "\n".join(lines) + "\n\n" + table + memory_text(run)


MEMORY_SOURCES = {"live-tensors": "live tensor bytes on the CPU", "cuda-allocator": "the CUDA allocator's peak"}


def memory_text(run: dict[str, Any]) -> str:
    """The memory table of a ``--memory`` run (pipecc.runtime.memory): per stage the rank's
    measured peak, plan.json's, their ratio, the static bytes and where the peak was; "" without."""
    memory = run.get("memory")
    if not memory:
        return ""
    rows = []
    for r in memory["stages"]:
        measured, predicted = r["measured"], r["predicted"]
        ratio = f"{measured / predicted:.2f}" if measured is not None and predicted else "-"
        rows.append([str(r["index"]), str(r["rank"]), "-" if measured is None else human(measured, "B"),
                     "-" if predicted is None else human(predicted, "B"), ratio,
                     "-" if r["static"] is None else human(r["static"], "B"), r["at"] or "-"])
    what = MEMORY_SOURCES.get(memory["source"], memory["source"])
    head = (f"\n\nmemory per rank ({what}, the largest peak of the timed steps) vs plan.json's peak_memory_bytes "
            "(summed over the rank's stages):\n")
    return head + text_table(["stage", "rank", "measured", "predicted", "measured/predicted", "static", "peak at"],
                             rows, left=0, right_from=6)


def history_json(run: dict[str, Any]) -> dict[str, Any]:
    """``--format json``: the summary and the table's rows (a loss that is not finite as null, so
    the output stays strict JSON; ``loss.not_finite_from`` names the first such step)."""
    rows = [dict(h, loss=h["loss"] if h["loss"] is None or math.isfinite(h["loss"]) else None)
            for h in table_steps(run["history"])]
    return {"run": run["path"], **summary(run), "table": rows, "memory": run.get("memory")}


# ----------------------------------------------------------------------------- the report's section
CURVE_POINTS = 2000  # more steps than this: each point the mean of a group of steps


def _points(history: list[dict[str, Any]], key: str) -> tuple[list[tuple[float, float | None]], int]:
    """(step, value) per entry, or per group of consecutive entries (mean step, mean of the finite
    values; None where a group has none) when there are more than CURVE_POINTS; and the group size."""
    per = max(1, math.ceil(len(history) / CURVE_POINTS))
    points: list[tuple[float, float | None]] = []
    for k in range(0, len(history), per):
        group = history[k:k + per]
        values = [h[key] for h in group if h[key] is not None and math.isfinite(h[key])]
        points.append((sum(h["step"] for h in group) / len(group), sum(values) / len(values) if values else None))
    return points, per


def history_html(run: dict[str, Any]) -> str:
    """The report's "Training run" section: key figures, the loss curve, and samples/s per step
    against the predicted samples/s (the warm-up steps shaded)."""
    from pipecc.report.svg import B_COLORS, F_COLORS, esc, line_chart_svg
    s = summary(run)
    history = run["history"]
    warm = history[s["warmup_steps"] - 1]["step"] + 0.5 if s["warmup_steps"] else None
    shade = (history[0]["step"] - 0.5, warm, "warm-up steps (not in the median)") if warm is not None else None
    loss, rate = s["loss"], s["samples_per_s"]
    figures = [(_loss(loss["first"]["loss"]) if loss["first"] else "-", "first loss"),
               (_loss(loss["last"]["loss"]) if loss["last"] else "-", "last loss"),
               (f"{_loss(loss['min']['loss'])} @ {loss['min']['step']}" if loss["min"] else "-", "lowest loss, step"),
               (_rate(rate["measured_median"]), "samples per second, measured (median)"),
               (_rate(rate["predicted"]) if rate["predicted"] else "-", "samples per second, predicted")]
    fig_html = "".join(f'<div class="fig"><b>{esc(v)}</b><span>{esc(k)}</span></div>' for v, k in figures)
    loss_points, per = _points(history, "loss")
    grouped = f" (each point the mean of {count(per, 'step')})" if per > 1 else ""
    if loss["first"] is not None:
        curve = line_chart_svg([("loss", F_COLORS[0], loss_points)], x_label="step", y_label="loss",
                               name="loss-curve", shade=shade)
    else:
        curve = f"<p>None of the {count(s['steps'], 'step')} recorded a loss.</p>"
    levels = [(rate["measured_median"], f"median {_rate(rate['measured_median'])}", B_COLORS[2])]
    if rate["predicted"]:
        levels.append((rate["predicted"], f"predicted {_rate(rate['predicted'])}", "#2a7"))
    rates, _ = _points(history, "samples_per_s")
    throughput = line_chart_svg([("measured", B_COLORS[0], rates)], x_label="step", y_label="samples/s",
                                name="throughput", levels=levels, shade=shade, height=220, zero=True)
    against = (f"Predicted {esc(_rate(rate['predicted']))} is batch {run['batch_size']} / the predicted step "
               f"{esc(seconds(rate['predicted_step_s']))} ({esc(printable(rate['basis']))}); measured "
               f"{rate['measured_over_predicted']:.2f}x predicted." if rate["predicted"] else
               "The run's folder had no plan.json, so there is no prediction.")
    diverged = (f" The loss is not finite from step {loss['not_finite_from']} (the run diverged there)."
                if loss["not_finite_from"] is not None else "")
    return (f'<h2>Training run</h2>\n<p class="note">{esc(printable(run["path"]))}: {count(s["steps"], "step")} (steps '
            f'{s["first_step"]}..{s["last_step"]}, {s["warmup_steps"]} warm-up, shaded), batch {run["batch_size"]}, '
            f'{esc(seconds(s["wall_s"]))} of steps.{esc(diverged)}</p>\n<div class="figures">{fig_html}</div>\n'
            f'<h4>Loss per step{esc(grouped)}</h4>\n{curve}\n'
            f'<h4>Samples per second per step, measured against the plan\'s prediction</h4>\n{throughput}\n'
            f'<p class="note">Measured: the batch over each step\'s wall time; the median leaves out the warm-up '
            f'steps. {against}</p>\n' + memory_html(run))


def memory_html(run: dict[str, Any]) -> str:
    """The report's table of a ``--memory`` run (as ``memory_text``); "" without one."""
    from pipecc.report.svg import esc
    memory = run.get("memory")
    if not memory:
        return ""
    cells = []
    for r in memory["stages"]:
        measured, predicted = r["measured"], r["predicted"]
        ratio = f"{measured / predicted:.2f}" if measured is not None and predicted else "-"
        row = [str(r["index"]), str(r["rank"]), "-" if measured is None else human(measured, "B"),
               "-" if predicted is None else human(predicted, "B"), ratio,
               "-" if r["static"] is None else human(r["static"], "B"), r["at"] or "-"]
        cells.append("<tr>" + "".join(f"<td>{esc(printable(c))}</td>" for c in row) + "</tr>")
    head = "".join(f"<th>{h}</th>" for h in ("stage", "rank", "measured", "predicted", "measured / predicted",
                                             "static", "peak at"))
    what = MEMORY_SOURCES.get(memory["source"], memory["source"])
    return (f'<h4>Peak memory per rank, measured against plan.json</h4>\n<table><tr>{head}</tr>{"".join(cells)}</table>\n'
            f'<p class="note">Measured: {esc(printable(what))}, the largest peak of the timed steps; predicted: plan.json\'s '
            "peak_memory_bytes summed over the rank's stages; static: parameters, gradients, optimizer state and "
            "buffers (docs/memory.md).</p>\n")
