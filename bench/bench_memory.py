"""Memory: does plan.json's `peak_memory_bytes` hold? Predicted vs measured peak per stage.

    python bench/bench_memory.py [--models mlp,gpt,...] [--variants gpipe,1f1b,...]
                                 [--steps 3] [--json rows.json] [--write bench/RESULTS.md]

For each model at a small size (bench_fidelity.MODELS: the zoo and the holdout-style models of
bench/models_holdout) and each variant (VARIANTS: the schedules gpipe, 1f1b, interleaved and
zb-h1 on two CPU ranks, BPipe (`--activation-balancing on`, 1f1b, four ranks) and full
recomputation (`--recompute on`, 1f1b)), the model is compiled with `pipecc compile` (4
micro-batches) and trained for a few steps with

    pipecc run OUT --json --memory --optimizer adam --steps 3

(one process per rank, gloo, one thread each). Adam, because the planner counts two optimizer
states per weight (`PlanOptions.optimizer_states`), and `pipecc run`'s default SGD keeps none.
The run document gives each rank's measured peak over its timed steps (`peak_memory_bytes`: on
the CPU a count of live tensor bytes, `pipecc.runtime.memory`), where it was reached
(`peak_memory_at`), the bytes held for the whole iteration (`static_memory_bytes`: parameters,
gradients, Adam's state, buffers) and plan.json's prediction beside them.

Reported per stage: measured and predicted peak and their ratio (measured / predicted; the
issue's target is every stage within 10 %, reported against, never tuned for), the measured
static bytes next to the stage module's parameters x (2 + 2 optimizer states) (the planner's
static bytes, unless a weight is shared between stages: the planner charges it to one stage),
and the rest of each (peak less static: activations and whatever else the step holds at its
peak). A rank holding two stages (interleaved) reports its
peak in both rows, as plan.json does.

`--autograd` (no runs): per model, what autograd saves for one micro-batch against what the cost
model charges as its stash, and what the loss saves on top (`autograd_rows`), its own section.

Internals: compile and run are the CLI in subprocesses; the functions under "report" are pure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fidelity import MODELS  # noqa: E402  (the same small sizes; loads the torchvision stand-in)
from results import replace_section  # noqa: E402

PIPECC = [sys.executable, "-m", "pipecc.cli"]
KEY = "memory"
TOLERANCE = 0.10  # the target: every stage within 10 %
OPTIMIZER_STATES = 2  # what the planner assumes (PlanOptions.optimizer_states): Adam's two moments

# variant -> (devices, compile flags)
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "gpipe": ("2xcpu", ["--schedule", "gpipe"]),
    "1f1b": ("2xcpu", ["--schedule", "1f1b"]),
    "interleaved": ("2xcpu", ["--schedule", "interleaved"]),
    "zb-h1": ("2xcpu", ["--schedule", "zb-h1"]),
    "bpipe": ("4xcpu", ["--schedule", "1f1b", "--activation-balancing", "on"]),
    "recompute": ("2xcpu", ["--schedule", "1f1b", "--recompute", "on"]),
    # bf16 autocast (messages in bf16, the plan priced so); only when asked (--variants 1f1b,1f1b-bf16)
    "1f1b-bf16": ("2xcpu", ["--schedule", "1f1b", "--precision", "bf16"]),
}
DEFAULT_VARIANTS = ["gpipe", "1f1b", "interleaved", "zb-h1", "bpipe", "recompute"]
# torch's CPU attention (scaled_dot_product_attention in float32) runs the flash kernel, which keeps
# the log-sum-exp, not the scores: the plan must assume the kernel the run uses (pipecc.cost)
COMMON_FLAGS = ["--flash-attention"]
DEFAULT_MODELS = ["mlp", "gpt", "tiny_cnn", "vgg16", "bert", "unet", "mobilenet", "two_input", "hf_gpt2"]
MICROBATCHES = 4


# ----------------------------------------------------------------------------- report (pure)

def stage_rows(doc: dict[str, Any], params: list[int]) -> list[dict[str, Any]]:
    """Per stage of a run document: measured and predicted peak, their ratio, static and rest."""
    rows = []
    for s in sorted(doc["stages"], key=lambda s: (s["index"], s.get("replica", 0))):
        measured, predicted = s["peak_memory_bytes"], s["predicted_peak_memory_bytes"]
        static_pred = params[s["index"]] * (2 + OPTIMIZER_STATES)
        rows.append({"index": s["index"], "rank": s["rank"], "measured": measured, "predicted": predicted,
                     "ratio": measured / predicted if predicted else float("inf"),
                     "peak_at": s.get("peak_memory_at"), "static": s["static_memory_bytes"],
                     "static_predicted": static_pred, "rest": measured - s["static_memory_bytes"],
                     "rest_predicted": predicted - static_pred})
    return rows


def rank_static(rows: list[dict[str, Any]]) -> dict[int, float]:
    """rank -> its stages' parameters x 4 summed (the measured static and peak are the rank's:
    interleaved ranks hold two stages)."""
    out: dict[int, float] = {}
    for r in rows:
        out[r["rank"]] = out.get(r["rank"], 0.0) + r["static_predicted"]
    return out


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f}"


def _within(ratio: float) -> bool:
    return abs(ratio - 1.0) <= TOLERANCE


def markdown(report: dict[str, Any], command: str) -> str:
    meta = report["meta"]
    lines = [f"## Memory: predicted vs measured peak per stage (`bench_memory.py`, {meta['date']})", "",
             f"Command: `{command}`", "",
             f"Machine: {meta['machine']}, torch {meta['torch']}; every run `pipecc run OUT --json --memory "
             f"--optimizer adam --steps {meta['steps']}` (warm-up 1), {MICROBATCHES} micro-batches, gloo, one "
             "thread per rank. Measured: the rank's largest count of live tensor bytes over its timed steps "
             "(`pipecc.runtime.memory`); predicted: plan.json's `peak_memory_bytes`. Ratio = measured / "
             f"predicted; target every stage within {TOLERANCE:.0%}. Static: parameters, gradients, Adam's "
             "state and buffers held all iteration, next to (the rank's stage modules' parameters x 4: what the planner "
             "counts when no weight is shared between stages); rest: peak less static, next to the prediction "
             "less that. Measured, predicted and static are the rank's (an interleaved rank's two stages show "
             "the same figures). "
             "MB = 10^6 bytes.", ""]
    rows = [(c, r) for c in report["cases"] if "stages" in c for r in c["stages"]]
    if rows:
        ratios = [r["ratio"] for _, r in rows]
        ok = sum(_within(x) for x in ratios)
        lines += [f"**{ok} of {len(ratios)} stages within {TOLERANCE:.0%}**; measured / predicted median "
                  f"{statistics.median(ratios):.2f}, range {min(ratios):.2f} – {max(ratios):.2f}.", ""]
        by_variant = {}
        for c, r in rows:
            by_variant.setdefault(c["variant"], []).append(r["ratio"])
        lines += ["| variant | stages | within 10 % | median ratio | min | max |", "|---|---|---|---|---|---|"]
        for v, rs in by_variant.items():
            lines.append(f"| {v} | {len(rs)} | {sum(_within(x) for x in rs)} | {statistics.median(rs):.2f} | "
                         f"{min(rs):.2f} | {max(rs):.2f} |")
        lines.append("")
    lines += ["| model | variant | stage | measured MB | predicted MB | ratio | peak at | static MB (params x 4) | "
              "rest MB (predicted) |", "|---|---|---|---|---|---|---|---|---|"]
    for c in report["cases"]:
        if "error" in c:
            lines.append(f"| {c['model']} | {c['variant']} | – | {c['error']} | | | | | |")
            continue
        held = rank_static(c["stages"])
        for r in c["stages"]:
            mark = "" if _within(r["ratio"]) else " ✗"
            lines.append(f"| {c['model']} | {c['variant']} | {r['index']} | {_mb(r['measured'])} | "
                         f"{_mb(r['predicted'])} | {r['ratio']:.2f}{mark} | {r['peak_at']} | "
                         f"{_mb(r['static'])} ({_mb(held[r['rank']])}) | "
                         f"{_mb(r['rest'])} ({_mb(r['predicted'] - held[r['rank']])}) |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- measuring

def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT / "tests" / "rank_site"), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}


def _model_args(args: dict[str, Any]) -> list[str]:
    return [x for k, v in args.items() for x in ("--model-arg", f"{k}={v}")]


def _last_line(text: str) -> str:
    lines = [x for x in text.strip().splitlines() if x.strip()]
    return lines[-1] if lines else "(no output)"


def stage_params(folder: Path) -> list[int]:
    """[stage] parameter bytes of the stage's module (what the planner multiplies by 2 + states)."""
    from pipecc.runtime.local import load_stage
    stages = json.loads((folder / "pipecc.json").read_text())["num_stages"]
    out = []
    for i in range(stages):
        module = load_stage(folder / f"stage_{i}")[0]
        out.append(sum(p.numel() * p.element_size() for p in module.parameters()))
    return out


def measure(model: str, variant: str, tmp: Path, steps: int, timeout: float) -> dict[str, Any]:
    spec = MODELS[model]
    devices, flags = VARIANTS[variant]
    folder = tmp / f"{model}-{variant}"
    case: dict[str, Any] = {"model": model, "variant": variant, "devices": devices, "flags": flags,
                            "args": spec["args"], "batch": spec["batch"]}
    compile_cmd = PIPECC + ["compile", spec["path"], "--devices", devices, "-b", str(spec["batch"]),
                            "-m", str(MICROBATCHES), "--replicas", "1", "--use-all-devices", *COMMON_FLAGS, "-o", str(folder),
                            "--force", "-q", *flags, *_model_args(spec["args"])]
    r = subprocess.run(compile_cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        return {**case, "error": "compile: " + _last_line(r.stderr or r.stdout)}
    run_cmd = PIPECC + ["run", str(folder), "--json", "--memory", "--optimizer", "adam", "--steps", str(steps),
                        "--timeout", "120", "-q"]
    r = subprocess.run(run_cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        return {**case, "error": "run: " + _last_line(r.stderr or r.stdout)}
    doc = json.loads(r.stdout)
    plan = json.loads((folder / "plan.json").read_text())
    case.update(schedule=plan["schedule"], microbatches=plan["microbatches"],
                virtual_stages=plan.get("virtual_stages", 1), stages=stage_rows(doc, stage_params(folder)))
    return case


def autograd_rows(models: list[str]) -> list[dict[str, Any]]:
    """Per model, one micro-batch (batch / MICROBATCHES) of the whole model in one process: the
    bytes the cost model charges as its stash (every node's `stash_bytes`, `pipecc.cost`) next to
    what autograd really saves for the backward (the distinct storages the forward hands to
    `torch.autograd.graph.saved_tensors_hooks`, parameters and buffers left out), and what the
    model file's loss_fn saves on top (the planner never sees the loss)."""
    import torch

    from pipecc import cost, driver
    from pipecc.ir.graph import META_COST
    rows = []
    for name in models:
        spec = MODELS[name]
        mb = max(1, spec["batch"] // MICROBATCHES)
        analysis = driver.analyze(ROOT / spec["path"], model_args=dict(spec["args"]), batch_size=mb)
        cost.recost_attention(analysis.graph, True)  # COMMON_FLAGS: the CPU's flash kernel
        charged = sum(float(n.meta[META_COST].values["stash_bytes"]) for n in analysis.graph.gm.graph.nodes
                      if META_COST in n.meta)
        model_spec = analysis.spec
        model = model_spec.model.train()
        weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}

        def saved_by(fn: Any) -> float:
            seen: dict[int, int] = {}

            def pack(t: torch.Tensor) -> torch.Tensor:
                st = t.untyped_storage()
                if st.data_ptr() not in weights:
                    seen.setdefault(st.data_ptr(), st.nbytes())
                return t
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = fn()
            return float(sum(seen.values())), out

        torch.manual_seed(0)
        inputs = model_spec.make_inputs(mb)
        # the model's inputs are the caller's (stage 0 holds the whole batch anyway): left out
        weights |= {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
        saved, out = saved_by(lambda: model(*inputs))
        loss_saved = None
        if model_spec.loss_fn is not None and model_spec.make_target is not None:
            target = model_spec.make_target(mb)
            loss_saved, _ = saved_by(lambda: model_spec.loss_fn(out, target))
        rows.append({"model": name, "microbatch": mb, "charged": charged, "saved": saved, "loss_saved": loss_saved})
        print(f"{name}: charged {charged / 1e6:.2f} MB, autograd saves {saved / 1e6:.2f} MB", file=sys.stderr)
    return rows


def autograd_markdown(rows: list[dict[str, Any]], command: str) -> str:
    lines = ["### What autograd saves against what the cost model charges", "",
             f"Command: `{command}`", "",
             "One micro-batch of the whole model in one process (train mode): `charged` is the cost model's "
             "stash (the sum of every node's `stash_bytes`, `pipecc.cost_saved`'s per-op rules, flash "
             "attention as the CPU runs it), `saved` the distinct storages autograd keeps for the backward "
             "(`torch.autograd.graph.saved_tensors_hooks`; parameters, buffers and the model's inputs left "
             "out), `loss_fn` what the model file's loss saves on top (charged to the last stage, "
             "`pipecc.frontend.loss_memory`). MB = 10^6 bytes.", "",
             "| model | micro-batch | charged MB | saved MB | saved / charged | loss_fn saves MB |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        loss = "-" if r["loss_saved"] is None else _mb(r["loss_saved"])
        ratio = r["saved"] / r["charged"] if r["charged"] else float("inf")
        lines.append(f"| {r['model']} | {r['microbatch']} | {_mb(r['charged'])} | {_mb(r['saved'])} | {ratio:.2f} | "
                     f"{loss} |")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    meta = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "torch": torch.__version__, "steps": args.steps}
    cases = []
    with tempfile.TemporaryDirectory(prefix="pipecc-bench-memory-") as tmp:
        for model in args.models:
            for variant in args.variants:
                case = measure(model, variant, Path(tmp), args.steps, args.timeout)
                cases.append(case)
                if "error" in case:
                    print(f"{model} {variant}: {case['error']}", file=sys.stderr)
                else:
                    shown = ", ".join(f"{r['ratio']:.2f}" for r in case["stages"])
                    print(f"{model} {variant}: measured/predicted per stage {shown}", file=sys.stderr)
    return {"meta": meta, "cases": cases}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    csv = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    parser.add_argument("--models", type=csv, default=DEFAULT_MODELS, help=f"of {','.join(MODELS)}")
    parser.add_argument("--variants", type=csv, default=DEFAULT_VARIANTS, help=f"of {','.join(VARIANTS)}")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600.0, help="per subprocess")
    parser.add_argument("--json", type=Path, help="also write every number here")
    parser.add_argument("--from-json", type=Path, help="render a --json dump instead of measuring")
    parser.add_argument("--write", type=Path, help="rewrite this file's memory section (RESULTS.md)")
    parser.add_argument("--autograd", action="store_true",
                        help="instead: what autograd saves per micro-batch against the cost model's stash "
                        "(in this process, no runs; its own section of --write)")
    args = parser.parse_args(argv)
    unknown = [m for m in args.models if m not in MODELS] + [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown models or variants: {', '.join(unknown)}")
    if args.autograd:
        command = ("python bench/bench_memory.py " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
        text = autograd_markdown(autograd_rows(args.models), command)
        print(text)
        if args.write:
            replace_section(args.write, KEY + "-autograd", text)
        return 0
    if args.from_json:
        report = json.loads(args.from_json.read_text())
        command = report["meta"]["command"]
    else:
        report = run(args)
        command = ("python bench/bench_memory.py " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
        report["meta"]["command"] = command
    text = markdown(report, command)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))
    if args.write:
        replace_section(args.write, KEY, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
