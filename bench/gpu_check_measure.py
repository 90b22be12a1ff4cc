"""Each stage of a compiled folder measured in this process, beside its plan (`gpu_check.py` step 4/5).

    measure_folder(OUT, device, reps=10, precision=None) -> {"stages": [...], ...}

For every stage of OUT (`stage_<i>/`, loaded as `pipecc run` loads it) on `device`:

* forward_s / backward_s: the median over `reps` timed calls (two untimed first) of one
  micro-batch's forward, and of the backward of its outputs (the loss on the last stage, ones as
  the outputs' gradient elsewhere), the CUDA stream synchronised before and after each, under
  torch.autocast when the folder was compiled with --precision (or `precision` says so). Inputs:
  the model file's example inputs at the micro-batch size, passed through the earlier stages.
* peak_memory_bytes (CUDA only, else None): `torch.cuda.max_memory_allocated` over what the plan
  counts for the stage (passes/simulate.py, targets/timing.py `StageMemory`): its weights moved to
  the device, their gradients and Adam's two moments (one `Adam.step`), and the activations of as
  many micro-batches as the folder's `schedule.txt` keeps in flight on that stage (each with its
  received inputs copied in), all forwards before any backward. The peak counter is reset per
  stage after one untimed warm-up step (so the kernels' workspaces are there, as in a run), and
  the figure is relative to the memory allocated before the stage's weights were moved in.

Beside each: the plan's `forward_s`, `backward_s` (per micro-batch) and `peak_memory_bytes` from
OUT/plan.json. The stage modules go back to the CPU after their measurement, so one GPU holds one
stage at a time.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import re
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16}


def model_file(out: Path) -> Any:
    """The model file pipecc.json names, imported under a private name."""
    marker = json.loads((out / "pipecc.json").read_text())
    spec = importlib.util.spec_from_file_location(f"gpu_check_model_{abs(hash(str(out)))}", marker["model_path"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def in_flight(out: Path, stages: int) -> list[int]:
    """[stage] the most micro-batches schedule.txt has forwarded and not yet backwarded on it."""
    most, now = [0] * stages, [0] * stages
    for line in (out / "schedule.txt").read_text().splitlines():
        if not line.startswith("rank"):
            continue
        for token in line.split(":", 1)[1].split():
            hit = re.fullmatch(r"(\d+)(F|B|W)(\d+)", token)
            if hit is None:
                continue
            s = int(hit.group(1))
            now[s] += 1 if hit.group(2) == "F" else -1 if hit.group(2) in ("B", "W") else 0
            most[s] = max(most[s], now[s])
    return most


def _amp(device: torch.device, dtype: torch.dtype | None) -> Any:
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def _leaves(values: list[Any], receives: list[dict], device: torch.device) -> list[Any]:
    """Fresh copies of a stage's received values on `device`, float tensors requiring grad."""
    out = []
    for v, port in zip(values, receives):
        if isinstance(v, torch.Tensor):
            v = v.detach().to(device)
            if port.get("requires_grad") and v.is_floating_point():
                v.requires_grad_(True)
        out.append(v)
    return out


def _roots(outs: tuple, last: bool, loss: Callable[[Any], torch.Tensor]) -> tuple[list, list | None]:
    if last:
        return [loss(outs[0] if len(outs) == 1 else outs)], None
    pairs = [(o, torch.ones_like(o)) for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
    return [o for o, _ in pairs], [g for _, g in pairs]


def measure_folder(out: Path, device: str, reps: int = 10, precision: str | None = None) -> dict[str, Any]:
    """Each stage of `out` timed (and, on CUDA, its peak memory measured) on `device` (module doc)."""
    from pipecc.runtime.stagefile import load_stage

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    marker = json.loads((out / "pipecc.json").read_text())
    plan = json.loads((out / "plan.json").read_text())
    precision = precision or marker.get("precision") or "fp32"
    amp = PRECISIONS.get(precision)
    n = int(marker["num_stages"])
    loaded = [load_stage(out / f"stage_{i}") for i in range(n)]
    m, batch = int(marker["microbatches"]), int(marker["batch_size"])
    mb = batch // m
    mod = model_file(out)
    args = marker.get("model_args") or {}
    torch.manual_seed(0)
    inputs = mod.example_inputs(mb, **args)
    target = mod.example_target(mb, **args).to(dev)
    inputs = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
    env = {d["name"]: inputs[d["index"]] for d in loaded[0][1]["model_inputs"]}
    received: list[list[Any]] = []
    with torch.no_grad():  # each stage's inputs, from the stages before it (kept on the CPU)
        for module, ports in loaded:
            names = [p["name"] for p in ports["receives"]]
            values = [env[k] for k in names]
            received.append(values)
            module.to(dev)
            with _amp(dev, amp):
                outs = module(*_leaves(values, ports["receives"], dev))
            module.to("cpu")
            env = {p["name"]: (o.detach().cpu() if isinstance(o, torch.Tensor) else o)
                   for p, o in zip(ports["sends"], outs)}
    flight = in_flight(out, n)

    def loss(o: Any) -> torch.Tensor:
        return mod.loss_fn(o.float() if isinstance(o, torch.Tensor) else o, target)

    rows = []
    for k, ((module, ports), values) in enumerate(zip(loaded, received)):
        last = k == n - 1
        if cuda:
            sync()
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated(dev)
        module.to(dev)
        opt = torch.optim.Adam(module.parameters(), lr=0.0)

        def fwd_bwd(count: int) -> None:
            kept = []
            for _ in range(count):
                with _amp(dev, amp):
                    outs = module(*_leaves(values, ports["receives"], dev))
                    kept.append(_roots(outs, last, loss))
            for roots, grads in kept:
                if roots:
                    torch.autograd.backward(roots, grads)

        fwd_bwd(1)  # warm-up: kernels chosen, workspaces allocated
        peak = None
        if cuda:
            opt.zero_grad(set_to_none=True)
            sync()
            torch.cuda.reset_peak_memory_stats(dev)
            fwd_bwd(max(1, flight[k]))
            opt.step()
            sync()
            peak = torch.cuda.max_memory_allocated(dev) - base
        fwd, bwd = [], []
        for _ in range(reps + 2):
            args_k = _leaves(values, ports["receives"], dev)
            sync()
            t0 = time.perf_counter()
            with _amp(dev, amp):
                outs = module(*args_k)
                sync()
                t1 = time.perf_counter()
                roots, grads = _roots(outs, last, loss)
            sync()
            t2 = time.perf_counter()
            if roots:
                torch.autograd.backward(roots, grads)
            sync()
            fwd.append(t1 - t0)
            bwd.append(time.perf_counter() - t2)
        opt.zero_grad(set_to_none=True)
        del opt
        module.to("cpu")
        s = plan["stages"][k]
        rows.append({"stage": k, "device": plan["devices"][int(s["device"])]["name"], "nodes": len(s["nodes"]),
                     "first": s["nodes"][0], "last": s["nodes"][-1], "in_flight": flight[k],
                     "plan_forward_s": s["forward_s"], "forward_s": statistics.median(fwd[2:]),
                     "plan_backward_s": s["backward_s"], "backward_s": statistics.median(bwd[2:]),
                     "plan_peak_memory_bytes": s["peak_memory_bytes"], "peak_memory_bytes": peak})
    return {"folder": str(out), "batch": batch, "microbatches": m, "schedule": marker.get("schedule"),
            "precision": precision, "devices": [d["name"] + (f"@{d['placement']}" if d.get("placement") else "")
                                                for d in plan["devices"]],
            "predicted_iteration_s": plan.get("predicted_iteration_s"), "stages": rows}


def same_cuts(a: Path, b: Path) -> bool:
    """Whether two compiled folders cut the model at the same nodes."""
    nodes = [[s["nodes"] for s in json.loads((f / "plan.json").read_text())["stages"]] for f in (a, b)]
    return nodes[0] == nodes[1]


def table(result: dict[str, Any]) -> list[str]:
    """Markdown rows: plan vs measured per stage (ms, MiB)."""
    def mib(x: Any) -> str:
        return "n/a" if x is None else f"{x / 2**20:.1f}"
    lines = ["| stage | device | nodes | in flight | forward ms: plan / measured | backward ms: plan / measured "
             "| peak MiB: plan / measured |", "|---|---|---|---:|---:|---:|---:|"]
    for s in result["stages"]:
        lines.append(f"| {s['stage']} | {s['device']} | {s['first']} … {s['last']} ({s['nodes']}) | {s['in_flight']} | "
                     f"{1e3 * s['plan_forward_s']:.3f} / {1e3 * s['forward_s']:.3f} | "
                     f"{1e3 * s['plan_backward_s']:.3f} / {1e3 * s['backward_s']:.3f} | "
                     f"{mib(s['plan_peak_memory_bytes'])} / {mib(s['peak_memory_bytes'])} |")
    return lines
