"""torchrun worker for tests/test_runtime_dist.py: drives PipelineRuntime on pipeline_model.

    worker.py numeric OUT --schedules gpipe,1f1b --microbatches 4 [--ckpt-save] [--ckpt-resume DIR] [--nccl-like]
    worker.py fault OUT --how exit|hang --timeout 3

``--ckpt-save`` trains 4 steps straight and, separately, 2 steps then a checkpoint, into OUT;
``--ckpt-resume DIR`` loads DIR's checkpoint in these (new) processes and trains the last 2.

Results go to safetensors files (``<schedule>_rank<r>.safetensors``: ``loss``, ``grad.<param>``,
``out``, ``peak_stash``, ``peak_sends``) plus ``imports_rank<r>.json``; the test compares them with a
single-process run. Errors: ``pipecc: error: ...`` on stderr and exit status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

import pipeline_model as pm
from pipecc.errors import PipeccError
from pipecc.ir.schedule import format as format_schedule, zb_v
from pipecc.runtime.engine import PipelineRuntime, RunConfig, init_distributed
from pipecc.runtime.wire import Wire, check_fifo, directed_groups

CKPT_SCHEDULE, CKPT_STEPS = "1f1b", 4


NCCL_LIKE = False  # --nccl-like: the NCCL wire (a group per direction, order matching) on gloo


def make_runtime(rank: int, world: int, schedule: str, microbatches: int, seed: int = 0,
                 timeout: float = 30.0, adam: bool = False) -> PipelineRuntime:
    """This rank's stages (stage r, or r, r+world for interleaved, or r, 2*world-1-r for zb-v,
    run as its schedule text) wrapped in a runtime."""
    chunks = 2 if schedule in ("interleaved", "zb-v") else 1
    stages, ports = pm.build_stages(world * chunks, seed)
    mine = list(range(rank, world * chunks, world))
    if schedule == "zb-v":
        mine, schedule = sorted({rank, 2 * world - 1 - rank}), format_schedule(zb_v(world, microbatches))
    modules = [stages[s] for s in mine]
    optimizer = torch.optim.Adam([p for m in modules for p in m.parameters()], lr=0.01) if adam else None
    runtime = PipelineRuntime(modules, [ports[s] for s in mine], rank, world,
                              RunConfig(schedule, microbatches, timeout_s=timeout), pm.loss_fn, optimizer)
    if NCCL_LIKE:
        check_fifo(runtime.schedule)
        runtime._wire = Wire(rank, timeout, groups=directed_groups(runtime.schedule), by_order=True)
    return runtime


def numeric(out: Path, schedules: list[str], microbatches: int, rank: int, world: int) -> None:
    (inputs, target) = pm.batch(0)
    for schedule in schedules:
        runtime = make_runtime(rank, world, schedule, microbatches)
        first, last = 0 in runtime.stage_ids, runtime.last_stage in runtime.stage_ids
        results: dict[str, torch.Tensor] = {}
        if schedule == "inference":
            outputs = runtime.infer(inputs if first else None)
        else:
            loss = runtime.step(inputs if first else None, target if last else None)
            results["peak_stash"] = torch.tensor(runtime.peak_stash)
            results["peak_sends"] = torch.tensor(runtime.peak_sends)
            outputs = runtime.infer(inputs if first else None)  # the same runtime, forward only
            for module in runtime.modules:
                for name, p in module.named_parameters():
                    results[f"grad.{name}"] = p.grad
            if loss is not None:
                results["loss"] = torch.tensor(loss, dtype=torch.float64)
        if outputs is not None:
            results["out"] = outputs
        save_file({k: v.contiguous() for k, v in results.items()}, out / f"{schedule}_rank{rank}.safetensors")
    # NOTE: sympy is no witness here: torch.autograd.backward(tensors, grad_tensors) imports it.
    (out / f"imports_rank{rank}.json").write_text(json.dumps(sorted(m for m in sys.modules if m.startswith("pipecc"))))


def train(runtime: PipelineRuntime, steps: range) -> None:
    for step in steps:
        inputs, target = pm.batch(100 + step)
        runtime.optimizer.zero_grad()
        runtime.step(inputs if 0 in runtime.stage_ids else None, target)
        runtime.optimizer.step()


def params(runtime: PipelineRuntime) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for m in runtime.modules for name, p in m.named_parameters()}


def ckpt_save(directory: Path, rank: int, world: int) -> None:
    """4 steps straight (parameters kept), then 2 steps from the same init and a checkpoint."""
    straight = make_runtime(rank, world, CKPT_SCHEDULE, 4, adam=True)
    train(straight, range(CKPT_STEPS))
    save_file(params(straight), directory / f"straight_rank{rank}.safetensors")
    half = make_runtime(rank, world, CKPT_SCHEDULE, 4, adam=True)
    train(half, range(CKPT_STEPS // 2))
    half.save_checkpoint(directory / "ckpt", CKPT_STEPS // 2)


def resume(directory: Path, rank: int, world: int) -> None:
    """New processes, a different init: load the checkpoint and finish the 4 steps."""
    runtime = make_runtime(rank, world, CKPT_SCHEDULE, 4, seed=1, adam=True)
    start = runtime.load_checkpoint(directory / "ckpt")
    train(runtime, range(start, CKPT_STEPS))
    save_file(params(runtime), directory / f"resumed_rank{rank}.safetensors")


def fault(how: str, timeout: float, rank: int, world: int) -> None:
    """Rank 0 quits (or hangs) before its first send; the others must stop within ``timeout``."""
    runtime = make_runtime(rank, world, "1f1b", 4, timeout=timeout)
    if rank == 0:
        if how == "exit":
            sys.exit(0)
        time.sleep(3600)  # far past any timeout: only rank 1's timeout (and torchrun) can end the run
    inputs, target = pm.batch(0)
    runtime.step(None, target)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("numeric", "fault"))
    parser.add_argument("out", type=Path)
    parser.add_argument("--schedules", default="gpipe,1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--ckpt-save", action="store_true")
    parser.add_argument("--ckpt-resume", type=Path)
    parser.add_argument("--how", choices=("exit", "hang"), default="exit")
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--nccl-like", action="store_true")
    args = parser.parse_args()
    global NCCL_LIKE
    NCCL_LIKE = args.nccl_like
    torch.set_num_threads(1)
    try:
        rank, world = init_distributed(RunConfig("1f1b", 1, timeout_s=args.timeout))
        if args.mode == "numeric":
            numeric(args.out, args.schedules.split(","), args.microbatches, rank, world)
            if args.ckpt_save:
                ckpt_save(args.out, rank, world)
            if args.ckpt_resume:
                resume(args.ckpt_resume, rank, world)
        else:
            fault(args.how, args.timeout, rank, world)
    except PipeccError as e:
        print(f"pipecc: error: {e}", file=sys.stderr, flush=True)
        os._exit(1)  # NOTE: skip interpreter teardown, which may wait on the dead peer's socket
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # NOTE: skip interpreter teardown: torch's C++ destructors abort a finished rank now and then


if __name__ == "__main__":
    sys.exit(main())
