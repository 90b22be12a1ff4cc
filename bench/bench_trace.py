"""The cost of `pipecc run --trace` (pipecc.runtime.trace): step time with and without it.

    python bench/bench_trace.py [--rounds 3] [--steps 12] [--models tiny,mlp] [--json FILE]

Two measurements:

  (1) per action, in one process: ``TraceRecorder.run`` around an action that does nothing,
      against calling it directly (what the engine does without a recorder), best of 5 runs of
      100,000 actions: the recorder's own cost per action, free of any pipeline's noise;
  (2) end to end: for each model, a folder compiled for 2xcpu (``-b 8`` for the tiny MLP,
      ``-b 64`` for models/mlp.py at its defaults widened to hidden 1024), then ``pipecc run OUT
      --json --steps N`` launched alternately without and with ``--trace`` (``--rounds`` times
      each, the order rotated so load drifting on a shared machine spreads over both); the
      figure is the median over rounds of ``--json``'s median step time (after its 1 warm-up
      step). Both variants run ``--json``'s ActionTimer, so the difference is the trace's alone.

It prints a table and, with ``--json FILE``, writes the raw numbers; it writes nothing else
(docs/trace.md quotes a run of it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PIPECC = [sys.executable, "-c", "import sys; from pipecc.cli import main; sys.exit(main())"]
MODELS = {  # name -> (model-args, batch)
    "tiny": ({"in_features": 16, "hidden": 32, "depth": 3, "num_classes": 5}, 8),
    "mlp": ({"in_features": 256, "hidden": 1024, "depth": 6, "num_classes": 10}, 64),
}


def per_action_ns(n: int = 100_000, repeats: int = 5) -> dict[str, float]:
    """The recorder's cost per action (best of ``repeats``), against a direct call."""
    import torch

    from pipecc.ir.schedule.actions import Action, ActionKind
    from pipecc.runtime.trace import TraceRecorder

    rt = SimpleNamespace(device=torch.device("cpu"), mailbox=SimpleNamespace(inbox={}, outbox={}))
    recorder = TraceRecorder(rt, warmup_steps=0)
    action = Action(ActionKind.F, 0, 0)

    def nothing() -> None:
        return None

    def direct() -> float:
        t = time.perf_counter_ns()
        for _ in range(n):
            nothing()
        return (time.perf_counter_ns() - t) / n

    def traced() -> float:
        recorder.events.clear()
        recorder.begin_step()
        t = time.perf_counter_ns()
        for _ in range(n):
            recorder.run(action, nothing)
        elapsed = (time.perf_counter_ns() - t) / n
        recorder.end_step(0.0)
        return elapsed

    plain = min(direct() for _ in range(repeats))
    with_trace = min(traced() for _ in range(repeats))
    return {"direct_ns": plain, "traced_ns": with_trace, "overhead_ns": with_trace - plain}


def actions_per_rank_step(trace: Path) -> float:
    """The most schedule actions one rank ran in one step of ``trace``."""
    data = json.loads(trace.read_text())
    counts: dict[tuple[int, int], int] = {}
    for e in data["traceEvents"]:
        if e["ph"] == "X" and "action" in e.get("args", {}):
            key = (e["pid"], e["args"]["step"])
            counts[key] = counts.get(key, 0) + 1
    return float(max(counts.values()))


def compile_folder(name: str, out: Path) -> Path:
    args, batch = MODELS[name]
    argv = [*PIPECC, "compile", str(ROOT / "models" / "mlp.py"), "--devices", "2xcpu",
            "--replicas", "1", "-b", str(batch), "-o", str(out), "-q"]
    for k, v in args.items():
        argv += ["--model-arg", f"{k}={v}"]
    subprocess.run(argv, check=True, cwd=ROOT)
    return out


def step_time(out: Path, steps: int, trace: Path | None) -> float:
    argv = [*PIPECC, "run", str(out), "--json", "--steps", str(steps), "--timeout", "120"]
    if trace is not None:
        argv += ["--trace", str(trace)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"bench_trace: {' '.join(argv)} failed:\n{done.stderr[-2000:]}")
    return float(json.loads(done.stdout)["step_s"]["median"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12, help="steps per launch (the first is warm-up)")
    parser.add_argument("--models", type=lambda s: s.split(","), default=list(MODELS))
    parser.add_argument("--json", type=Path, help="also write the raw numbers here")
    args = parser.parse_args(argv)
    report: dict[str, Any] = {"per_action": per_action_ns(), "models": {}}
    pa = report["per_action"]
    print(f"per action: {pa['traced_ns']:.0f} ns traced vs {pa['direct_ns']:.0f} ns direct "
          f"(+{pa['overhead_ns']:.0f} ns per action; best of 5 x 100,000)")
    with tempfile.TemporaryDirectory(prefix="bench_trace_") as tmp:
        for name in args.models:
            out = compile_folder(name, Path(tmp) / name)
            plain, traced = [], []
            for r in range(args.rounds):
                order = (False, True) if r % 2 == 0 else (True, False)
                for on in order:
                    t = step_time(out, args.steps, Path(tmp) / f"{name}_{r}.json" if on else None)
                    (traced if on else plain).append(t)
            p, t = statistics.median(plain), statistics.median(traced)
            first = Path(tmp) / f"{name}_0.json"
            size, per_step = first.stat().st_size, actions_per_rank_step(first)
            bound = per_step * pa["overhead_ns"] * 1e-9  # the recorder's own cost in one step
            report["models"][name] = {"plain_step_s": plain, "traced_step_s": traced, "trace_bytes": size,
                                      "overhead": t / p - 1.0, "actions_per_rank_step": per_step,
                                      "recorder_s_per_step": bound}
            print(f"{name}: step {p * 1e3:.3f} ms without --trace, {t * 1e3:.3f} ms with "
                  f"({(t / p - 1.0):+.1%}; medians of {args.rounds} launches of {args.steps} steps; "
                  f"trace {size / 1e3:.0f} kB); the recorder's own cost: {per_step:.0f} actions per rank and "
                  f"step x {pa['overhead_ns']:.0f} ns = {bound * 1e3:.3f} ms ({bound / p:.2%} of the step)")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
