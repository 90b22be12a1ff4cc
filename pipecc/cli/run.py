"""`pipecc run OUT`: train a compiled pipeline with one process per rank, through torchrun.

    pipecc run OUT [--steps N] [--verify] [--schedule S] [--microbatches M] [--timeout S] ...
    pipecc run OUT --json [--warmup-steps W] [--memory]
    pipecc run OUT --nnodes 2 --node-rank R --rdzv-endpoint HOST:PORT [--nproc-per-node P]
    pipecc run OUT [--nnodes 2 --rdzv-endpoint HOST:PORT] --print-command

The command starts `python -m torch.distributed.run` (this interpreter, so the children import
this pipecc) on `OUT/run_stage.py`, which runs `pipecc.runtime.dist.main` in every process:
real data from the model file recorded in `OUT/pipecc.json`, the model's loss, an optimizer
step per iteration, and `step i: loss X, Y samples/s` from the last rank (see that module for
what the figures mean and what `--verify` compares).

Inference-only folders (`pipecc.json` has `"inference_only": true`: the plan has FPGA stages,
whose C simulation has no backward pass; or the schedule is "inference": compiled with
--inference) run forward passes instead: `step i: forward only, Y samples/s`, and `--verify`
compares the outputs with the original model's forward. An FPGA stage's rank runs it through
its C simulation (the HLS project built with g++). Training options (--optimizer, --lr, a
training --schedule) on such a folder are a usage error that says it is inference-only; a folder
compiled with --inference for CPUs/GPUs only still trains when given `--schedule gpipe|1f1b`.

Processes. A pipeline of S stages needs S ranks, or S / v for the interleaved schedule with v
virtual stages per rank (`plan.json`'s `virtual_stages`); a folder whose stages are replicated
(`pipecc.json`'s `replicas` d > 1, PP x DP) needs d times as many, one per device of the plan
(rank g = pipeline rank g // d, replica g % d; `pipecc.techniques.replicas.runtime`). One machine: `--standalone`, whose
rendezvous store takes a free port, so concurrent runs never collide. Several machines: the
same `pipecc run` on every node with `--nnodes N --node-rank R --rdzv-endpoint HOST:PORT`
(node 0's address and a free port there) and `--nproc-per-node P` (default ranks / N), passed
to torchrun (static rendezvous by default: node R's processes are ranks R*P .. R*P+P-1, node 0 hosts
the store at HOST:PORT; `--rdzv-backend c10d` for torchrun's elastic one, which numbers the
nodes in arrival order and ignores --node-rank); OUT must be at the same path on every node.
`--print-command` prints the command of every node instead of running anything.

Before anything starts, the folder is checked without running any of its code (every ports.json
parses and fits its neighbour's, every weights.safetensors is readable, -m fits the batch, the
schedule fits the ranks, --verify has its model file, the model file is the one recorded by hash):
a problem is one `pipecc: error:` line and no process is started.

Trust. A compiled folder is code, like a pickle: its stage.py files run in every rank, and the
model file pipecc.json names is imported for the data and loss. Only run folders you trust. The
model file is imported only when its sha256 is the one `pipecc compile` recorded in pipecc.json
(`pipecc.runtime.trust`); the C simulation of an FPGA stage is rebuilt unless this machine built it.

The children get OMP_NUM_THREADS=1 unless it is set (one process per stage on one machine must
not each take every core). `pipecc.runtime.launcher` supervises them: their output streams
through, worker `pipecc: error:` lines and torchrun's own log are held back (shown with
--verbose/--debug), and a failed run exits 1 with exactly one line naming the rank at fault (the
one that hung, not the one that timed out waiting for it). Every process of the run is stopped
when it fails, on Ctrl-C (`pipecc: error: interrupted`, exit 130), when the torchrun agent dies and
when it is stopped (SIGSTOP: at once once its workers ended, else after --timeout); with --nnodes,
--timeout bounds the rendezvous too (torchrun's `--rdzv-conf timeout=`), and a node that never
came is one line naming what to start;
workers also stop by themselves when the agent or `pipecc run` is gone (`pipecc.runtime.lifeline`).

Unequal micro-batches: a folder whose plan gives every stage its own micro-batch sizes
(`pipecc.json`'s `microbatch_sizes`, UMPIPE) runs them under the gpipe schedule: each stage
splits the batch into its own chunks and re-slices what it receives (`pipecc.techniques.umpipe.runtime`);
`--schedule` other than gpipe and `--microbatches` are usage errors there.

Bi-Partition folders (`pipecc.json`'s `"bipartition": "ship"`; `pipecc.techniques.bipartition.runtime_segments`): one
rank per worker as usual; a segment's saved tensors travel with the forward or backward message
and the owners refresh their segments' replicas after every step. They run the 1f1b and gpipe
schedules only (another `--schedule` is a usage error, `inference` runs the forward ranges).
Activation balancing: a folder whose plan pairs stages (`pipecc.json`'s `activation_balancing`,
BPipe) runs 1f1b with the evictors' saved activations sent to their partners and back
(`pipecc.techniques.bpipe.runtime_stash`); `--schedule` other than 1f1b is a usage error there.

Checkpoints: `--checkpoint-dir DIR [--checkpoint-every N] [--resume]` (`pipecc.runtime.checkpoints`;
a checkpoint of another folder of the same model is re-mapped, `pipecc.runtime.ckpt_remap`).

Trace: `--trace FILE` writes every rank's actions as they ran, one Chrome trace (`pipecc.runtime.trace`).

Measured against predicted: `--json` prints one JSON document on stdout at the end and nothing
else there (the step lines go to stderr; an error is still one `pipecc: error:` line on stderr):
each stage's median forward and backward time per micro-batch and its rank's receive wait per
step, the median step time and samples/s, each next to plan.json's prediction
(`pipecc.runtime.timing` describes every key). The first `--warmup-steps` steps (default 1) are
left out of the statistics. `--memory` adds each rank's measured peak memory beside plan.json's
`peak_memory_bytes` (`pipecc.runtime.memory`, docs/memory.md).
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipecc.cli.args import endpoint, nonnegative_int, positive_float, positive_int
from pipecc.errors import PipeccError, UsageError
from pipecc.ir.schedule.registry import SCHEDULES, TRAINING_SCHEDULES, VIRTUAL
from pipecc.runtime import lifeline
from pipecc.runtime.launcher import supervise

if TYPE_CHECKING:
    from pipecc.runtime.folder import CompiledFolder

__all__ = ["add_parser", "cmd_run", "launch_plan", "torchrun_commands"]

DEFAULT_STEPS = 5
DEFAULT_TIMEOUT_S = 60.0  # the ranks' default --timeout (pipecc.runtime.dist)
TRUST = ("A compiled folder is code, like a pickle: its stage.py files run, and the .py model file "
         "its pipecc.json names is imported (only when its sha256 matches the one recorded at compile "
         "time; a C-simulation library in the folder is rebuilt unless this machine built it). Only run "
         "folders you trust.")


def add_parser(subparsers: Any, common_parent: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register `pipecc run` on the CLI's subparsers (with the common --debug/-v/-q options)."""
    p = subparsers.add_parser(
        "run", parents=[common_parent], help="train a compiled pipeline, one process per stage (torchrun)",
        description="Start torchrun with one process per pipeline rank on OUT/run_stage.py: train N steps on "
        "the model file's example data and print the loss and samples/s per step (the batch size over "
        "the iteration's wall time on the last rank, no barrier). --verify first checks outputs, loss and "
        "every gradient against the original model in one process. An inference-only folder (FPGA stages, "
        "or compiled with --inference) runs N forward passes instead (FPGA stages through their C "
        "simulation); --verify then compares the outputs. " + TRUST)
    p.add_argument("out", metavar="OUT", help="a folder written by `pipecc compile -o OUT`")
    p.add_argument("--steps", type=nonnegative_int, default=None, metavar="N",
                   help=f"training steps (default {DEFAULT_STEPS}); with the model file's train_data, a new pass "
                   "over its batches starts whenever one ends")
    p.add_argument("--epochs", type=positive_int, metavar="E",
                   help="instead of --steps: E passes over the batches of the model file's train_data")
    p.add_argument("--verify", action="store_true",
                   help="compare outputs, loss and gradients of the first step with the original model "
                   "run in one process from the same weights; exit 1 on a mismatch, and when the model "
                   "file is missing (cannot verify)")
    p.add_argument("--verify-stages-only", action="store_true",
                   help="compare the pipeline's forward with its own stages chained in one process: "
                   "needs no model file, but cannot catch a stage that differs from the original model")
    # the training schedules first, then forward-only ones (inference)
    p.add_argument("--schedule", choices=sorted(SCHEDULES, key=lambda n: n not in TRAINING_SCHEDULES),
                   help="override the compiled schedule (inference: forward passes only)")
    p.add_argument("--microbatches", "-m", type=positive_int, metavar="M",
                   help="override the compiled number of micro-batches")
    p.add_argument("--timeout", type=positive_float, metavar="S",
                   help="seconds a rank waits for a peer before failing (default 60); the run then stops, "
                   "naming the rank that hung. Also how long a rank's model-file code (its import, example_inputs, "
                   "example_target) may run, how long the nodes of --nnodes wait for each other, and "
                   "how long a stopped torchrun agent is waited for")
    t = p.add_argument_group("training (pipecc.distributed's loop: docs/training.md)")
    t.add_argument("--optimizer", choices=["sgd", "adam", "adamw"], help="default sgd (training only)")
    t.add_argument("--lr", type=positive_float, help="learning rate (default 1e-3; training only)")
    t.add_argument("--lr-schedule", choices=["constant", "cosine"], default="constant",
                   help="constant (default), or cosine annealing to 0 over --steps")
    t.add_argument("--clip-grad-norm", type=positive_float, metavar="X",
                   help="clip the global gradient norm (every stage, each parameter once) to X before each "
                   "optimizer step")
    t.add_argument("--precision", choices=["fp32", "bf16", "fp16"],
                   help="mixed precision: every stage's forward and the loss under torch.autocast in this dtype, "
                   "float32 messages sent in it (fp16 also scales the loss); default: the precision the folder "
                   "was compiled for (`compile --precision`, fp32 unless given)")
    t.add_argument("--eval-every", type=positive_int, metavar="N",
                   help="every N steps (and after the last), the mean loss over the model file's val_data "
                   "batches, in eval mode")
    p.add_argument("--seed", type=int, default=0, help="seed for the example data (default 0)")
    p.add_argument("--length", metavar="S=L[,L2,...]",
                   help="a folder compiled with --length: run its batches at length L (S=16,32,64: each "
                   "step at the next length in turn; --verify checks each); the batch is the model "
                   "file's example_inputs(batch_size, seq_len=L) (default: the example's length)")
    p.add_argument("--rtol", type=float, default=None,
                   help="--verify relative tolerance (default by dtype: 1e-4, float16 1e-3, bfloat16 1.6e-2)")
    p.add_argument("--atol", type=float, default=None, help="--verify absolute tolerance (default 1e-5)")
    p.add_argument("--json", action="store_true",
                   help="at the end print one JSON document on stdout, nothing else there (the step lines "
                   "go to stderr): per stage the measured median forward and backward per micro-batch and "
                   "receive wait per step, the median step time, each next to plan.json's prediction")
    p.add_argument("--warmup-steps", type=nonnegative_int, default=1, metavar="W",
                   help="--json: the first W steps are left out of the statistics (default 1)")
    p.add_argument("--memory", action="store_true",
                   help="--json: also measure each rank's peak memory in the timed steps, next to plan.json's "
                   "peak_memory_bytes (GPU: the CUDA allocator's peak; CPU: a count of live tensor bytes, which "
                   "slows small ops, so time a run without it for --calibrate); docs/memory.md")
    p.add_argument("--trace", metavar="FILE",
                   help="write a Chrome/Perfetto trace of the run to FILE (chrome://tracing, ui.perfetto.dev): one "
                   "track per rank and stage, every action of every step as it ran; `pipecc inspect OUT --trace "
                   "FILE` compares it with the predicted schedule (docs/trace.md)")
    p.add_argument("--force", action="store_true",
                   help="--trace: replace FILE even when pipecc did not write it (never OUT's files or the model file)")
    p.add_argument("--backend", choices=["gloo", "nccl"], help="default: gloo for a pipeline compiled for CPUs (or with CPU stages beside GPU ones), else nccl where CUDA is available")
    c = p.add_argument_group("checkpoints (training only)")
    c.add_argument("--checkpoint-dir", metavar="DIR",
                   help="save model, optimizer and RNG state of every rank here, atomically: every "
                   "--checkpoint-every steps and after the last step (DIR/step_<S>/, DIR/latest.json)")
    c.add_argument("--checkpoint-every", type=positive_int, metavar="N",
                   help="steps between checkpoints (default: only after the last step)")
    c.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --checkpoint-dir: --steps counts from the "
                   "start, so the run does the steps left; losses and weights are bit-identical to a run "
                   "that was never interrupted. A checkpoint of another compiled folder of the same model "
                   "(re-planned) is mapped by the model's tensor names (docs/checkpoints.md)")
    g = p.add_argument_group("several machines (passed to torchrun)")
    g.add_argument("--nnodes", type=positive_int, default=1, metavar="N", help="number of machines")
    g.add_argument("--node-rank", type=nonnegative_int, metavar="R", help="this machine's index, 0 .. N-1")
    g.add_argument("--rdzv-endpoint", type=endpoint, metavar="HOST:PORT",
                   help="node 0's address and a free port on it")
    g.add_argument("--rdzv-backend", choices=["static", "c10d"], default="static",
                   help="static (default): ranks follow --node-rank; c10d: elastic rendezvous")
    g.add_argument("--rdzv-id", metavar="ID", help="run id (c10d; default pipecc-PORT)")
    g.add_argument("--nproc-per-node", type=positive_int, metavar="P",
                   help="processes on each machine (default: ranks / nnodes)")
    p.add_argument("--print-command", action="store_true",
                   help="print the torchrun command for each node instead of running it")
    p.set_defaults(func=cmd_run)
    return p


# ----------------------------------------------------------------------------- planning the launch


def launch_plan(args: argparse.Namespace) -> dict[str, Any]:
    """What to start: {"out", "ranks", "nnodes", "nproc", "num_stages", "schedule"}; checks OUT."""
    out = Path(args.out).resolve()
    if not out.is_dir():
        raise PipeccError(f"{args.out} is not a folder; give the OUT of `pipecc compile ... -o OUT`")
    from pipecc.runtime.folder import CompiledFolder
    folder = CompiledFolder.open(out)  # an edited field is one line here, not a traceback in a rank
    num_stages = folder.num_stages
    missing = [f"stage_{i}" for i in range(num_stages) if not (out / f"stage_{i}" / "ports.json").is_file()]
    if not (out / "run_stage.py").is_file():
        missing.insert(0, "run_stage.py")
    if missing:
        raise PipeccError(f"{args.out} is incomplete (missing {', '.join(missing[:3])}); compile again")
    from pipecc.runtime.folder_check import check_folder  # NOTE: lazy: `pipecc --help` stays fast

    specs = check_folder(out, num_stages)  # runs none of the folder's code
    compiled = folder.schedule_file()
    # the ranks run the folder's schedule.txt; --schedule or --microbatches build one by name
    use_file = args.schedule is None and args.microbatches is None
    folder.checked_plan  # noqa: B018 -- plan.json read strictly now: a damaged one is one line here
    forward = folder.forward_only(args.schedule, args.optimizer, args.lr)
    schedule = "inference" if forward else args.schedule or folder.schedule
    virtual = folder.virtual_stages if schedule in VIRTUAL else 1
    if use_file:
        virtual = num_stages // compiled.num_ranks  # read_schedule_file: its stages are the folder's
    if virtual < 1 or num_stages % virtual:
        raise PipeccError(f"{num_stages} stages do not divide into {virtual} virtual stages per rank")
    replicas = folder.replicas
    _check_run(args, folder, specs, forward, compiled if use_file else schedule, num_stages // virtual, virtual)
    ranks = num_stages // virtual * replicas  # PP x DP: every pipeline rank on `replicas` processes
    nnodes = args.nnodes
    if nnodes > 1 and not args.rdzv_endpoint:
        raise UsageError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (node 0's address and a free port there)")
    if args.node_rank is not None and args.node_rank >= nnodes:
        raise UsageError(f"--node-rank {args.node_rank} is not below --nnodes {nnodes}")
    if nnodes > 1 and args.node_rank is None and args.rdzv_backend == "static" and not args.print_command:
        raise UsageError("--nnodes > 1 needs --node-rank R on each machine (or --print-command to see them all)")
    nproc = args.nproc_per_node
    if nproc is None:
        if ranks % nnodes:
            raise UsageError(f"the pipeline needs {ranks} processes, which do not divide over {nnodes} nodes; "
                             "give --nproc-per-node")
        nproc = ranks // nnodes
    if nproc * nnodes != ranks:
        raise UsageError(f"the pipeline needs {ranks} processes ({num_stages} stages" +
                         (f", {virtual} per rank" if virtual > 1 else "") +
                         (f", each on {replicas} replicas" if replicas > 1 else "") +
                         f"); --nnodes {nnodes} x --nproc-per-node {nproc} gives {nproc * nnodes}")
    return {"out": out, "ranks": ranks, "nnodes": nnodes, "nproc": nproc, "num_stages": num_stages,
            "schedule": schedule, "inference_only": forward, "replicas": replicas}


def _check_run(args: argparse.Namespace, folder: CompiledFolder, specs: list[dict[str, Any]], forward: bool,
               schedule: Any, ranks: int, virtual: int) -> None:
    """What every rank would check (and fail at, each printing a line) checked once, before torchrun:
    micro-batches against the batch, the schedule (a name, or the folder's parsed schedule.txt),
    --verify's model file, the model file's hash, the checkpoint options."""
    from pipecc.runtime.launch_checks import build_schedule, check_options  # torch-free, as the ranks' own
    from pipecc.runtime.lengths import run_lengths
    from pipecc.runtime.trust import model_file

    m = folder.run_microbatches(args.microbatches)
    batch = folder.batch(specs)
    check_options(args, folder, forward, m, batch, "an inference-only pipeline")
    run_lengths(getattr(args, "length", None), folder.lengths)  # the declared range
    _check_separable(folder.marker, m, folder.replicas)
    model_file(folder.marker, args.out)  # raises when the model file is not the one recorded by hash
    try:
        build_schedule(schedule, ranks, m, virtual, folder.sizes_for(args.microbatches),
                       folder.activation_balancing)
    except ValueError as e:
        shown = schedule if isinstance(schedule, str) else "(schedule.txt)"
        raise UsageError(f"--schedule {shown} with {ranks} ranks and {m} micro-batches: {e}") from None


def _check_separable(marker: dict[str, Any], m: int, replicas: int) -> None:
    """A run that splits the batch of a model whose nodes mix samples (pipecc.json's
    ``batch_mixing``, found at compile): refused in one line naming the node."""
    from pipecc.passes.batchdim_mixing import Mixing
    from pipecc.runtime.loss_kinds import check_run, split_words
    check_run(marker, m, replicas)  # a loss_fn that mixes samples (found at compile)
    found, split = marker.get("batch_mixing"), split_words(m, replicas)
    if isinstance(found, dict) and split:
        try:
            mixing = Mixing(**{k: str(v) for k, v in found.items()})
        except TypeError:
            raise PipeccError("pipecc.json's batch_mixing is not pipecc's; compile again") from None
        raise PipeccError(mixing.message(split))


def _worker_args(args: argparse.Namespace) -> list[str]:
    """run_stage.py's arguments (pipecc.runtime.dist.main): only what differs from its defaults."""
    argv = ["--steps", str(args.steps)]
    for flag, on in (("--verify", args.verify), ("--verify-stages-only", args.verify_stages_only),
                     ("--resume", args.resume), ("--debug", getattr(args, "debug", False)),
                     ("--json", args.json), ("--memory", getattr(args, "memory", False)),
                     ("--force", getattr(args, "force", False))):
        if on:
            argv.append(flag)
    if args.checkpoint_dir is not None:
        argv += ["--checkpoint-dir", str(Path(args.checkpoint_dir).resolve())]
    if getattr(args, "trace", None) is not None:
        argv += ["--trace", str(Path(args.trace).expanduser().resolve())]
    if args.checkpoint_every is not None:
        argv += ["--checkpoint-every", str(args.checkpoint_every)]
    if getattr(args, "length", None) is not None:
        argv += ["--length", args.length]
    for flag, value in (("--schedule", args.schedule), ("--microbatches", args.microbatches),
                        ("--timeout", args.timeout), ("--backend", args.backend)):
        if value is not None:
            argv += [flag, str(value)]
    if args.optimizer is not None:
        argv += ["--optimizer", args.optimizer]
    for flag, value in (("--epochs", getattr(args, "epochs", None)), ("--precision", getattr(args, "precision", None)),
                        ("--clip-grad-norm", getattr(args, "clip_grad_norm", None)),
                        ("--eval-every", getattr(args, "eval_every", None))):
        if value is not None:
            argv += [flag, repr(value) if isinstance(value, float) else str(value)]
    if getattr(args, "lr_schedule", "constant") != "constant":
        argv += ["--lr-schedule", args.lr_schedule]
    if args.lr is not None:
        argv += ["--lr", repr(args.lr)]
    for flag, value, default in (("--seed", args.seed, 0), ("--warmup-steps", args.warmup_steps, 1),
                                 ("--rtol", args.rtol, None), ("--atol", args.atol, None)):
        if value != default:
            argv += [flag, repr(value)]
    return argv


def torchrun_commands(args: argparse.Namespace, launch: dict[str, Any]) -> dict[int, list[str]]:
    """node rank -> the command to start there (one entry, node 0, on a single machine)."""
    base = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(launch["nproc"])]
    tail = [str(launch["out"] / "run_stage.py"), *_worker_args(args)]
    if launch["nnodes"] == 1:
        return {0: [*base, "--standalone", *tail]}
    port = args.rdzv_endpoint.rpartition(":")[2]
    nodes = [args.node_rank] if args.node_rank is not None and not args.print_command else \
        list(range(launch["nnodes"]))
    commands = {}
    for node in nodes:
        cmd = [*base, "--nnodes", str(launch["nnodes"])]
        # NOTE: --timeout bounds the rendezvous too (torchrun's own default is 600 s and more)
        wait = str(max(1, math.ceil(args.timeout or DEFAULT_TIMEOUT_S)))
        if args.rdzv_backend == "c10d":  # the rendezvous numbers the nodes; --node-rank is ignored
            cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", args.rdzv_endpoint,
                    "--rdzv-id", args.rdzv_id or f"pipecc-{port}", "--rdzv-conf", f"join_timeout={wait}"]
        else:
            cmd += ["--node-rank", str(node), "--rdzv-backend", "static", "--rdzv-endpoint", args.rdzv_endpoint,
                    "--rdzv-conf", f"timeout={wait}"]
        commands[node] = [*cmd, *tail]
    return commands


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env[lifeline.ENV] = lifeline.launcher_id()  # workers stop when this process is gone
    # NOTE: run_stage.py puts OUT, not the cwd, on sys.path: make this pipecc importable there
    # when it runs from a source checkout rather than an installed package.
    import pipecc
    root = str(Path(pipecc.__file__).resolve().parents[1])  # the folder holding pipecc/
    if Path(root).name not in ("site-packages", "dist-packages"):
        paths = env.get("PYTHONPATH", "").split(os.pathsep) if env.get("PYTHONPATH") else []
        if root not in paths:
            env["PYTHONPATH"] = os.pathsep.join([root, *paths])
    return env


# ----------------------------------------------------------------------------- running


def cmd_run(args: argparse.Namespace) -> int:
    if getattr(args, "epochs", None) is not None and args.steps is not None:
        raise UsageError("give --steps N or --epochs E, not both")
    if args.steps is None:
        args.steps = 0 if getattr(args, "epochs", None) is not None else DEFAULT_STEPS
    lock = _lock_checkpoints(args, create=False)  # a folder in use names its run before any other check
    launch = launch_plan(args)
    commands = torchrun_commands(args, launch)
    if args.print_command:
        omp = "" if "OMP_NUM_THREADS" in os.environ else "OMP_NUM_THREADS=1 "
        if launch["nnodes"] == 1:
            print(omp + shlex.join(commands[0]))
            return 0
        print(f"# run on each of the {launch['nnodes']} machines (node 0 at {args.rdzv_endpoint.rpartition(':')[0]}; "
              f"{launch['out']} must exist there too):")
        for node, cmd in commands.items():
            print(f"# node {node}")
            print(omp + shlex.join(cmd))
        return 0
    (cmd,) = commands.values()
    lock = lock or _lock_checkpoints(args, create=True)  # the checks passed: a new folder may be made now
    # NOTE: torchrun makes a log folder per launch (its error files) and never removes it: without
    # --log-dir every run left a torchelastic_* folder in $TMPDIR; this one goes with the run
    import shutil
    from pipecc.runtime.leftovers import make_log_dir
    logs = make_log_dir()  # a killed run's folders (its pid gone) are removed here
    cmd = [*cmd[:3], "--log-dir", logs, *cmd[3:]]
    env = _child_env()
    from pipecc.runtime import watchdog
    env[watchdog.ENV] = str(args.timeout or DEFAULT_TIMEOUT_S)  # model code in every rank: bounded too
    if args.checkpoint_dir is not None:
        from pipecc.runtime.ckptlock import LOCK_ENV
        env[LOCK_ENV] = str(Path(args.checkpoint_dir).resolve())  # the ranks do not lock it again
    verbose = bool(getattr(args, "verbose", False) or getattr(args, "debug", False))
    if verbose:
        print("pipecc run: " + shlex.join(cmd), file=sys.stderr, flush=True)
    from pipecc.cli.runprogress import RunProgress
    steps = RunProgress(args.steps, sys.stderr if args.json else sys.stdout,  # where the step lines go
                        quiet=bool(getattr(args, "quiet", False)), verbose=verbose)
    try:
        return supervise(cmd, env, verbose, json_only=args.json, steps=steps,
                         timeout_s=args.timeout or DEFAULT_TIMEOUT_S, rendezvous=_rendezvous_hint(args, launch))
    finally:
        shutil.rmtree(logs, ignore_errors=True)
        if lock is not None:
            lock.release()


def _rendezvous_hint(args: argparse.Namespace, launch: dict[str, Any]) -> str | None:
    """What to do when the nodes do not meet: None on one machine."""
    if launch["nnodes"] == 1:
        return None
    if args.node_rank in (None, 0) or args.rdzv_backend == "c10d":
        return (f"start `pipecc run {args.out} --nnodes {launch['nnodes']} --node-rank R --rdzv-endpoint "
                f"{args.rdzv_endpoint}` on every other node (or raise --timeout)")
    return f"node 0 did not answer at {args.rdzv_endpoint}; start `pipecc run` there first (or raise --timeout)"


def _lock_checkpoints(args: argparse.Namespace, create: bool) -> Any:
    """Hold ``--checkpoint-dir``'s lock for this run (``pipecc.runtime.ckptlock``): node 0's
    launcher holds it for the whole launch; None without a folder (yet), on other nodes, or
    when only printing the command."""
    if args.checkpoint_dir is None or args.print_command or args.node_rank not in (None, 0):
        return None
    from pipecc.runtime.ckptlock import CheckpointLock
    return CheckpointLock.take(args.checkpoint_dir, create=create)
