"""Paper features, run at small size on CPU: does each feature's predicted gain show up on the machine?

    python bench/bench_papers_run.py [--cases umpipe,recompute,...] [--steps 8] [--warmup-steps 2]
                                     [--write bench/RESULTS.md] [--json out.json]

bench_papers.py compares the papers' techniques in the simulator at the papers' scale. This script
checks the same predictions against runs: for every case, two folders of one small zoo model on
the same CPU devices, compiled in this process through `pipecc.driver` with the feature off and on
(everything else pinned: schedule, micro-batches, replicas 1), planned on the costs `pipecc profile`
measures on these CPUs with one thread per rank (as bench_fidelity's "profiled" variant), each trained for a few steps with
`pipecc run OUT --json` (one process per rank, gloo, one thread per rank). It reports, per folder,
the predicted iteration and the measured median step, and per case the predicted speed-up of the
feature (off / on) beside the measured one. A case whose feature the planner declines (for
example BPipe where the estimate says it does not pay) is shown as declined, with the planner's
decision line, not forced. Then both sides are planned again with `--calibrate` on the "off"
folder's run document (the planner values the feature on the machine as the plain pipeline ran:
stage factors, the fixed part, the host work outside the stage timers) and run again: the
"calibrated" speed-ups. The reading counts, per basis, the cases whose predicted and measured
gains agree in sign and lie within 5 points (issue #20's bar).

This machine has 2 cores: ranks beyond two share them, so absolute step times are not what a
cluster would show; the ratio of two folders on the same devices is the figure to read.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fidelity import PIPECC, _env, _last_line, _model_arg_flags, run_json  # noqa: E402
from results import replace_section  # noqa: E402

GPT = dict(path="models/gpt.py", args=dict(n_layer=4, n_head=4, n_embd=128, vocab_size=1024,
                                           block_size=64, seq_len=64))
VGG = dict(path="models/vgg16.py", args=dict(width=0.25, image_size=32, num_classes=10, fc_dim=256))
MLP_DEEP = dict(path="models/mlp.py", args=dict(in_features=64, hidden=512, depth=8, num_classes=10))
MLP_WIDE = dict(path="models/mlp.py", args=dict(in_features=256, hidden=1024, depth=3, num_classes=256))

# name -> (what it measures, model, devices, batch, plan keywords for "off", for "on")
CASES: dict[str, dict[str, Any]] = {
    "umpipe": dict(title="UMPIPE: per-stage unequal micro-batches vs the planner's best equal split (gpipe)",
                   model=VGG, devices="2xcpu", batch=16,
                   off=dict(schedule="gpipe", microbatch_sizes="equal"),
                   on=dict(schedule="gpipe", microbatch_sizes="auto", umpipe_budget_s=3.0)),
    "umpipe-sizes": dict(title="UMPIPE with a fixed size list (10, 6) vs two equal micro-batches (8, 8), gpipe",
                         model=VGG, devices="2xcpu", batch=16,
                         off=dict(schedule="gpipe", microbatches=2, microbatch_sizes="equal"),
                         on=dict(schedule="gpipe", microbatch_sizes=[10, 6])),
    "recompute": dict(title="Activation recomputation: full vs none (1f1b)",
                      model=GPT, devices="2xcpu", batch=16,
                      off=dict(schedule="1f1b", microbatches=4, recompute="none"),
                      on=dict(schedule="1f1b", microbatches=4, recompute="full")),
    # BPipe needs p >= 4 to evict anything (p = 2: K = 2 = stage 0's stash); 4 ranks share 2 cores
    "bpipe": dict(title="BPipe: activation balancing on vs off (1f1b, 8 micro-batches, pairs (0, 3), (1, 2))",
                  model=MLP_DEEP, devices="4xcpu", batch=8,
                  off=dict(schedule="1f1b", microbatches=8, split_layers=False, activation_balancing="off"),
                  on=dict(schedule="1f1b", microbatches=8, split_layers=False, activation_balancing="on")),
    # planned on the roofline: on the measured CPU costs the planner keeps the single cut
    "bipartition": dict(title="Bi-Partition: separate forward/backward cuts (auto) vs the single cut (1f1b)",
                        model=MLP_WIDE, devices="2xcpu", batch=32, costs="roofline",
                        off=dict(schedule="1f1b", microbatches=8, split_layers=False, bipartition="off"),
                        on=dict(schedule="1f1b", microbatches=8, split_layers=False, bipartition="auto")),
}


# ----------------------------------------------------------------------------- report (pure)

def speedup(off_s: float, on_s: float) -> float:
    """off / on: above 1 the feature made the iteration faster."""
    return off_s / on_s if on_s > 0 else float("inf")


def case_summary(case: dict[str, Any]) -> dict[str, Any]:
    """Predicted and measured speed-ups of one case whose two folders both ran (`case` or its
    "calibrated" part)."""
    off, on = case["off"], case["on"]
    out = {"predicted": speedup(off["predicted_s"], on["predicted_s"])}
    if "step_s" in off and "step_s" in on:
        out["measured"] = speedup(off["step_s"], on["step_s"])
    return out


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def markdown(report: dict[str, Any], command: str) -> str:
    meta = report["meta"]
    lines = ["## Papers, run at small size on CPU: predicted vs measured gain of each feature", "",
             f"`{command}` on {meta['date']}, {meta['wall_s']:.0f} s, {meta['cpus']} CPUs, torch "
             f"{meta['torch']}, {meta['steps']} steps after {meta['warmup_steps']} warm-up (median step). "
             "Two folders per case, the feature off and on, everything else pinned, planned on "
             "`pipecc profile` costs measured with one thread per rank; predicted = the "
             "plan's `predicted_iteration_s`, measured = `pipecc run --json` median step. Speed-up = "
             "off / on (above 1: the feature helped). Calibrated: both sides planned again with "
             "`--calibrate` on the off folder's run document (measured stage times, fixed part and "
             "host work mapped onto the model) and run again.", "",
             "| case | model, devices, B | off: predicted / measured ms | on: predicted / measured ms "
             "| speed-up predicted | speed-up measured | calibrated: speed-up predicted / measured | note |",
             "|---|---|---|---|---|---|---|---|"]
    for c in report["cases"]:
        off, on = c["off"], c["on"]
        summ = case_summary(c) if "predicted_s" in off and "predicted_s" in on else {}
        note = c.get("note", "")
        for side in ("off", "on"):
            if "error" in c[side]:
                note = (note + "; " if note else "") + f"{side}: {c[side]['error']}"
        if c.get("costs") == "roofline":
            note = "planned on the roofline" + (f"; {note}" if note else "")
        cal = c.get("calibrated") or {}
        both = "predicted_s" in cal.get("off", {}) and "predicted_s" in cal.get("on", {})
        cal_summ = case_summary(cal) if both else {}
        if cal.get("note"):
            note = (note + "; " if note else "") + cal["note"]
        lines.append(f"| {c['name']} | {c['model']}, {c['devices']}, {c['batch']} "
                     f"| {_ms(off.get('predicted_s'))} / {_ms(off.get('step_s'))} "
                     f"| {_ms(on.get('predicted_s'))} / {_ms(on.get('step_s'))} "
                     f"| {_x(summ.get('predicted'))} | {_x(summ.get('measured'))} "
                     f"| {_x(cal_summ.get('predicted'))} / {_x(cal_summ.get('measured'))} | {note} |")
    lines.append("")
    for c in report["cases"]:
        lines.append(f"- **{c['name']}**: {c['title']}. " + " ".join(c.get("decisions", [])))
    lines += ["", reading(report["cases"])]
    return "\n".join(lines)


def reading(cases: list[dict[str, Any]]) -> str:
    """One sentence from the figures: how many measured speed-ups fall within 10 % of the
    prediction, and the case furthest from it."""
    both = [(c["name"], case_summary(c)) for c in cases
            if "predicted_s" in c["off"] and "predicted_s" in c["on"]]
    both = [(n, s) for n, s in both if "measured" in s]
    if not both:
        return "Reading: no case ran both folders."
    gaps = {n: s["measured"] / s["predicted"] for n, s in both}
    close = [n for n, g in gaps.items() if abs(g - 1) <= 0.10]
    worst = max(gaps, key=lambda n: abs(gaps[n] - 1))
    steps = [c[side]["step_s"] / c[side]["predicted_s"] for c in cases for side in ("off", "on")
             if c[side].get("step_s") and c[side].get("predicted_s")]
    return (f"Reading: the measured speed-up is within 10 % of the predicted one in {len(close)} of "
            f"{len(both)} cases ({', '.join(close) or 'none'}); furthest: {worst}, measured "
            f"{gaps[worst]:.2f}x of the predicted speed-up. Measured steps are {min(steps):.1f}-"
            f"{max(steps):.1f}x the predicted iterations (see the Fidelity section): a predicted "
            "speed-up holds only as far as both folders' costs are mispredicted alike. "
            + agreement(cases))


def agreement(cases: list[dict[str, Any]]) -> str:
    """Issue #20's bar per plan basis: how many cases' predicted and measured gains agree in
    sign (both above, both below or both at 1.00x within 1 point) and lie within 5 points."""
    out = []
    for label, get in (("profiled", lambda c: c), ("calibrated", lambda c: c.get("calibrated") or {})):
        rows = [case_summary(get(c)) for c in cases
                if "predicted_s" in get(c).get("off", {}) and "predicted_s" in get(c).get("on", {})]
        rows = [r for r in rows if "measured" in r]
        if not rows:
            continue
        sign = sum(_sign(r["predicted"]) == _sign(r["measured"]) for r in rows)
        near = sum(abs(r["predicted"] - r["measured"]) <= 0.05 for r in rows)
        out.append(f"{label}: sign agrees in {sign} of {len(rows)}, within 5 points in {near} of {len(rows)}")
    return ("Against the bar (same sign, within 5 points): " + "; ".join(out) + ".") if out else ""


def _sign(speedup_x: float) -> int:
    """+1 a gain, -1 a loss, 0 within a point of none."""
    return 0 if abs(speedup_x - 1) <= 0.01 else (1 if speedup_x > 1 else -1)


# ----------------------------------------------------------------------------- measuring

def profile(spec: dict[str, Any], devices: str, batch: int, out: Path, timeout: float) -> None:
    """`pipecc profile` with one thread, what each rank of `pipecc run` gets."""
    cmd = PIPECC + ["profile", spec["path"], "--devices", devices, "-b", str(batch), *_model_arg_flags(spec["args"]),
                    "-o", str(out), "--no-cache", "-q"]
    r = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"pipecc profile: {_last_line(r.stderr)}")


def compile_side(analysis: Any, spec: dict[str, Any], devices: str, kwargs: dict[str, Any],
                 folder: Path, profile_path: Path | None = None, calibrate: Any = None) -> dict[str, Any]:
    from pipecc import driver
    plan, graph = driver.plan(analysis, devices, replicas=1, **kwargs,
                              profile=str(profile_path) if profile_path else None, calibrate=calibrate)
    plan.model_path, plan.model_args = str((ROOT / spec["path"]).resolve()), dict(spec["args"])
    driver.compile(analysis, plan, graph, folder, force=True)
    return {"predicted_s": plan.predicted_iteration_s, "schedule": plan.schedule,
            "microbatches": plan.microbatches, "decisions": list(plan.decisions),
            "plan": json.loads(plan.dumps())}


# case name -> a check on the "on" plan: (used?, note). A feature the planner declined is
# reported as declined rather than measured as if it were on.
USED: dict[str, Callable[[dict[str, Any]], tuple[bool, str]]] = {
    "umpipe": lambda p: (bool(p.get("microbatch_sizes")), "equal sizes kept"),
    "umpipe-sizes": lambda p: (bool(p.get("microbatch_sizes")), "equal sizes kept"),
    "recompute": lambda p: (any(s.get("recompute") for s in p["stages"]), "no stage recomputes"),
    "bpipe": lambda p: (bool(p.get("activation_balancing")), "no pairs"),
    "bipartition": lambda p: (any(s.get("backward_nodes") for s in p["stages"]), "single cut kept"),
}


def run_case(name: str, tmp: Path, steps: int, warmup: int, timeout: float) -> dict[str, Any]:
    from pipecc import driver
    spec = CASES[name]
    model = spec["model"]
    analysis = driver.analyze(ROOT / model["path"], model_args=dict(model["args"]), batch_size=spec["batch"])
    case: dict[str, Any] = {"name": name, "title": spec["title"], "model": Path(model["path"]).stem,
                            "devices": spec["devices"], "batch": spec["batch"], "decisions": []}
    prof: Path | None = tmp / f"{name}-profile.json"
    if spec.get("costs") == "roofline":
        prof = None
    else:
        try:
            profile(model, spec["devices"], spec["batch"], prof, timeout)
        except Exception as exc:
            case["note"] = f"profile failed ({exc}): roofline costs"
            prof = None
    case["costs"] = "profiled" if prof else "roofline"
    off_doc = None
    for side in ("off", "on"):
        folder = tmp / f"{name}-{side}"
        try:
            info = compile_side(analysis, model, spec["devices"], spec[side], folder, prof)
        except Exception as exc:  # recorded: one failing case must not lose the rest
            case[side] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        plan = info.pop("plan")
        case[side] = info
        if side == "on":
            used, why = USED[name](plan)
            case["decisions"] = [d for d in info["decisions"] if _relevant(name, d)][:2]
            if not used:
                case["note"] = f"declined by the planner ({why})"
                continue
        doc = _measure(case[side], folder, steps, warmup, timeout)
        if side == "off":
            off_doc = doc
    if off_doc is not None and "step_s" in case["on"]:
        case["calibrated"] = _calibrated(name, analysis, model, spec, tmp, prof, off_doc, steps, warmup, timeout)
    print(f"{name}: {json.dumps({k: case[k] for k in ('off', 'on')}, default=str)[:300]}", file=sys.stderr)
    return case


def _measure(side: dict[str, Any], folder: Path, steps: int, warmup: int, timeout: float) -> dict[str, Any] | None:
    """`pipecc run --json` of one folder into `side` (its median step), retried once; the run
    document, None where both tries failed."""
    for _ in range(2):
        try:
            doc = run_json(folder, steps, warmup, timeout)
            side["step_s"] = doc["step_s"]["median"]
            side.pop("error", None)
            return doc
        except Exception as exc:
            side["error"] = f"{type(exc).__name__}: {exc}"
    return None


def _calibrated(name: str, analysis: Any, model: dict[str, Any], spec: dict[str, Any], tmp: Path,
                prof: Path | None, off_doc: dict[str, Any], steps: int, warmup: int,
                timeout: float) -> dict[str, Any]:
    """Both sides planned again with `--calibrate` on the "off" run (the planner values the
    feature on the machine as the plain pipeline ran) and measured."""
    out: dict[str, Any] = {}
    for side in ("off", "on"):
        folder = tmp / f"{name}-{side}-calibrated"
        try:
            info = compile_side(analysis, model, spec["devices"], spec[side], folder, prof, calibrate=off_doc)
        except Exception as exc:
            out[side] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        plan = info.pop("plan")
        out[side] = info
        if side == "on" and not USED[name](plan)[0]:
            out["note"] = f"declined when calibrated ({USED[name](plan)[1]})"
            continue
        _measure(info, folder, steps, warmup, timeout)
    return out


def _relevant(name: str, line: str) -> bool:
    keys = {"umpipe": ("(UMPIPE)",), "umpipe-sizes": ("(UMPIPE)",), "recompute": ("recomputes", "recompute:"),
            "bpipe": ("BPipe",), "bipartition": ("Bi-Partition",)}
    return any(k in line for k in keys.get(name, (name,)))


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pipecc-papers-run-") as tmp_name:
        cases = [run_case(n, Path(tmp_name), args.steps, args.warmup_steps, args.timeout) for n in args.cases]
    meta = {"date": datetime.date.today().isoformat(), "cpus": os.cpu_count(), "machine": platform.machine(),
            "torch": torch.__version__, "wall_s": time.perf_counter() - start, "steps": args.steps,
            "warmup_steps": args.warmup_steps}
    return {"meta": meta, "cases": cases}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    csv = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    parser.add_argument("--cases", type=csv, default=list(CASES), help=f"of {','.join(CASES)}")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300.0, help="per subprocess")
    parser.add_argument("--json", type=Path, help="also write every number here")
    parser.add_argument("--from-json", type=Path, help="render a --json dump instead of measuring")
    parser.add_argument("--write", type=Path, help="rewrite this file's papers-run section (RESULTS.md)")
    args = parser.parse_args(argv)
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        parser.error(f"unknown cases: {', '.join(unknown)}")
    if args.from_json:
        report = json.loads(args.from_json.read_text())
        command = report["meta"].get("command", "python bench/bench_papers_run.py")
    else:
        report = run(args)
        command = ("python bench/bench_papers_run.py " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
        report["meta"]["command"] = command
    text = markdown(report, command)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))
    if args.write:
        replace_section(args.write, "papers-run", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
