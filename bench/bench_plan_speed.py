"""Planner speed: GPT-2 (transformers) at 12/24/48/96 layers on 8 devices, and a 20,000-node
graph on 16 devices.

    .venv/bin/python bench/bench_plan_speed.py                      # every table; writes its RESULTS.md section
    .venv/bin/python bench/bench_plan_speed.py --layers 12 24 --blocks 0 --no-write
    .venv/bin/python bench/bench_plan_speed.py --profile 48       # where plan time goes (cProfile)
    .venv/bin/python bench/bench_plan_speed.py --sample 48        # the same, sampled (real shares)

Layer table: transformers' GPT2LMHeadModel (bench/models_holdout/hf_gpt2.py: random weights,
hidden 768, 12 heads, vocabulary 2048, sequence 64), analysed once per depth, planned on
8xa100 at batch 256 twice: `pipecc plan`'s defaults (--replicas auto, --activation-balancing
auto, fewer devices allowed) and `--replicas 1 --use-all-devices` (the plain pipeline on every
device: the layer-split search runs). Each plan is timed in wall seconds and in this process's
CPU seconds (time.process_time), since the machine may be shared: CPU seconds are the
planner's own work, wall seconds include waiting for the cores.

20,000-node graph: a chain of `blocks` residual blocks x + LayerNorm(ReLU(Linear(x))) (4 nodes
each), width 128, built on the meta device (no weight memory), input [32, 512, 128]; planned
on 16xa100 with 1F1B and 32 micro-batches, with and without the layer-split search.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "models_holdout"))

from pipecc import driver  # noqa: E402
from bench_cost import write_section  # noqa: E402

MODES = {"defaults": dict(replicas="auto", activation_balancing="auto", use_all_devices=False),
         "--replicas 1 --use-all-devices": dict(replicas=1, activation_balancing="auto",
                                                use_all_devices=True)}


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear, self.norm = nn.Linear(width, width), nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(torch.relu(self.linear(x)))


def cold() -> None:
    """Forget what an earlier plan in this process left in the planner's caches (solved
    partitions, substituted and evaluated cost expressions, built schedules), so each timing
    is a fresh `pipecc plan`'s."""
    from pipecc import cost
    from pipecc.ir.schedule import registry
    from pipecc.passes import partition, plan_problem, units
    cost._evaluate_at.cache_clear()
    partition.forget()
    units._SUBSTITUTED.clear()
    registry._build.cache_clear()
    plan_problem.inflight.cache_clear()


def timed(fn):
    cold()
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w0, time.process_time() - c0


def layer_rows(depths: list[int], devices: str, batch: int) -> list[str]:
    import hf_gpt2
    lines = ["| layers | nodes | analysis s (CPU s) | mode | plan wall s | plan CPU s | plan | predicted s/iter |",
             "|---|---|---|---|---|---|---|---|"]
    for n_layer in depths:
        model = hf_gpt2.build_model(n_layer=n_layer, n_head=12, n_embd=768, vocab_size=2048, n_positions=128)
        graph, aw, ac = timed(lambda: driver.analyze_module(model, hf_gpt2.example_inputs(2), model_name="gpt2"))
        for mode, fields in MODES.items():
            (plan, _), wall, cpu = timed(lambda: driver.plan(graph, devices, batch_size=batch, **fields))
            shape = (f"{plan.schedule}, m={plan.microbatches}, {len(plan.stages)} stage(s) x "
                     f"{plan.replicas}, {len(plan.split_layers)} split")
            lines.append(f"| {n_layer} | {len(graph.compute_nodes())} | {aw:.1f} ({ac:.1f}) | {mode} | "
                         f"**{wall:.1f}** | {cpu:.1f} | {shape} | {plan.predicted_iteration_s:.5g} |")
            print(lines[-1], flush=True)
    return lines


def profile(n_layer: int, devices: str, batch: int, top: int) -> None:
    """cProfile of each mode's plan (cold caches) on the n-layer GPT-2: the `top` functions by
    cumulative seconds among pipecc's own (cProfile's overhead inflates Python-heavy code:
    read the shares, not the seconds)."""
    import cProfile
    import io
    import pstats

    import hf_gpt2
    model = hf_gpt2.build_model(n_layer=n_layer, n_head=12, n_embd=768, vocab_size=2048, n_positions=128)
    graph = driver.analyze_module(model, hf_gpt2.example_inputs(2), model_name="gpt2")
    for mode, fields in MODES.items():
        cold()
        prof = cProfile.Profile()
        prof.enable()
        driver.plan(graph, devices, batch_size=batch, **fields)
        prof.disable()
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats("cumulative").print_stats(r"(passes|pipecc)/", top)
        print(f"### cProfile: {n_layer} layers, {mode}\n{out.getvalue()}", flush=True)


def sample(n_layer: int, devices: str, batch: int, top: int) -> None:
    """Where plan time goes without cProfile's overhead: a thread samples the planning thread's
    stack every 5 ms (`sys._current_frames`) during each mode's plan (cold caches); the `top`
    functions by share of samples, inclusive (on the stack) and self (running)."""
    import collections
    import threading

    import hf_gpt2
    model = hf_gpt2.build_model(n_layer=n_layer, n_head=12, n_embd=768, vocab_size=2048, n_positions=128)
    graph = driver.analyze_module(model, hf_gpt2.example_inputs(2), model_name="gpt2")
    me = threading.get_ident()
    for mode, fields in MODES.items():
        inclusive, own, total = collections.Counter(), collections.Counter(), [0]
        done = threading.Event()

        def sampler() -> None:
            while not done.wait(0.005):
                frame = sys._current_frames().get(me)
                total[0] += 1
                seen: set[str] = set()
                while frame is not None:
                    code = frame.f_code
                    key = "/".join(code.co_filename.split("/")[-2:]) + ":" + code.co_name
                    if not seen:
                        own[key] += 1
                    if key not in seen:
                        inclusive[key] += 1
                        seen.add(key)
                    frame = frame.f_back
        cold()
        thread = threading.Thread(target=sampler, daemon=True)
        c0 = time.process_time()
        thread.start()
        driver.plan(graph, devices, batch_size=batch, **fields)
        done.set()
        thread.join()
        print(f"### sampled: {n_layer} layers, {mode}: {time.process_time() - c0:.1f} s CPU, "
              f"{total[0]} samples")
        for name, counts in (("inclusive", inclusive), ("self", own)):
            for key, k in counts.most_common(top):
                print(f"{100 * k / max(total[0], 1):5.1f}% {name:9s} {key}")
        print(flush=True)


def block_rows(blocks: int) -> list[str]:
    with torch.device("meta"):
        model = nn.Sequential(*[Block(128) for _ in range(blocks)])
    graph, aw, ac = timed(lambda: driver.analyze_module(model, (torch.empty(32, 512, 128, device="meta"),)))
    out = [f"{len(graph.compute_nodes())} nodes; analysis (capture, fitted shapes, sympy costs): "
           f"{aw:.1f} s wall, {ac:.1f} s CPU", ""]
    for split in (True, False):
        (plan, _), wall, cpu = timed(lambda: driver.plan(graph, "16xa100", microbatches=32, schedule="1f1b",
                                                         split_layers=split, replicas=1))
        out.append(f"- `driver.plan` end to end, layer-split search {'on' if split else 'off'}: "
                   f"**{wall:.1f} s** wall, {cpu:.1f} s CPU, balance ratio {plan.balance_ratio:.3f}, "
                   f"{len(plan.split_layers)} split layers")
        print(out[-1], flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, nargs="*", default=[12, 24, 48, 96])
    parser.add_argument("--blocks", type=int, default=5000, help="0: no 20,000-node table")
    parser.add_argument("--devices", default="8xa100")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--profile", type=int, metavar="LAYERS",
                        help="print a cProfile breakdown of both modes at LAYERS layers, nothing else")
    parser.add_argument("--sample", type=int, metavar="LAYERS",
                        help="print a sampled breakdown (no cProfile overhead) at LAYERS layers, nothing else")
    parser.add_argument("--top", type=int, default=30, help="--profile, --sample: functions listed")
    args = parser.parse_args()
    if args.profile:
        profile(args.profile, args.devices, args.batch_size, args.top)
        return
    if args.sample:
        sample(args.sample, args.devices, args.batch_size, args.top)
        return
    load = os.getloadavg()[0]
    text = ["## Planner speed", "",
            f"`python bench/bench_plan_speed.py --layers {' '.join(map(str, args.layers))} --blocks "
            f"{args.blocks}` on {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, load average "
            f"{load:.2f} at the start (wall seconds include other processes' use of the cores; "
            f"CPU seconds are this process's own).", ""]
    if args.layers:
        text += [f"### GPT-2 (transformers, hidden 768) on {args.devices}, batch {args.batch_size}", "",
                 *layer_rows(args.layers, args.devices, args.batch_size), ""]
    if args.blocks:
        text += [f"### {4 * args.blocks:,}-node graph on 16 devices", "", *block_rows(args.blocks)]
    print("\n".join(text))
    if not args.no_write:
        write_section("\n".join(text), key="planspeed")


if __name__ == "__main__":
    main()
