"""The measured timeline beside the predicted one: ``pipecc inspect OUT --trace trace.json``.

A trace (``pipecc run OUT --trace``, ``pipecc.runtime.trace``) is read as untrusted data
(``load_trace``: one-line errors for a file that is not JSON or not pipecc's trace), checked
against the folder (``check_matches``: the same pipeline ranks, stages and micro-batches, and
every rank ran the compute actions of OUT's schedule.txt in its order; a trace of another folder,
or of a run with ``--schedule``/``--microbatches``, is refused in one line), and one steady step
is taken from it (``steady_step``: of the steps after the warm-up ones, the one of median
length). ``measured_timeline`` turns that step into the simulator timeline's shape
(``artifacts.timeline_json``: pipeline ranks, events in seconds from the step's first action),
replica 0's ranks only, so the report's Gantt chart (``svg.gantt_svg``) draws it on the predicted
chart's time scale; ``differences`` names the compute actions whose measured time differs most
from the predicted one.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from pipecc.errors import PipeccError
from pipecc.report.formatting import seconds

__all__ = ["check_matches", "differences", "load_trace", "measured_timeline", "steady_step", "trace_json",
           "trace_text"]

COMPUTE = ("F", "B", "I", "W")
DRAWN = ("F", "B", "I", "W", "SEND_F", "SEND_B")  # what the Gantt chart draws (a RECV is idle time)


def load_trace(path: str | Path) -> dict[str, Any]:
    """The trace at ``path``, once it has the shape ``pipecc run --trace`` writes."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise PipeccError(f"--trace {path}: cannot read it ({e.strerror or e})") from None
    except (ValueError, RecursionError) as e:
        raise PipeccError(f"--trace {path} is not valid JSON ({e}); give the file `pipecc run OUT --trace` "
                          "wrote") from None
    other = data.get("otherData") if isinstance(data, dict) else None
    if not isinstance(other, dict) or other.get("format") != "pipecc-trace" or \
            not isinstance(data.get("traceEvents"), list):
        raise PipeccError(f"--trace {path} is not a pipecc trace (no otherData.format \"pipecc-trace\"); give the "
                          "file `pipecc run OUT --trace` wrote")
    if other.get("version") != 1:
        raise PipeccError(f"--trace {path} is version {other.get('version')!r} of the trace format, this pipecc "
                          "reads 1; trace the run again")
    try:
        ranks = {int(r["rank"]): r for r in other["ranks"]}
        events = []
        for e in data["traceEvents"]:
            if e.get("ph") != "X":
                continue
            args = e.get("args") or {}
            events.append({"name": str(e["name"]), "cat": str(e.get("cat", "")), "pid": int(e["pid"]),
                           "tid": int(e["tid"]), "ts": float(e["ts"]) / 1e6, "dur": float(e["dur"]) / 1e6,
                           "action": args.get("action"), "stage": args.get("stage"),
                           "microbatch": args.get("microbatch"), "step": int(args["step"])})
        meta = {k: int(other[k]) for k in ("num_ranks", "replicas", "num_stages", "microbatches", "steps",
                                           "warmup_steps")}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise PipeccError(f"--trace {path} is damaged ({type(e).__name__}: {e}); trace the run again") from None
    if any(not (math.isfinite(e["ts"]) and math.isfinite(e["dur"])) or e["dur"] < 0 for e in events):
        raise PipeccError(f"--trace {path} is damaged (an event without a finite start and length); trace the "
                          "run again")
    return {"path": str(path), "meta": meta, "schedule": str(other.get("schedule", "")), "ranks": ranks,
            "events": events, "clock": other.get("clock"), "barrier_skew_us": other.get("barrier_skew_us")}


def _pipeline_pids(trace: dict[str, Any]) -> dict[int, int]:
    """pid -> pipeline rank, replica 0's processes."""
    return {pid: int(r["pipeline_rank"]) for pid, r in trace["ranks"].items() if int(r.get("replica", 0)) == 0}


def steady_step(trace: dict[str, Any]) -> int:
    """The step to compare: of those after the warm-up, the one of median length (the longest of
    the ranks' step events); the last step when every step was a warm-up one."""
    length: dict[int, float] = {}
    for e in trace["events"]:
        if e["cat"] == "step":
            length[e["step"]] = max(length.get(e["step"], 0.0), e["dur"])
    if not length:
        raise PipeccError(f"--trace {trace['path']} holds no steps; trace a run with --steps 1 or more")
    steady = sorted((s for s in length if s >= trace["meta"]["warmup_steps"]), key=lambda s: (length[s], s))
    if not steady:
        return max(length)
    return steady[(len(steady) - 1) // 2] if len(steady) % 2 else steady[len(steady) // 2 - 1]


def _actions(trace: dict[str, Any], step: int) -> list[dict[str, Any]]:
    """Replica 0's schedule actions (and all-reduce waits) of ``step``, with their pipeline rank."""
    pids = _pipeline_pids(trace)
    return [{**e, "rank": pids[e["pid"]]} for e in trace["events"]
            if e["step"] == step and e["pid"] in pids and e["cat"] not in ("step", "optimizer")]


def check_matches(trace: dict[str, Any], compiled: Any, timeline: dict[str, Any]) -> None:
    """Refuse (one line) a trace that is not of ``compiled``'s pipeline as its schedule.txt runs it."""
    meta, plan, where = trace["meta"], compiled.plan, compiled.path
    hint = f"trace a run of {where} without --schedule or --microbatches (pipecc run {where} --trace FILE)"
    ours = (timeline["num_ranks"], len(plan.stages), compiled.microbatches)
    theirs = (meta["num_ranks"], meta["num_stages"], meta["microbatches"])
    if ours != theirs:
        raise PipeccError(f"--trace {trace['path']} is of another pipeline ({theirs[0]} ranks, {theirs[1]} stages, "
                          f"{theirs[2]} micro-batches; {where} has {ours[0]}, {ours[1]}, {ours[2]}); {hint}")
    step = steady_step(trace)
    ran = _actions(trace, step)
    for r in range(timeline["num_ranks"]):
        planned = [(e["kind"], e["stage"], e["microbatch"]) for e in sorted(
            (e for e in timeline["events"] if e["rank"] == r and e["kind"] in COMPUTE), key=lambda e: e["start"])]
        measured = [(e["action"], e["stage"], e["microbatch"]) for e in sorted(
            (e for e in ran if e["rank"] == r and e["action"] in COMPUTE), key=lambda e: e["ts"])]
        if planned != measured:
            first = next((i for i, (a, b) in enumerate(zip(planned, measured)) if a != b),
                         min(len(planned), len(measured)))
            said = " ".join(f"{k}{s}.{m}" for k, s, m in measured[first:first + 3]) or "nothing"
            want = " ".join(f"{k}{s}.{m}" for k, s, m in planned[first:first + 3]) or "nothing"
            raise PipeccError(f"--trace {trace['path']} ran another schedule than {where}'s schedule.txt: rank {r}'s "
                              f"compute action {first + 1} is {said} in the trace, {want} in the schedule; {hint}")


def measured_timeline(trace: dict[str, Any], step: int) -> dict[str, Any]:
    """``step`` of the trace in the simulator timeline's shape (seconds from the step's first action)."""
    ran = _actions(trace, step)
    ranks = trace["meta"]["num_ranks"]
    if not ran:
        raise PipeccError(f"--trace {trace['path']}: step {step} holds no actions of replica 0; trace the run again")
    t0 = min(e["ts"] for e in ran)
    end = max(e["ts"] + e["dur"] for e in ran)
    span = max(end - t0, 1e-12)
    events = [{"rank": e["rank"], "kind": e["action"], "stage": e["stage"], "microbatch": e["microbatch"],
               "start": e["ts"] - t0, "end": e["ts"] + e["dur"] - t0, "peer": None}
              for e in sorted(ran, key=lambda e: e["ts"]) if e["action"] in DRAWN]
    busy = [sum(e["end"] - e["start"] for e in events if e["rank"] == r and e["kind"] in COMPUTE)
            for r in range(ranks)]
    reduce_end = [max((e["ts"] + e["dur"] - t0 for e in ran if e["rank"] == r and e["cat"] == "all-reduce"),
                      default=0.0) for r in range(ranks)] if trace["meta"]["replicas"] > 1 else []
    return {"num_ranks": ranks, "iteration_s": span, "busy_s": busy, "allreduce_end_s": reduce_end,
            "bubble_fraction": 1.0 - sum(busy) / (ranks * span), "events": events, "step": step}


def differences(predicted: dict[str, Any], measured: dict[str, Any], top: int = 3) -> list[dict[str, Any]]:
    """The ``top`` compute actions by |measured - predicted| length, largest first."""
    planned = {(e["rank"], e["kind"], e["stage"], e["microbatch"]): e["end"] - e["start"]
               for e in predicted["events"] if e["kind"] in COMPUTE}
    rows = []
    for e in measured["events"]:
        key = (e["rank"], e["kind"], e["stage"], e["microbatch"])
        if key in planned:
            got = e["end"] - e["start"]
            rows.append({"rank": e["rank"], "stage": e["stage"], "kind": e["kind"], "microbatch": e["microbatch"],
                         "measured_s": got, "predicted_s": planned[key], "difference_s": got - planned[key]})
    rows.sort(key=lambda r: (-abs(r["difference_s"]), r["stage"], r["microbatch"]))
    return rows[:top]


def _stage_medians(predicted: dict[str, Any], measured: dict[str, Any]) -> list[str]:
    """Per stage and kind: the median measured and predicted length, for the summary."""
    lines = []
    kinds = sorted({(e["stage"], e["kind"]) for e in measured["events"] if e["kind"] in COMPUTE})
    for stage, kind in kinds:
        got = [e["end"] - e["start"] for e in measured["events"] if (e["stage"], e["kind"]) == (stage, kind)]
        want = [e["end"] - e["start"] for e in predicted["events"] if (e["stage"], e["kind"]) == (stage, kind)]
        if got and want:
            lines.append(f"  stage {stage} {kind}: measured {seconds(statistics.median(got))} vs "
                         f"{seconds(statistics.median(want))} predicted (median per micro-batch)")
    return lines


def breakdown(trace: dict[str, Any], measured: dict[str, Any]) -> list[str]:
    """Per pipeline rank: where its measured step went (compute, receive waits, posting sends,
    all-reduce, and the rest: before, between and after its actions), for the summary."""
    ran = _actions(trace, measured["step"])
    lines = []
    for r in range(measured["num_ranks"]):
        mine = [e for e in ran if e["rank"] == r]
        by: dict[str, float] = {}
        for e in mine:
            by[e["cat"]] = by.get(e["cat"], 0.0) + e["dur"]
        parts = [f"{cat} {seconds(by[cat])}" for cat in ("compute", "recv wait", "send", "all-reduce", "comm")
                 if cat in by]
        rest = measured["iteration_s"] - sum(by.values())
        lines.append(f"  rank {r}: " + ", ".join([*parts, f"not in an action {seconds(max(rest, 0.0))}"]))
    return lines


def describe(row: dict[str, Any]) -> str:
    sign = "+" if row["difference_s"] >= 0 else "-"
    return (f"stage {row['stage']} {row['kind']} mb {row['microbatch']}: measured {seconds(row['measured_s'])} vs "
            f"{seconds(row['predicted_s'])} predicted ({sign}{seconds(abs(row['difference_s']))})")


def trace_text(trace: dict[str, Any], predicted: dict[str, Any], measured: dict[str, Any],
               ascii_timeline: Any) -> str:
    """``pipecc inspect OUT --trace T``: both timelines as text, the stages' medians, the largest differences."""
    meta = trace["meta"]
    warm = meta["warmup_steps"]
    lines = [f"trace {trace['path']}: {meta['steps']} step(s), schedule {trace['schedule']}; compared: step "
             f"{measured['step']} (median length of the steps after {warm} warm-up step{'s' if warm != 1 else ''})",
             f"iteration: measured {seconds(measured['iteration_s'])} vs {seconds(predicted['iteration_s'])} predicted",
             "", "predicted " + ascii_timeline(predicted), "", "measured " + ascii_timeline(measured), "",
             "per stage:", *_stage_medians(predicted, measured),
             f"where each rank's measured step ({seconds(measured['iteration_s'])}) went:",
             *breakdown(trace, measured), "",
             "largest differences (measured - predicted):"]
    lines += [f"  {describe(row)}" for row in differences(predicted, measured)] or ["  none"]
    return "\n".join(lines)


def trace_json(trace: dict[str, Any], predicted: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    """``--format json``: the compared step, both iteration times and the largest differences."""
    return {"trace": trace["path"], "step": measured["step"], "steps": trace["meta"]["steps"],
            "warmup_steps": trace["meta"]["warmup_steps"], "measured_iteration_s": measured["iteration_s"],
            "predicted_iteration_s": predicted["iteration_s"], "differences": differences(predicted, measured)}
