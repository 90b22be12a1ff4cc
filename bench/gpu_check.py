"""GPU check, one prepared script: pipecc on cuda:0 against the CPU and against the h200 plan.

    python bench/gpu_check.py                       # on a machine with a GPU (cuda:0)
    python bench/gpu_check.py --device cpu --small  # smoke run of the same code on a CPU

For each model (VGG-16 and GPT-2 small at full width; `--small`: tiny sizes):

  1. numerics — `pipecc.compile(model, inputs, "2xh200@DEVICE")` (the drop-in module, both stages
     on one GPU), one forward + backward on the GPU, compared with the same model on the CPU:
     output and every parameter gradient (`torch.testing.assert_close`, fp32, TF32 off);
  2. stage times — each stage of the plan for `2xh200` timed on the GPU (forward and backward of
     one micro-batch, CUDA-synchronised medians) next to the plan's `forward_s`/`backward_s`
     from the h200 catalog entry (fp32: 67 TFLOP/s non-tensor-core peak, hence TF32 off).

Prints a markdown table and writes the numbers as JSON to `--out` (default `$OUT/gpu_check.json`
when `$OUT` is set, else `gpu_check.json`). Exit status 1 if a numerics check fails.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pipecc  # noqa: E402
from bench_runtime import stage_times  # noqa: E402
from pipecc import driver  # noqa: E402
from pipecc.backends.torch.stages import cut_stages  # noqa: E402
from pipecc.targets.devices import parse_devices  # noqa: E402
from pipecc.models import gpt, vgg16  # noqa: E402

# name -> (module, kwargs, batch): full size, and --small
CASES = {
    "vgg16": (vgg16, dict(width=1.0, image_size=224, num_classes=1000), 32),
    "gpt2": (gpt, dict(preset="gpt2", seq_len=512), 8),
}
SMALL = {
    "vgg16": (vgg16, dict(vgg16.TINY), 8),
    "gpt2": (gpt, dict(gpt.TINY, seq_len=16), 8),
}
MICROBATCHES = 4


def build(case: tuple) -> tuple[torch.nn.Module, tuple, torch.Tensor, Any]:
    module, kwargs, batch = case
    torch.manual_seed(0)
    return (module.build_model(**kwargs), module.example_inputs(batch, **kwargs),
            module.example_target(batch, **kwargs), module.loss_fn)


def numerics(case: tuple, device: str) -> dict[str, Any]:
    """The drop-in module on `device` vs the model on the CPU: output and gradients."""
    model, inputs, target, loss_fn = build(case)
    reference = copy.deepcopy(model)
    pm = pipecc.compile(model, inputs, f"2xh200@{device}", microbatches=MICROBATCHES, schedule="gpipe", replicas=1)
    out = pm(*[x.to(device) for x in inputs])
    loss_fn(out, target.to(device)).backward()
    ref_out = reference(*inputs)
    loss_fn(ref_out, target).backward()
    result: dict[str, Any] = {"devices": [str(d) for d in pm.pipeline_info()["devices"]], "ok": True,
                              "max_abs_out": (out.detach().cpu() - ref_out.detach()).abs().max().item()}
    failures = []
    try:
        torch.testing.assert_close(out.detach().cpu(), ref_out.detach(), rtol=1e-3, atol=1e-4)
    except AssertionError as e:
        failures.append(f"output: {str(e).splitlines()[0]}")
    worst = 0.0
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        worst = max(worst, (p.grad.cpu() - q.grad).abs().max().item())
        try:
            torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-3, atol=1e-4)
        except AssertionError as e:
            failures.append(f"grad {name}: {str(e).splitlines()[0]}")
    result.update(max_abs_grad=worst, failures=failures[:5], ok=not failures)
    return result


def timings(case: tuple, device: str, reps: int) -> dict[str, Any]:
    """Each stage of the 2xh200 plan timed on `device` vs the plan's prediction."""
    model, inputs, target, loss_fn = build(case)
    graph = driver.analyze_module(model, inputs)
    plan, graph = driver.plan(graph, parse_devices("2xh200"), microbatches=MICROBATCHES, schedule="gpipe", replicas=1)
    stages = cut_stages(graph, plan.stage_of())
    model.to(device)
    for s in stages:
        s.gm.to(device)
    measured = stage_times(stages, inputs, target, loss_fn, MICROBATCHES, reps=reps, device=torch.device(device))
    rows = [{"stage": s.index, "first": s.nodes[0], "last": s.nodes[-1], "nodes": len(s.nodes),
             "plan_forward_s": s.forward_s, "plan_backward_s": s.backward_s,
             "forward_s": t["forward_s"], "backward_s": t["backward_s"]}
            for s, t in zip(plan.stages, measured)]
    return {"batch": plan.batch_size, "microbatches": plan.microbatches, "split_layers": len(plan.split_layers),
            "predicted_iteration_s": plan.predicted_iteration_s, "stages": rows}


def markdown(report: dict[str, Any]) -> str:
    lines = [f"## GPU check: {report['device_name']} ({report['device']}), torch {report['torch']}, "
             f"TF32 off", ""]
    for name, r in report["models"].items():
        n, t = r["numerics"], r["timings"]
        verdict = "match" if n["ok"] else "DIFFER: " + "; ".join(n["failures"])
        lines += [f"### {name}", "",
                  f"Drop-in module on {', '.join(n['devices'])} vs CPU: {verdict} (max |Δ| output "
                  f"{n['max_abs_out']:.2e}, gradients {n['max_abs_grad']:.2e}; rtol 1e-3, atol 1e-4).", "",
                  f"Plan for 2xh200, batch {t['batch']}, {t['microbatches']} micro-batches; per micro-batch:", "",
                  "| stage | nodes | forward: plan / measured (ms) | backward: plan / measured (ms) |",
                  "|---|---|---:|---:|"]
        for s in t["stages"]:
            lines.append(f"| {s['stage']} | {s['first']} … {s['last']} ({s['nodes']}) | "
                         f"{1e3 * s['plan_forward_s']:.3f} / {1e3 * s['forward_s']:.3f} | "
                         f"{1e3 * s['plan_backward_s']:.3f} / {1e3 * s['backward_s']:.3f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--small", action="store_true", help="tiny models (a smoke run of this script)")
    parser.add_argument("--models", type=lambda s: s.split(","), default=list(CASES))
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", type=Path,
                        default=Path(os.environ["OUT"], "gpu_check.json") if os.environ.get("OUT") else Path("gpu_check.json"))
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device here; use --device cpu --small for a smoke run")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cases = SMALL if args.small else CASES
    report: dict[str, Any] = {
        "device": args.device, "torch": torch.__version__, "small": args.small,
        "device_name": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "CPU",
        "models": {}}
    for name in args.models:
        start = time.perf_counter()
        report["models"][name] = {"numerics": numerics(cases[name], args.device),
                                  "timings": timings(cases[name], args.device, args.reps)}
        print(f"{name}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    text = markdown(report)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    return 0 if all(r["numerics"]["ok"] for r in report["models"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
