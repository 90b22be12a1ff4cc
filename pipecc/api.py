"""The Python API (CONTRACT §7): `pipecc.compile` and `pipecc.load`.

    pm = pipecc.compile(model, example_inputs, "cpu,cpu")   # a drop-in nn.Module
    loss_fn(pm(x), y).backward()                              # same grads on model's params

`compile` runs the driver (`analyze_module`, `plan`, `compile_module`), which chooses the
backends. Devices with FPGA cards ("cpu,u250,cpu"): each FPGA stage is written as its HLS
project, built with g++ and run through the C simulation (the FPGA backend); such pipelines
are inference-only (forward in eval-mode semantics; a backward through an FPGA stage raises).
`pipecc.load` does the same for compiled folders holding `stage_<i>/hls/`.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from pipecc import driver
from pipecc.errors import PipeccError, UsageError
from pipecc.passes.plan_options import PlanOptions
from pipecc.targets.devices import Cluster, parse_devices
from pipecc.runtime import local
from pipecc.runtime.local import PipelinedModule


def torch_devices(cluster: Cluster, order: Sequence[int] | None = None) -> list[str]:
    """Where each stage runs in this process: the `@PLACE` given, else cuda:i / cpu."""
    out = []
    gpus = torch.cuda.device_count()
    for i, dev in enumerate(cluster.devices if order is None else [cluster.devices[j] for j in order]):
        if dev.placement:
            out.append(dev.placement)
        elif dev.kind == "gpu" and gpus:
            out.append(f"cuda:{i % gpus}")
        else:
            out.append("cpu")
    return out


def compile(model: torch.nn.Module, example_inputs: Any, devices: str | Sequence[str],  # noqa: A001
            **plan_options: Any) -> PipelinedModule:
    """Plan `model` over `devices` and return the drop-in PipelinedModule.

    `plan_options` are the fields of `pipecc.passes.plan_options.PlanOptions` (microbatches,
    schedule, coarse, choose_order, split_layers, training, recompute="none"|"full"|"auto",
    replicas: N devices per stage, default 1 — one process runs every stage, so replica groups
    would not run side by side; `profile`: a `pipecc profile` JSON file or its loaded dict, its
    node names the model's, measured costs for the devices it timed; a plan with unequal
    per-stage microbatch_sizes is refused: `pipecc run` runs those; `fpga_number`, "float" here,
    or "ap_fixed<W,I>"), or `options=PlanOptions(...)` itself, plus `debug` and `dump_ir` (every
    step), and for FPGA devices `fpga_dir` (where to keep the HLS projects; default a temporary
    folder removed with the module). The model's
    parameters are shared, not copied: an optimizer built on `model.parameters()` before
    wrapping keeps working, and the analysis leaves the model's parameters, buffers, train
    flags and RNG state as it found them.

    BatchNorm in training mode normalises each micro-batch with its own statistics (as GPipe
    and torchgpipe do): with more than one micro-batch its outputs differ from the model's,
    which `compile` warns about; `microbatches=1` gives equal outputs, and
    `strict_batchnorm=True` refuses such a pipeline instead of warning. Dropout in training
    mode draws its masks per micro-batch: with more than one, outputs and gradients differ from
    the model's by design (equal in distribution); `microbatches=1` or eval mode gives equal ones.
    """
    fpga_dir = plan_options.pop("fpga_dir", None)
    strict_batchnorm = bool(plan_options.pop("strict_batchnorm", False))
    debug, dump_ir = bool(plan_options.pop("debug", False)), plan_options.pop("dump_ir", None)
    if callable(example_inputs):
        raise UsageError(f"example_inputs is a function ({getattr(example_inputs, '__name__', 'callable')}); "
                         "pass a tuple of inputs, e.g. pipecc.compile(model, example_inputs(8), ...)")
    if isinstance(plan_options.get("split_layers"), str):  # the command line's spelling
        word = plan_options["split_layers"]
        if word not in ("on", "off"):
            raise UsageError(f"split_layers={word!r}: use True or False (or \"on\"/\"off\")")
        plan_options["split_layers"] = word == "on"
    options = PlanOptions.of(plan_options.pop("options", None), **plan_options)
    if "fpga_number" not in plan_options and options.fpga_number is None:
        options = PlanOptions.of(options, fpga_number="float")
    fpga_number = options.fpga_number
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    cluster = parse_devices(devices) if not isinstance(devices, Cluster) else devices
    graph = driver.analyze_module(model, inputs, model_name=type(model).__name__, debug=debug,
                                  dump_ir=dump_ir)
    # NOTE: one process runs every stage here, so replica groups and BPipe's pairs could not
    # run side by side: PlanOptions' defaults (replicas 1, no activation balancing) are the
    # drop-in's (`pipecc run` runs both)
    plan, graph = driver.plan(graph, cluster, options, debug=debug, dump_ir=dump_ir)
    if plan.microbatch_sizes is not None:  # NOTE: the one-process module splits equally (v1)
        raise UsageError("the drop-in module runs equal micro-batches only; unequal per-stage "
                         "sizes (microbatch_sizes) run with `pipecc compile` and `pipecc run`")
    # NOTE: in one process a replicated stage runs once, on its group's first device, over the
    # whole micro-batch: the same numbers as its replicas together (PP x DP is `pipecc run`'s)
    order = [d.get("given_index", i) for i, d in enumerate(plan.devices)]
    placement = torch_devices(cluster, order)
    return driver.compile_module(model, graph, plan, inputs,
                                 devices=[placement[s.device] for s in plan.stages],
                                 fpga_number=fpga_number, fpga_dir=fpga_dir,
                                 strict_batchnorm=strict_batchnorm, debug=debug, dump_ir=dump_ir)


def load(out_dir: Any, *, devices: Sequence[str | torch.device] | None = None,
         microbatches: int | None = None) -> PipelinedModule:
    """A PipelinedModule over a compiled folder (see `pipecc.runtime.local.load`); stages with
    an HLS project (`stage_<i>/hls/`, FPGA stages) run through the C simulation, built with
    g++ on first use. Such pipelines are inference-only. `module.plan` is the folder's
    plan.json (a `pipecc.ir.plan.Plan`), as for `pipecc.compile`."""
    from pathlib import Path

    from pipecc.passes.batchdim_mixing import Mixing
    from pipecc.runtime.loss_kinds import split_words
    from pipecc.runtime.folder import CompiledFolder
    folder = None
    try:  # a model whose nodes mix samples (found at compile): no split batch here either
        folder = CompiledFolder.open(out_dir)
        found, split = folder.marker.get("batch_mixing"), split_words(folder.run_microbatches(microbatches))
    except PipeccError:  # the loader below says what is wrong with the folder
        found, split = None, ""
    if isinstance(found, dict) and split and set(found) <= {"node", "why", "fix"}:
        raise PipeccError(Mixing(**{k: str(v) for k, v in found.items()}).message(split))
    if any(p.is_dir() for p in Path(out_dir).glob("stage_*/hls")):
        from pipecc.backends.fpga.pipeline import load_mixed
        module = load_mixed(out_dir, devices=devices, microbatches=microbatches, folder=folder)
    else:  # the folder opened above (None: the loader opens it and says what is wrong with it)
        module = local.load(out_dir, devices=devices, microbatches=microbatches, folder=folder)
    # for inspection: pm.plan.stages (the loaders above opened the folder, so `folder` is that one)
    module.plan = (folder or CompiledFolder.read(out_dir)).typed_plan  # type: ignore[assignment]
    return module
