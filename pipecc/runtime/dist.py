"""Distributed pipeline runtime, command line: ``python -m pipecc.runtime.dist OUT`` runs a compiled
folder, one process per rank, stages exchanging values point to point.

Launch one process per rank with ``pipecc run OUT`` (``pipecc.cli.run``), which starts torchrun on
``OUT/run_stage.py`` (by hand: ``torchrun --nproc-per-node P -m pipecc.runtime.dist OUT --steps N``);
the generated ``run_stage.py`` calls ``main``. This module reads the folder (``stage_<i>/``,
``pipecc.json``), loads this rank's stages and runs them; the runtime itself is in

  * ``pipecc.runtime.ports``: what crosses a stage boundary (``ports.json``), the micro-batch
    split, object values as JSON, the model's output structure;
  * ``pipecc.runtime.wire``: the transport (wire protocol, sends and receives, NCCL groups);
  * ``pipecc.runtime.engine``: ``PipelineRuntime``, which runs a rank's stages by the schedule
    (loss, faults, checkpoints), and ``init_distributed``;
  * ``pipecc.runtime.rundata``: the model's data (inputs, target, loss) and tied weights;
  * ``pipecc.techniques.replicas.runtime``: replicated stages (PP x DP): rank mapping, data slices, the
    gradient all-reduce;
  * ``pipecc.runtime.verify``: ``--verify``.

The runtime imports torch, ``pipecc.ir.schedule`` and ``pipecc.errors`` (and safetensors when
checkpointing, ``pipecc.frontend.modelfile`` for a model file) — never the compiler; the one
exception is the rank of an FPGA stage, whose executable is its C simulation, built and called by
``pipecc.backends.fpga`` (``_load_fpga_stage``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from pipecc.runtime import gcpause

_GC = gcpause.pause()  # NOTE: no collector passes over torch's import (pipecc.runtime.gcpause)
import torch  # noqa: E402
from torch import nn  # noqa: E402

from pipecc.errors import PipeccError, UsageError, printable
from pipecc.ir.schedule.registry import SCHEDULES
from pipecc.runtime import lifeline, teardown
from pipecc.runtime.checkpoints import DEFAULT_LR, RunCheckpoints, folder_fingerprint, \
    run_options
from pipecc.runtime.engine import PipelineRuntime, RunConfig
from pipecc.runtime.folder import CompiledFolder
from pipecc.runtime.memory import memory_meter
from pipecc.techniques.replicas.runtime import (Replicas)
from pipecc.runtime.rank import RankRun, check_options, load_rank  # noqa: F401  (re-exported)
from pipecc.runtime.rundata import RunData
from pipecc.runtime.timing import ActionTimer, gather, plan_identity, read_plan, run_document
from pipecc.runtime.trace import TraceRecorder
from pipecc.runtime.verify import PeerFailed, Verifier, verify_chained

gcpause.resume(_GC)

__all__ = ["RankRun", "check_options", "load_rank", "main", "run_compiled", "train"]


def device_note(meta: dict[str, Any] | None, device: torch.device) -> str | None:
    """A note when a folder planned for GPUs runs on the CPU (no CUDA device here): the numbers
    are the same, the plan's predicted times are the GPUs', not this machine's."""
    from pipecc.ir.plan import devices_text
    gpus = [str(d.get("name")) for d in (meta or {}).get("devices") or []
            if isinstance(d, dict) and d.get("kind") == "gpu"]
    if not gpus or torch.device(device).type != "cpu":
        return None
    return (f"note: this folder was planned for {devices_text(gpus)}; without a CUDA device here every rank "
            "runs on the CPU: the same numbers, but the plan's predicted times are for those GPUs")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pipecc.runtime.dist OUT --steps N [--verify] [--schedule S]``, one process per rank.

    ``pipecc run OUT`` (``pipecc.cli.run``) starts this under torchrun through ``OUT/run_stage.py``.
    Under torchrun rank r loads its stages from ``OUT/stage_<i>/`` (through
    ``pipecc.runtime.local.load_stage``); without torchrun one process runs every stage (use
    ``--schedule interleaved`` when there are several). Schedule and micro-batches default to the
    compiled ones: under torchrun the ranks parse, validate and execute ``OUT/schedule.txt``, the
    plan's action list as compile wrote it (``pipecc.runtime.schedule_file``; a folder without
    one, or one that is invalid or does not fit the folder, is a one-line error); ``--schedule``
    or ``--microbatches`` build one by name from ``OUT/pipecc.json`` instead
    (``pipecc.ir.schedule.schedule_for``), as does one process. A pipeline compiled for CPUs only runs on the CPU over
    gloo even where CUDA is available; otherwise rank r uses cuda:LOCAL_RANK and NCCL.

    Data. When ``OUT/pipecc.json`` names a ``.py`` model file that exists, every rank imports it
    (without building the model) and calls ``example_inputs(batch_size, **model_args)`` and
    ``example_target(batch_size, **model_args)`` after seeding torch's RNG with ``--seed``, so
    every rank draws the same batch; the rank of stage 0 feeds the inputs (mapped to stage 0's
    receives through ``model_inputs``), the last rank uses the target and the file's
    ``loss_fn(outputs, target)`` on the outputs rebuilt in the model's structure. Without a
    ``loss_fn`` (or ``example_target``) the loss is the mean of the outputs, with a note. Without a
    usable model file (an ONNX model, a folder moved to another machine, no ``pipecc.json``) the
    run uses seeded random inputs of the compiled shapes and that smoke loss.

    Steps. Each step zeroes the gradients, runs ``PipelineRuntime.step``, sums the gradients of
    tied weights (a parameter used by stages on several ranks) across those ranks, and steps
    the optimizer (``--optimizer sgd|adam``, ``--lr``). The last rank prints
    ``step i: loss X, Y samples/s``: samples/s is the batch size divided by the wall time of
    the iteration on the last rank, from its ``zero_grad`` to its ``optimizer.step`` (a local
    ``time.perf_counter`` timer, no barrier: the ranks are coupled by their messages, so in
    steady state every rank's iteration takes the pipeline's period; step 0 includes start-up
    and, with ``--verify``, excludes the comparison).

    ``--verify`` (``pipecc.runtime.verify``): the first training step is checked against the
    original model in one process: each rank compares its own stages' parameter gradients
    (``--rtol``/``--atol``, default by dtype), the last rank also the outputs and the loss; a
    mismatch prints ``pipecc: error: verify: rank R stage S gradient of NAME differs: ...`` and
    exits 1. Both runs of that step have dropout off and random draws fixed (the verdict says
    so; that step's update uses those gradients); with BatchNorm and several micro-batches only eval-mode outputs are compared, before
    training. ``--verify`` needs the model file (imported only when its sha256 is the one
    ``pipecc.json`` records, ``pipecc.runtime.trust``): without one it is an error ("cannot verify:
    ...") unless ``--verify-stages-only``, which checks the pipeline's forward against all its
    stages chained on the last rank.

    Checkpoints (``pipecc.runtime.checkpoints``): ``--checkpoint-dir DIR`` saves every rank's
    model, optimizer and RNG state every ``--checkpoint-every N`` steps and after the last,
    atomically; ``--resume`` continues from the newest one (``--steps`` counts from the start),
    after checking its checksums, its state for NaN/Inf and the run's options against those it
    was trained with; one run holds the folder's lock at a time (``pipecc.runtime.ckptlock``).

    Replicated stages (``pipecc.json``: ``"replicas": d > 1``, ``pipecc.techniques.replicas.runtime``): under
    torchrun with n ranks, global rank g runs pipeline rank g // d (its stages, the schedule built
    for n // d ranks) as replica g % d: it feeds and uses its slice of every micro-batch (stage 0's
    inputs, the target), talks to the same replica of its neighbours, weights its loss by its
    share and all-reduces its stages' gradients with the other replicas (overlapped with the
    step's last backward, waited before the optimizer step; tied weights are summed after, among
    the same replica's ranks). The printed loss is the replicas' sum (the full-batch loss), and
    only replica 0 of the last stage prints; ``--verify`` checks every rank (its rows of the
    outputs); ``--json`` has a row per rank with its ``replica``; checkpoints are one file set per
    rank. Without torchrun one process runs the folder unreplicated (same numerics).

    Inference-only folders (``pipecc.json``: ``"inference_only": true`` — the plan has FPGA
    stages, which have no backward pass — or schedule "inference", compiled with --inference;
    also ``--schedule inference``) run ``--steps`` forward passes (``PipelineRuntime.infer``,
    stages in eval mode) under the inference schedule, and the last rank prints
    ``step i: forward only, Y samples/s``. A rank holding a stage with ``hls/`` runs it through
    its C simulation (``FpgaPipelineStage``, built with g++ on first use). ``--verify`` compares
    the first pass's outputs with the original model's eval-mode forward (``verify: outputs match
    the single-process run (forward only)``). ``--optimizer``/``--lr`` there are a usage error,
    and so is a training ``--schedule`` for a folder with FPGA stages.

    Activation balancing (BPipe; ``pipecc.json``'s ``activation_balancing``): under torchrun the
    schedule is ``bpipe(one_f_one_b(p, m), thresholds)`` (``pipecc.techniques.bpipe.runtime_stash``); ``--schedule``
    other than 1f1b is a usage error. One process runs without it (a partner on the same rank
    would free nothing).

    Unequal micro-batches (``pipecc.json``'s ``microbatch_sizes``, one size list per stage):
    the gpipe schedule with every stage's own chunks (``pipecc.techniques.umpipe.runtime``), in one
    process too; ``--schedule`` other than gpipe and ``--microbatches`` are usage errors.

    Bi-Partition folders (``pipecc.json``: ``"bipartition": "ship"``, ``techniques.bipartition.runtime_segments``):
    each rank loads its core and its adjacent segments (owned or replica), traces the segments'
    graphs on first use and refreshes the replicas after every optimizer step.

    ``--json`` (``pipecc.runtime.timing``): every rank times its stages' forward and backward
    actions and its receive waits, from step ``--warmup-steps`` (default 1) on; at the end the
    ranks' figures are gathered to the last rank, which prints one JSON document (measured next
    to ``plan.json``'s predictions) on stdout. Everything else this process prints to stdout (the
    step lines, verify's and checkpoints' lines) goes to stderr instead.

    Errors: one ``pipecc: error: rank R: ...`` line per failing rank (a traceback only with
    ``--debug``), exit 1 (2 for usage). Under torchrun a rank stops by itself when the torchrun
    agent or ``pipecc run`` is gone (``pipecc.runtime.lifeline``).
    """
    args = _parser().parse_args(argv)
    rank = os.environ.get("RANK")
    under_torchrun = rank is not None and "WORLD_SIZE" in os.environ
    if under_torchrun:
        lifeline.start(f"rank {rank}")
    stdout = sys.stdout  # --json: the document's only; everything else printed goes to stderr
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        code = _main(args, stdout)
    if under_torchrun:
        # NOTE: a rank ends at once, skipping interpreter teardown: a failed rank's teardown may
        # wait on a dead or hung peer's socket, or on a thread the model file started. (A
        # finished rank's teardown no longer aborts: pipecc.runtime.teardown.) Everything it
        # wrote is closed by now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _main(args: argparse.Namespace, stdout: TextIO) -> int:
    try:
        return run_compiled(args, stdout)
    except PeerFailed:
        return 1  # another rank reported the problem
    except PipeccError as e:
        if args.debug:
            raise
        return _report(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__, e.exit_code)
    except KeyboardInterrupt:
        return _report("interrupted", 130)
    except Exception as e:  # a bug, or the user's code (model file, loss) failing: one line unless --debug
        if args.debug:
            raise
        text = str(e).strip().splitlines()
        return _report(f"{type(e).__name__}: {text[0] if text else ''} (rerun with --debug for the traceback)", 1)


def _report(message: str, code: int) -> int:
    rank = os.environ.get("RANK")
    if rank is not None and not re.search(r"\brank \d+", message):
        message = f"rank {rank}: {message}"
    # NOTE: one write of the whole line: the ranks share torchrun's stderr pipe, and print's two
    # writes (text, then "\n") under PYTHONUNBUFFERED let two ranks' lines glue into one
    line = f"pipecc: error: {printable(message)}\n"
    sys.stderr.flush()
    try:
        os.write(sys.stderr.fileno(), line.encode("utf-8", "replace"))
    except (OSError, ValueError, AttributeError):  # no real file descriptor (a test's capture)
        sys.stderr.write(line)
        sys.stderr.flush()
    return code


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipecc.runtime.dist")
    parser.add_argument("out", type=Path, help="a compiled folder (pipecc compile -o OUT)")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--schedule", help=f"{', '.join(SCHEDULES)} or schedule text (default: the compiled one)")
    parser.add_argument("--microbatches", type=int, help="default: the compiled number")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for a peer")
    parser.add_argument("--backend", choices=("gloo", "nccl"))
    parser.add_argument("--optimizer", choices=OPTIMIZERS, help="default sgd (training only)")
    parser.add_argument("--epochs", type=int, help="passes over the model file's train_data (instead of --steps)")
    parser.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant")
    parser.add_argument("--clip-grad-norm", type=float, help="clip the global gradient norm to this")
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"),
                        help="autocast dtype (default: the folder's, compile --precision)")
    parser.add_argument("--eval-every", type=int, help="evaluate the model file's val_data every N steps")
    parser.add_argument("--lr", type=float, help="default 1e-3 (training only)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--length", help="S=L or S=L1,L2,...: the steps' lengths, in turn (pipecc.runtime.lengths)")
    parser.add_argument("--verify", action="store_true", help="compare with the original model in one process")
    parser.add_argument("--rtol", type=float, default=None, help="--verify: relative tolerance (default by dtype)")
    parser.add_argument("--atol", type=float, default=None, help="--verify: absolute tolerance (default by dtype)")
    parser.add_argument("--verify-stages-only", action="store_true",
                        help="compare the pipeline with its stages chained in one process (no model file)")
    parser.add_argument("--checkpoint-dir", type=Path, help="save checkpoints here (pipecc.runtime.checkpoints)")
    parser.add_argument("--checkpoint-every", type=int, help="steps between checkpoints (default: at the end)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON document of measured vs predicted times (pipecc.runtime.timing)")
    parser.add_argument("--warmup-steps", type=int, default=1, help="--json: steps left out of the statistics")
    parser.add_argument("--memory", action="store_true",
                        help="--json: measure each rank's peak memory in the timed steps (pipecc.runtime.memory)")
    parser.add_argument("--trace", type=Path, help="write a Chrome trace of every action here (pipecc.runtime.trace)")
    parser.add_argument("--force", action="store_true", help="--trace: replace a file pipecc did not write")
    parser.add_argument("--debug", action="store_true", help="tracebacks instead of one-line errors")
    return parser


OPTIMIZERS = ("sgd", "adam", "adamw")


def _make_optimizer(kind: str, params: list[nn.Parameter], lr: float) -> torch.optim.Optimizer | None:
    if not params:
        return None
    with gcpause.paused():  # the first optimizer imports torch._dynamo (pipecc.runtime.gcpause)
        if kind == "adamw":
            return torch.optim.AdamW(params, lr=lr)
        return torch.optim.Adam(params, lr=lr) if kind == "adam" else torch.optim.SGD(params, lr=lr)


def run_compiled(args: argparse.Namespace, stdout: TextIO | None = None) -> int:
    """The body of ``main``: load this rank's share of the folder (``load_rank``), then run the
    training loop (``train``) or the forward passes; ``--json``'s document goes to ``stdout``
    (default: ``sys.stdout``)."""
    with gcpause.paused():  # the model file's imports (torchvision, transformers, ...): pipecc.runtime.gcpause
        run = load_rank(args)  # NOTE: holds the checkpoint lock until this returns
    try:
        if run.forward:
            return _run_forward(args, run.folder, run.stage_dirs, run.specs, run.data, run.modules, run.ports,
                                run.rank, run.world, run.config, run.load_stage, run.why, stdout, run.replicas,
                                run.rows, run.lengths, run.at_length)
        return train(args, run, stdout)
    finally:
        if run.lock is not None:  # NOTE: not left to garbage collection: the training loop's closures hold run
            run.lock.release()


def train(args: argparse.Namespace, run: RankRun, stdout: TextIO | None = None) -> int:
    """The training loop, a client of ``DistributedPipeline`` (``pipecc.runtime.distributed``, the
    object a training script drives): ``--steps`` steps (or ``--epochs`` passes over the model
    file's ``train_data``, ``pipecc.runtime.batches``) of this rank's stages, the optimizer and
    learning-rate schedule, ``--clip-grad-norm``; ``--verify`` checks the first step,
    ``--checkpoint-dir`` saves and resumes, ``--json`` times them and records every step's loss,
    ``--eval-every`` evaluates the model file's ``val_data``."""
    from pipecc.runtime.batches import Batches
    from pipecc.runtime.distributed import DistributedPipeline

    data, replicas, batch, m = run.data, run.replicas, run.batch, run.m
    stage_dirs, meta, load_stage = run.stage_dirs, run.meta, run.load_stage
    rows = run.rows
    pipe = DistributedPipeline(run, data.model_loss)
    pipe.refresh_after_step = True  # this loop refreshes Bi-Partition's replicas after each optimizer step
    runtime = pipe.runtime
    params = list(pipe.parameters())
    lr = DEFAULT_LR if args.lr is None else args.lr
    optimizer = _make_optimizer(args.optimizer or "sgd", params, lr)
    runtime.optimizer = optimizer
    timer = _timer(args, runtime)
    with _memory_meter(args, runtime, timer, run.rows, run.target):  # --memory: its meter counts the loop
        is_last = runtime.last_stage in runtime.stage_ids
        speaks = is_last and replicas.index == 0  # replicas: one of the last stage's prints
        module, file = data.module, Path(str(meta.get("model_path") or "the model file")).name
        model_args = dict(meta.get("model_args") or {})
        draws = 0 in runtime.stage_ids or is_last  # the ranks whose stages read the data
        epochs = getattr(args, "epochs", None)
        stream = None
        if Batches.defined(module, "train_data") and not run.lengths:
            stream = Batches(module, file, "train_data", batch, model_args, draws, args.seed, epochs, runtime.device)
        elif epochs is not None:
            raise UsageError(f"--epochs counts passes over train_data, which {file} does not define; give --steps N")
        if speaks and data.note:
            print(data.note, flush=True)
        elif speaks and stream is None and module is not None and not run.lengths:
            print(f"note: {file} defines no train_data(batch_size, **model_args); every step repeats its example "
                  "batch", flush=True)
        if speaks and device_note(meta, runtime.device):
            print(device_note(meta, runtime.device), flush=True)
        val_every = getattr(args, "eval_every", None)
        if val_every is not None and not Batches.defined(module, "val_data"):
            raise UsageError(f"--eval-every evaluates the batches of val_data, which {file} does not define")
        total_steps = args.steps
        scheduler = None
        if getattr(args, "lr_schedule", None) == "cosine" and optimizer is not None:
            if epochs is not None:
                raise UsageError("--lr-schedule cosine needs the run's length in steps: give --steps N rather than --epochs")
            scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, max(total_steps, 1))
        clip = getattr(args, "clip_grad_norm", None)
        inputs = rows if 0 in runtime.stage_ids else None
        target = run.target if is_last else None
        history: list[dict[str, Any]] = []

        verifier = None
        if args.verify_stages_only:
            outputs = runtime.infer(inputs)
            if outputs is not None:
                verify_chained(outputs, rows, [load_stage(d)[0].to(runtime.device) for d in stage_dirs], speaks)
        elif args.verify:
            verifier = Verifier(runtime, data, meta, stage_dirs, load_stage, args.rtol, args.atol)
            if verifier.eval_only:
                verifier.check_eval_outputs(inputs)
                verifier = None

        def train_step(i: int, update: bool, check: bool | None = None, fed: tuple[Any, Any] | None = None) -> None:
            nonlocal inputs, target
            check = verifier is not None and i == 0 if check is None else check
            step_inputs, step_target = inputs, target
            if run.lengths:  # --length: this step's batch (step i at the (i mod n)-th length)
                _, rows_i, target_i = run.at_length[run.lengths[i % len(run.lengths)]]
                step_inputs, step_target = (rows_i if 0 in runtime.stage_ids else None), (target_i if is_last else None)
            elif fed is not None:  # train_data's batch: this rank's share of it
                try:
                    step_inputs, step_target = pipe.feed(*fed) if draws else (None, None)
                except PipeccError as e:
                    raise PipeccError(f"step {i}: train_data in {file}: {e}") from None
            if timer is not None and update:
                timer.begin_step()
            start = time.perf_counter()
            if optimizer is not None:
                optimizer.zero_grad()
            runtime.keep_outputs = check
            runtime.refresh_follows = update  # Bi-Partition: after_optimizer_step follows; post its receive early
            # dropout off, draws fixed: as the reference runs
            with verifier.deterministic() if check and verifier is not None else contextlib.nullcontext():
                loss = pipe.step_rows(step_inputs, step_target)
            if check and verifier is not None:
                paused = time.perf_counter()
                verifier.check_step(pipe.last_loss)
                start += time.perf_counter() - paused
            if clip is not None and update:
                pipe.clip_grad_norm_(clip)
            if optimizer is not None and update:
                if runtime.trace is not None:
                    runtime.trace.span("optimizer", "optimizer", optimizer.step)
                else:
                    optimizer.step()
                if scheduler is not None:
                    scheduler.step()
            if update:
                pipe.after_optimizer_step()  # Bi-Partition: the replicas' weight refresh
            elapsed = time.perf_counter() - start
            if timer is not None and update:
                timer.end_step(elapsed)
            if update:
                history.append({"step": i, "loss": None if math.isnan(loss) else loss, "wall_s": elapsed,
                                "samples_per_s": batch / elapsed if batch and elapsed > 0 else 0.0,
                                "lr": optimizer.param_groups[0]["lr"] if optimizer is not None else None})
            if speaks and update:
                rate = f", {batch / elapsed:.1f} samples/s" if batch and elapsed > 0 else ""
                print(f"step {i}: loss {loss:.6g}{rate}", flush=True)

        def evaluate(after: int) -> None:
            """--eval-every: the mean loss over val_data's batches (eval mode, no gradients)."""
            val = Batches(module, file, "val_data", batch, model_args, draws, args.seed, 1, runtime.device)
            pipe.eval()
            total, count = 0.0, 0
            for k in range(1_000_000):
                try:
                    fed = val.next(k)
                except StopIteration:
                    break
                total += pipe.evaluate(fed[0], target=fed[1]) if fed is not None else pipe.evaluate(target=None)
                count += 1
            pipe.train()
            if count and history:
                history[-1]["val_loss"] = total / count
            if speaks:
                print(f"eval after step {after}: val loss {total / max(count, 1):.6g} ({count} batches)", flush=True)

        checkpoints, first = None, 0
        if args.checkpoint_dir is not None:
            checkpoints = RunCheckpoints(args.checkpoint_dir, runtime, folder_fingerprint(stage_dirs),
                                         args.checkpoint_every, run_options(args.optimizer, args.lr, args.seed, m))
            if args.resume:
                first = checkpoints.resume()
                for note in checkpoints.notes if speaks else ():
                    print(note, flush=True)
                if speaks:
                    print(f"resumed from {args.checkpoint_dir / f'step_{first}'}: step {first} of --steps {args.steps}",
                          flush=True)
                if stream is not None:
                    stream.fast_forward(first)  # the data continues where the checkpointed run stopped
                if scheduler is not None:
                    for _ in range(first):
                        scheduler.step()
        if verifier is not None and len(set(run.lengths)) > 1:  # --verify at every length, before training
            verifier = None
            symbol = run.folder.lengths.symbol
            for k, n in enumerate(run.lengths):
                if n in run.lengths[:k]:
                    continue
                if speaks:
                    print(f"verify at {symbol}={n}:", flush=True)
                verifier = Verifier(runtime, run.at_length[n][0], meta, stage_dirs, load_stage, args.rtol, args.atol)
                train_step(k, update=False, check=True)
            verifier = None
        elif verifier is not None and (args.steps < 1 or stream is not None):
            # --verify --steps 0: check one step, train none; with train_data the check runs on the
            # example batch the reference also runs, before training on the data
            train_step(0, update=False, check=True)
            verifier = None
        i = first
        while epochs is not None or i < args.steps:
            fed = None
            if stream is not None:
                try:
                    fed = stream.next(i)
                except StopIteration:
                    break
            train_step(i, update=True, fed=fed)
            i += 1
            if val_every is not None and i % val_every == 0:
                evaluate(i - 1)
            if checkpoints is not None and (checkpoints.due(i, args.steps) if epochs is None
                                            else bool(checkpoints.every and i % checkpoints.every == 0)):
                where = checkpoints.save(i)
                if speaks:
                    print(f"checkpoint: step {i} saved in {where}", flush=True)
        if val_every is not None and i % val_every and i > first:
            evaluate(i - 1)
        if checkpoints is not None and epochs is not None and not (checkpoints.every and i % checkpoints.every == 0) \
                and i > first:
            where = checkpoints.save(i)
            if speaks:
                print(f"checkpoint: step {i} saved in {where}", flush=True)
    if timer is not None and getattr(args, "json", False):
        _print_times(runtime, timer, args.out, run.schedule_name, batch, stdout or sys.stdout, run.config.precision,
                     history)
    if runtime.trace is not None:
        runtime.trace.write(Path(args.trace).resolve(), run.schedule_name)
    # NOTE: every rank past its last message before any tears its process group down (a rank
    # destroying gloo's pairs while a peer still drained --json's gather aborted in ~1 of 12
    # runs), and nothing of gloo left running (pipecc.runtime.teardown)
    teardown.leave()
    return 0


def _timer(args: argparse.Namespace, runtime: PipelineRuntime) -> ActionTimer | TraceRecorder | None:
    """With ``--json``: the runtime's action timer, set; with ``--trace``: the trace recorder
    around it (``pipecc.runtime.trace``), its clock aligned (collective)."""
    warmup = getattr(args, "warmup_steps", 1)
    if getattr(args, "json", False):
        runtime.timer = ActionTimer(runtime.global_rank, runtime.device, warmup, replica=runtime.replicas.index)
    if getattr(args, "trace", None) is not None:
        runtime.timer = runtime.trace = TraceRecorder(runtime.ctx, warmup, inner=runtime.timer)
        runtime.trace.align()
    return runtime.timer


def _memory_meter(args: argparse.Namespace, runtime: PipelineRuntime, timer: ActionTimer | TraceRecorder | None,
                  rows: Any, target: Any) -> contextlib.AbstractContextManager:
    """``--memory`` (with ``--json``): the rank's meter (``pipecc.runtime.memory``), handed to its
    action timer and entered around the loop; else nothing. It also counts the batch this rank
    feeds from before the loop (stage 0's inputs, the last stage's target)."""
    inner = getattr(timer, "inner", timer)  # --trace wraps the ActionTimer
    if not getattr(args, "memory", False) or not isinstance(inner, ActionTimer):
        return contextlib.nullcontext()
    feeds = [rows if 0 in runtime.stage_ids else None, target if runtime.last_stage in runtime.stage_ids else None]
    meter = memory_meter(runtime.device, runtime.modules, feeds)
    meter.optimizer = runtime.optimizer
    inner.memory = meter
    return meter


def _print_times(runtime: PipelineRuntime, timer: ActionTimer, out: Path, schedule: str, batch: int,
                 stdout: TextIO, precision: str | None, history: list[dict[str, Any]] | None = None) -> None:
    """``--json``: gather every rank's times to the last stage's rank, which prints the document
    (collective: every rank calls it)."""
    dst = runtime.replicas.rank_of(runtime.schedule.stage_to_rank[runtime.last_stage], 0)
    summaries = gather(timer.summary(runtime.stage_ids), dst, runtime.device)
    if summaries is not None:
        plan = read_plan(out)
        document = run_document(summaries, plan, schedule, runtime.m, batch,
                                stash=runtime.schedule.partner is not None, identity=plan_identity(out, plan))
        document["history"] = history or []  # every step this run trained: loss, wall time, samples/s, lr
        document["precision"] = precision or "fp32"  # what the stages ran under (autocast)
        print(json.dumps(document), file=stdout, flush=True)


def _run_forward(args: argparse.Namespace, folder: CompiledFolder, stage_dirs: list[Path],
                 specs: list[dict[str, Any]], data: RunData, modules: list[nn.Module], ports: list[dict],
                 rank: int, world: int, config: RunConfig, load_stage: Callable, why: str,
                 stdout: TextIO | None = None, replicas: Replicas | None = None, rows: tuple | None = None,
                 lengths: Sequence[int] = (), at_length: dict[int, tuple[RunData, tuple, Any]] | None = None) -> int:
    """An inference-only folder: ``--steps`` forward passes (eval mode) of the model's example
    inputs; ``--verify`` compares the first one's outputs with the original model's forward.
    ``--length`` (``lengths``): pass i at the (i mod n)-th length, each verified at its first pass."""
    for module in modules:
        module.eval()  # inference semantics: what an FPGA stage computes (BatchNorm folded, no dropout)
    runtime = PipelineRuntime(modules, ports, rank, world, config, replicas=replicas)
    timer = _timer(args, runtime)
    is_last = runtime.last_stage in runtime.stage_ids and runtime.replicas.index == 0  # the one that prints
    rows = data.inputs if rows is None else rows  # replicas: this replica's rows
    inputs = rows if 0 in runtime.stage_ids else None
    meta, batch = folder.marker, folder.batch(specs)
    if is_last:
        print(f"inference-only pipeline ({why}): running forward passes", flush=True)
    verifier = None
    verify = args.verify or args.verify_stages_only
    if args.verify and not args.verify_stages_only:
        verifier = Verifier(runtime, data, meta, stage_dirs, load_stage, args.rtol, args.atol)

    def check(outputs: Any) -> None:
        if verifier is not None:
            verifier.check_forward(outputs)
        elif outputs is not None:  # no model file: against all (torch) stages chained here
            verify_chained(outputs, rows, [load_stage(d)[0].eval().to(runtime.device) for d in stage_dirs], is_last)

    with _memory_meter(args, runtime, timer, rows, None):  # --memory: its meter counts the passes
        for i in range(args.steps):
            first = i == 0
            if lengths and at_length is not None:  # --length: this pass's batch, verified at its first pass
                n = lengths[i % len(lengths)]
                data, rows, _ = at_length[n]
                inputs = rows if 0 in runtime.stage_ids else None
                first = n not in lengths[:i]
                if verify and first and args.verify and not args.verify_stages_only and i > 0:
                    verifier = Verifier(runtime, data, meta, stage_dirs, load_stage, args.rtol, args.atol)
                if verify and first and is_last:
                    print(f"verify at {meta.get('lengths', {}).get('symbol')}={n}:", flush=True)
            if timer is not None:
                timer.begin_step()
            start = time.perf_counter()
            outputs = runtime.infer(inputs)
            elapsed = time.perf_counter() - start
            if timer is not None:
                timer.end_step(elapsed)
            if verify and first:
                check(outputs)
            if is_last:
                rate = f", {batch / elapsed:.1f} samples/s" if batch and elapsed > 0 else ""
                print(f"step {i}: forward only{rate}", flush=True)
        if verify and args.steps < 1:
            check(runtime.infer(inputs))  # --verify --steps 0: check one forward pass
    if timer is not None and getattr(args, "json", False):
        _print_times(runtime, timer, args.out, "inference", batch, stdout or sys.stdout, config.precision)
    if runtime.trace is not None:
        runtime.trace.write(Path(args.trace).resolve(), "inference")
    # NOTE: every rank past its last message before any tears its process group down (a rank
    # destroying gloo's pairs while a peer still drained --json's gather aborted in ~1 of 12
    # runs), and nothing of gloo left running (pipecc.runtime.teardown)
    teardown.leave()
    return 0


if __name__ == "__main__":
    sys.exit(main())
