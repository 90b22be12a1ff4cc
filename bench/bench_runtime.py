"""Training throughput on this machine: one process vs torch.distributed.pipelining vs pipecc.

    python bench/bench_runtime.py [--steps 30] [--warmup 3] [--models vgg16,gpt] [--write RESULTS.md]

For each model, in one run, training samples/s (forward, backward, SGD step; median step) of:

  (a)  the original model in one process;
  (b)  torch.distributed.pipelining with its own split: `pipeline(model, mb, split_spec=...)`
       at an equal number of layers per rank (what users of torch's API write by hand; see
       MODELS for the marker each model gets and why);
  (c)  torch.distributed.pipelining on pipecc's split: pipecc's stage modules in PipelineStage
       (`pipecc.interop.pipeline_stages`), so (d)/(c) compares the runtimes on identical modules;
  (c') torch's tracer cut at pipecc's split (`pipecc.interop.torch_pipe`), when the cut is on a
       module boundary (otherwise the reason is reported);
  (d)  pipecc's runtime (`PipelineRuntime`) on pipecc's split;

with 2 ranks (torchrun, gloo), the same schedule and micro-batches for (b)-(d), one thread per
rank (`OMP_NUM_THREADS=1`, `torch.set_num_threads(1)`); (a) runs on rank 0 while rank 1 sleeps in
the barrier, in the same rounds as the others. pipecc plans for `2xcpu` with this machine's CPU
measured (`measure_cpu` at one thread, best of three, `Catalog.with_measured_cpu`).
Each stage's forward and backward on one micro-batch are also timed in one process and shown
next to the plan's prediction. Variants run in rounds, in rotated order, so that load drifting
on a shared machine spreads over all of them.

Internals: the parent process plans and times the stages, then launches this file under
torchrun (`--worker JOB.json OUT_DIR`); every rank rebuilds the models and the plan from the job
(same seed, same measured catalog) and writes its step times and losses to OUT_DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import replace_section  # noqa: E402

from pipecc import driver  # noqa: E402
from pipecc.backends.torch.stages import cut_stages, ports_json  # noqa: E402
from pipecc.targets.devices import load_catalog, measure_cpu, parse_devices  # noqa: E402
from pipecc.models import gpt, vgg16  # noqa: E402

# name -> model module, model kwargs, batch, torch's own splits ({label: {module: "BEGINNING"}}, first = (b))
MODELS: dict[str, dict[str, Any]] = {
    # Uneven: early convs see large images with few channels, late ones small images with many.
    # (b): 8 of VGG-16's 16 weight layers per rank (conv1_1..conv4_1 | conv4_2..fc3), which is
    # also 19 of the model's 38 graph nodes. (b'): the middle index of `features` alone.
    "vgg16": dict(module=vgg16, kwargs=dict(width=0.25, image_size=32, num_classes=10, fc_dim=256),
                  batch=32, torch_splits={"8+8 weight layers (features.19)": {"features.19": "BEGINNING"},
                                          "middle of features (features.15)": {"features.15": "BEGINNING"}}),
    # Even: identical blocks; (b) puts n_layer/2 blocks on each rank.
    "gpt": dict(module=gpt, kwargs=dict(n_layer=6, n_head=4, n_embd=128, vocab_size=1024, block_size=64,
                                        seq_len=64),
                batch=16, torch_splits={"3+3 blocks (blocks.3)": {"blocks.3": "BEGINNING"}}),
}


# ----------------------------------------------------------------------------- shared

def build(name: str) -> tuple[torch.nn.Module, tuple, torch.Tensor, Callable]:
    """(model, inputs, target, loss_fn): the same in every process (seeded)."""
    spec = MODELS[name]
    module, kwargs, batch = spec["module"], spec["kwargs"], spec["batch"]
    torch.manual_seed(0)
    return (module.build_model(**kwargs), module.example_inputs(batch, **kwargs),
            module.example_target(batch, **kwargs), module.loss_fn)


def plan_model(model: torch.nn.Module, inputs: tuple, measured: dict, schedule: str, m: int, name: str):
    """pipecc's plan for 2 CPUs with `measured` figures; (plan, graph)."""
    cluster = parse_devices("2xcpu", load_catalog().with_measured_cpu(measured))
    graph = driver.analyze_module(model, inputs, model_name=name)
    return driver.plan(graph, cluster, microbatches=m, schedule=schedule, replicas=1)


def microbatch(values: tuple, m: int) -> tuple:
    return tuple(torch.tensor_split(v, m)[0] if isinstance(v, torch.Tensor) else v for v in values)


def stage_times(stages: list, inputs: tuple, target: torch.Tensor, loss_fn: Callable, m: int, *,
                reps: int = 10, device: torch.device = torch.device("cpu")) -> list[dict[str, float]]:
    """Median forward and backward seconds of each stage on the first micro-batch, in this process."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    values = [v.to(device) if isinstance(v, torch.Tensor) else v for v in microbatch(inputs, m)]
    target = microbatch((target,), m)[0].to(device)
    received = []
    with torch.no_grad():
        for s in stages:
            received.append(values)
            values = list(s.gm(*values))
    out = []
    for k, s in enumerate(stages):
        fwd, bwd = [], []
        for _ in range(reps + 2):
            args = [v.detach().requires_grad_(bool(getattr(p.value, "requires_grad", False)) and v.is_floating_point())
                    if isinstance(v, torch.Tensor) else v for v, p in zip(received[k], s.receives)]
            sync()
            t0 = time.perf_counter()
            outs = s.gm(*args)
            sync()
            t1 = time.perf_counter()
            if k == len(stages) - 1:
                roots, grads = [loss_fn(outs[0] if len(outs) == 1 else outs, target)], None
            else:
                pairs = [(o, torch.ones_like(o)) for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
                roots, grads = [o for o, _ in pairs], [g for _, g in pairs]
            sync()
            t2 = time.perf_counter()
            if roots:
                torch.autograd.backward(roots, grads)
            sync()
            fwd.append(t1 - t0)
            bwd.append(time.perf_counter() - t2)
        out.append({"forward_s": statistics.median(fwd[2:]), "backward_s": statistics.median(bwd[2:])})
    return out


# ----------------------------------------------------------------------------- worker (one rank)

def _torch_step(schedule: Any, rank: int, world: int, inputs: tuple, target: torch.Tensor,
                opt: torch.optim.Optimizer) -> Callable[[], float | None]:
    def step() -> float | None:
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(*inputs, return_outputs=False)
        elif rank == world - 1:
            schedule.step(target=target, losses=losses, return_outputs=False)
        else:
            schedule.step(return_outputs=False)
        opt.step()
        opt.zero_grad()
        return torch.stack(losses).mean().item() if losses else None
    return step


def _variants(job: dict, name: str, rank: int, world: int) -> dict[str, Callable | str]:
    """label -> a step function on this rank (or the reason the variant cannot run)."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, SplitPoint, pipeline

    from pipecc.interop import InteropError, pipeline_stages, torch_pipe
    from pipecc.runtime.engine import PipelineRuntime, RunConfig

    m, sched = job["microbatches"], job["schedule"]
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[sched]
    cpu = torch.device("cpu")
    variants: dict[str, Callable | str] = {}
    model, inputs, target, loss_fn = build(name)
    variants["(a) one process, original model"] = _single_step(model, inputs, target, loss_fn, rank)

    def torch_variant(stage: Any, model_inputs: tuple, target: torch.Tensor, loss_fn: Callable) -> Callable:
        opt = torch.optim.SGD(stage.submod.parameters(), lr=1e-3)
        return _torch_step(cls(stage, m, loss_fn=loss_fn), rank, world, model_inputs, target, opt)

    for i, (label, spec) in enumerate(MODELS[name]["torch_splits"].items()):
        model, inputs, target, loss_fn = build(name)
        pipe = pipeline(model, microbatch(inputs, m), split_spec={k: SplitPoint[v] for k, v in spec.items()})
        variants[f"(b{'′' * i}) torch, {label}"] = torch_variant(pipe.build_stage(rank, cpu), inputs, target, loss_fn)

    def ours() -> tuple:
        model, inputs, target, loss_fn = build(name)
        plan, graph = plan_model(model, inputs, job["measured"], sched, m, name)
        if [s.nodes for s in plan.stages] != job["models"][name]["stages"]:
            raise RuntimeError(f"rank {rank}: {name} planned differently from the parent process")
        return model, inputs, target, loss_fn, plan, graph

    model, inputs, target, loss_fn, plan, graph = ours()
    try:
        stage = pipeline_stages(plan, graph, rank, cpu, world=world)[0]
        variants["(c) torch PipelineStage, pipecc's stages"] = torch_variant(stage, inputs, target, loss_fn)
    except InteropError as e:
        variants["(c) torch PipelineStage, pipecc's stages"] = str(e)
    model, inputs, target, loss_fn, plan, graph = ours()
    try:
        pipe = torch_pipe(model, microbatch(inputs, m), plan, graph)
        variants["(c′) torch tracer, pipecc's cut"] = torch_variant(pipe.build_stage(rank, cpu), inputs, target, loss_fn)
    except InteropError as e:
        variants["(c′) torch tracer, pipecc's cut"] = str(e)
    model, inputs, target, loss_fn, plan, graph = ours()
    stages = cut_stages(graph, plan.stage_of())
    mine = stages[rank]
    opt = torch.optim.SGD(mine.gm.parameters(), lr=1e-3)
    runtime = PipelineRuntime(mine.gm, ports_json(mine, len(stages)), rank, world,
                              RunConfig(sched, m, timeout_s=300.0, device="cpu"), loss_fn, opt)

    def pipecc_step() -> float | None:
        loss = runtime.step(inputs if rank == 0 else None, target if rank == world - 1 else None)
        opt.step()
        opt.zero_grad()
        return loss

    variants["(d) pipecc runtime, pipecc's stages"] = pipecc_step
    return variants


def worker(job_path: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    job = json.loads(Path(job_path).read_text())
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict[str, Any] = {}
    for name in job["models"]:
        variants = _variants(job, name, rank, world)
        runnable = [k for k, v in variants.items() if callable(v)]
        times: dict[str, list[float]] = {k: [] for k in runnable}
        losses: dict[str, float | None] = {}
        per_round = max(1, job["steps"] // job["rounds"])
        for r in range(job["rounds"]):
            order = runnable[r % len(runnable):] + runnable[:r % len(runnable)]
            for label in order:
                for i in range((job["warmup"] if r == 0 else 0) + per_round):
                    dist.barrier()
                    t0 = time.perf_counter()
                    loss = variants[label]()
                    dist.barrier()
                    elapsed = time.perf_counter() - t0
                    if r == 0 and i == 0:
                        losses[label] = loss  # before any update: every variant should agree
                    if r > 0 or i >= job["warmup"]:
                        times[label].append(elapsed)
        results[name] = {"times": times, "first_loss": losses,
                         "skipped": {k: v for k, v in variants.items() if not callable(v)}}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- parent

def _single_step(model: torch.nn.Module, inputs: tuple, target: torch.Tensor, loss_fn: Callable,
                 rank: int) -> Callable[[], float | None]:
    """(a): the original model on rank 0 alone (the other rank waits in the barrier, asleep), so it
    is timed in the same rounds, under the same machine load, as the pipelines."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> float | None:
        if rank != 0:
            return None
        loss = loss_fn(model(*inputs), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()
    return step


def launch(job: dict, timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="pipecc-bench-") as tmp:
        job_path = Path(tmp, "job.json")
        job_path.write_text(json.dumps(job))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", "2", "--monitor-interval", "0.1",
               "--master-addr", "127.0.0.1", "--master-port", str(port), str(Path(__file__).resolve()),
               "--worker", str(job_path), tmp]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        result = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            sys.exit(f"bench: torchrun failed\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
        return {f"rank{r}": json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(2)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    # NOTE: best of three: on a shared machine one measurement can be much too low, and the plan
    # (even its split) follows it.
    runs = [measure_cpu() for _ in range(3)]
    measured = {**runs[0], "fp32_flops": max(r["fp32_flops"] for r in runs),
                "mem_bandwidth": max(r["mem_bandwidth"] for r in runs)}
    job: dict[str, Any] = {"steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
                           "schedule": args.schedule, "microbatches": args.microbatches,
                           "measured": measured, "models": {}}
    report: dict[str, Any] = {"job": job, "models": {}}
    for name in args.models:
        model, inputs, target, loss_fn = build(name)
        plan, graph = plan_model(model, inputs, measured, args.schedule, args.microbatches, name)
        job["models"][name] = {"stages": [s.nodes for s in plan.stages]}
        stages = cut_stages(graph, plan.stage_of())
        measured_stages = stage_times(stages, inputs, target, loss_fn, args.microbatches)
        report["models"][name] = {"plan": plan.to_json(), "stage_times": measured_stages}
    ranks = launch(job, args.timeout)
    for name in args.models:
        times = ranks["rank0"][name]["times"]
        first_loss = {k: v if v is not None else ranks["rank0"][name]["first_loss"][k]
                      for k, v in ranks["rank1"][name]["first_loss"].items()}
        report["models"][name].update(times=times, first_loss=first_loss, skipped=ranks["rank1"][name]["skipped"])
    report["load"] = {"before": load_before, "after": os.getloadavg(), "cpus": os.cpu_count()}
    report["torch"] = torch.__version__
    return report


# ----------------------------------------------------------------------------- report

def _sps(batch: int, times: list[float], best: bool = False) -> float:
    return batch / (min(times) if best else statistics.median(times))


def _spread(times: list[float]) -> str:
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return f"{1e3 * q[0]:.1f} / {1e3 * q[1]:.1f} / {1e3 * q[2]:.1f}"


def _ratio(sps: dict[str, tuple[float, float]], top: str, bottom: str) -> str:
    d = next((v for k, v in sps.items() if k.startswith(top)), None)
    x = next((v for k, v in sps.items() if k.startswith(bottom)), None)
    if d is None or x is None:
        return "n/a"
    return f"{d[0] / x[0]:.2f} (best steps: {d[1] / x[1]:.2f})"


NOTES = """Reading the tables: (c) and (d) run the very same stage modules (`pipecc.interop.pipeline_stages`
wraps pipecc's stages in PipelineStage), so d/c compares the two runtimes only; d/b compares the
whole system (pipecc's split + runtime) with torch's hand-split pipeline. Samples/s use the median
step; the best step is given too, as it is the least disturbed by other processes. The stage
table times each stage alone in one process; "plan" is pipecc's cost model for the measured CPU
(roofline: peak = a 512×512 fp32 matmul, bandwidth = a 32 MiB copy), which assumes every layer
runs at that matmul rate. On a machine with 2 CPUs, a 2-rank run needs both; any other load
slows it while (a) needs one, so d/a below 1 there says more about the machine than the pipeline."""


def markdown(report: dict[str, Any], command: str) -> str:
    job, load = report["job"], report["load"]
    # NOTE: the 1-minute load after the run includes the run's own two ranks (up to ~2)
    busy = load["before"][0] > 0.5 * load["cpus"] or load["after"][0] > 2 + 0.5 * load["cpus"]
    lines = [
        "## Runtime benchmark: pipecc vs torch.distributed.pipelining (2 ranks, CPU)",
        "",
        f"`{command}` — torch {report['torch']}, {load['cpus']} CPUs, load average "
        f"{load['before'][0]:.2f} / {load['before'][1]:.2f} / {load['before'][2]:.2f} before the run, "
        f"{load['after'][0]:.2f} after. Schedule {job['schedule']}, {job['microbatches']} micro-batches, "
        f"one thread per rank, gloo; {job['steps']} timed steps per variant after {job['warmup']} "
        f"warm-up, in {job['rounds']} rounds of rotated order. pipecc planned `2xcpu` with this CPU measured at "
        f"one thread ({job['measured']['fp32_flops'] / 1e9:.0f} GFLOP/s, "
        f"{job['measured']['mem_bandwidth'] / 1e9:.0f} GB/s).",
        "",
    ]
    if busy:
        lines += ["**The machine was shared and loaded during this run (load average above half the CPU "
                  "count before it, or above that plus the run's own two ranks after it): the timings are noisy. Repeat `python bench/bench_runtime.py` on a quiet machine "
                  "before quoting them.**", ""]
    for name, r in report["models"].items():
        spec, plan = MODELS[name], r["plan"]
        batch = spec["batch"]
        kwargs = ", ".join(f"{k}={v}" for k, v in spec["kwargs"].items())
        lines += [f"### {name} ({kwargs}; batch {batch})", "",
                  "| variant | samples/s (median step) | samples/s (best step) | step ms p25 / median / p75 "
                  "| first-step loss |", "|---|---:|---:|---:|---:|"]
        sps = {}
        for label, times in r["times"].items():
            sps[label] = (_sps(batch, times), _sps(batch, times, True))
            loss = r["first_loss"].get(label)
            lines.append(f"| {label} | {sps[label][0]:.1f} | {sps[label][1]:.1f} | {_spread(times)} | "
                         f"{'' if loss is None else f'{loss:.5f}'} |")
        for label, reason in r["skipped"].items():
            lines.append(f"| {label} | — | — | — | not run: {reason} |")
        bar = " (bar ≥ 1.2)" if name == "vgg16" else ""
        lines += ["", f"**d/c = {_ratio(sps, '(d)', '(c)')}** (bar ≥ 1.0); **d/b = {_ratio(sps, '(d)', '(b)')}**"
                      f"{bar}; d/a = {_ratio(sps, '(d)', '(a)')}; the plan predicts "
                      f"{batch / plan['predicted_iteration_s']:.1f} samples/s.", "",
                  "| stage | nodes | forward: plan / measured (ms) | backward: plan / measured (ms) | measured / plan |",
                  "|---|---|---:|---:|---:|"]
        planned, measured = [], []
        for s, t in zip(plan["stages"], r["stage_times"]):
            planned.append(s["forward_s"] + s["backward_s"])
            measured.append(t["forward_s"] + t["backward_s"])
            lines.append(f"| {s['index']} | {s['nodes'][0]} … {s['nodes'][-1]} ({len(s['nodes'])}) | "
                         f"{1e3 * s['forward_s']:.2f} / {1e3 * t['forward_s']:.2f} | "
                         f"{1e3 * s['backward_s']:.2f} / {1e3 * t['backward_s']:.2f} | "
                         f"{measured[-1] / planned[-1]:.2f} |")
        lines += ["", f"Per micro-batch of {batch // job['microbatches']}, one thread. Slowest / fastest stage "
                      f"(forward + backward): plan {max(planned) / min(planned):.2f}, measured "
                      f"{max(measured) / min(measured):.2f}.", ""]
    lines += [NOTES, ""]
    return "\n".join(lines)


BEGIN, END = "<!-- runtime:begin -->", "<!-- runtime:end -->"


def write_section(path: Path, text: str) -> None:
    """Rewrite this bench's section of `path` (bench/results.py)."""
    replace_section(path, "runtime", text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=lambda s: s.split(","), default=list(MODELS))
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3, help="timed steps are split over rounds")
    parser.add_argument("--schedule", choices=("gpipe", "1f1b"), default="gpipe")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--json", type=Path, help="also write the raw numbers here")
    parser.add_argument("--write", type=Path, help="rewrite this file's runtime section (RESULTS.md)")
    parser.add_argument("--worker", nargs=2, metavar=("JOB", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # NOTE: skip interpreter teardown: torch's C++ destructors abort a finished rank now and then
    report = run(args)
    command = "python bench/bench_runtime.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = markdown(report, command.strip())
    print(text)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    if args.write:
        write_section(args.write, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
