"""FPGA stages inside a pipeline: the HLS project of every stage a plan puts on an FPGA card,
and the C-simulated stage running in place of the torch stage.

    plan + cut stages + the model's example inputs
      ─► stage_inputs: the torch stages run in order (eval mode, no grad) give each stage's
         boundary input (what the FPGA stage's golden data is taken from)
      ─► compile_fpga_stages: write_fpga_stage into `<folder>/stage_<i>/hls/` (FPGA.md layout)
         and mark `pipecc.json` with "inference_only": true and "fpga_stages"
      ─► FpgaPipelineStage: the stage's port convention (received values positionally, a tuple
         of sent values) around FpgaStageModule (one float32 tensor in, one out, forward only)
      ─► mixed_pipelined_module (pipecc.compile) / load_mixed (pipecc.load): a PipelinedModule
         whose FPGA stages run through the C simulation

An FPGA stage computes eval-mode semantics (BatchNorm folded with its running statistics) and
has no backward: a plan with FPGA stages is inference-only, and a backward through one raises.
The torch `stage.py` of an FPGA stage is still written: it holds the weights (so `state_dict()`
keys stay the model's) and is the reference `pipecc csim` compares against. Its parameters do
not feed the FPGA stage, whose weights were fixed when the HLS project was written.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch
from torch import nn

from pipecc.errors import PipeccError
from pipecc.ir.graph import META_VALUE, TensorInfo

from .codegen import write_fpga_stage
from .module import FpgaStageModule

HLS_DIR = "hls"            # stage_<i>/hls/: the stage's HLS project


def _port_label(port: Any) -> str:
    value = port.value
    if isinstance(value, TensorInfo):
        kind = f"tensor {str(value.dtype).removeprefix('torch.')}"
    elif isinstance(value, (tuple, list)):
        kind = "tuple"
    else:
        kind = type(value).__name__ if value is not None else "object"
    return f"{port.producer!r} ({kind})"


def check_boundary(stage: Any, card: str) -> None:
    """An FPGA stage receives one float32 tensor and sends one; else a PipeccError naming ports."""
    def ok(ports: Sequence[Any]) -> bool:
        return len(ports) == 1 and isinstance(ports[0].value, TensorInfo) \
            and ports[0].value.dtype == torch.float32
    if ok(stage.receives) and ok(stage.sends):
        return
    recv = ", ".join(_port_label(p) for p in stage.receives) or "nothing"
    send = ", ".join(_port_label(p) for p in stage.sends) or "nothing"
    raise PipeccError(f"FPGA stage {stage.index} ({card}): the FPGA stage boundary must be a "
                      f"single float32 tensor in and a single float32 tensor out, but it receives "
                      f"[{recv}] and sends [{send}]; move the cut or put a CPU/GPU there")


@contextlib.contextmanager
def _eval_mode(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Every submodule in eval mode (what an FPGA stage computes); the flags restored after."""
    saved = [(m, m.training) for root in modules for m in root.modules()]
    try:
        for m, _ in saved:
            m.training = False
        yield
    finally:
        for m, flag in saved:
            m.training = flag


def stage_inputs(stages: Sequence[Any], example_inputs: Sequence[Any],
                 upto: int | None = None) -> list[list[Any]]:
    """What each stage receives when the model runs on `example_inputs` (eval mode, no grad),
    computed by running the torch stage modules in order (stages 0..upto)."""
    inputs = tuple(example_inputs)
    env: dict[str, Any] = {}
    for spec in stages[0].model_inputs if stages else []:
        if spec["index"] >= len(inputs):
            raise PipeccError(f"the model takes input {spec['arg']!r} (position {spec['index']}) "
                              f"but {len(inputs)} example inputs were given")
        env[spec["name"]] = inputs[spec["index"]]
    last = len(stages) - 1 if upto is None else upto
    received: list[list[Any]] = []
    with torch.no_grad(), _eval_mode([s.gm for s in stages[:last + 1]]):
        for stage in stages[:last + 1]:
            args = [env[p.name] for p in stage.receives]
            received.append(args)
            if stage.index < last:
                outputs = stage.gm(*args)
                env = dict(zip([p.name for p in stage.sends], outputs))
    return received


def example_inputs_for(graph: Any, seed: int = 0) -> tuple:
    """Random inputs shaped like the graph's placeholders (for models without example inputs,
    e.g. ONNX files): float tensors ~ N(0, 1), integer tensors 0."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in graph.gm.graph.nodes:
        if n.op != "placeholder":
            continue
        info = n.meta.get(META_VALUE)
        if not isinstance(info, TensorInfo):
            raise PipeccError(f"cannot make an example value for input {n.name!r}; give example inputs")
        shape = [int(d.subs(graph.point)) if hasattr(d, "subs") else int(d) for d in info.shape]
        out.append(torch.randn(shape, generator=g).to(info.dtype) if info.dtype.is_floating_point
                   else torch.zeros(shape, dtype=info.dtype))
    return tuple(out)


# ----------------------------------------------------------------------------- writing
def write_hls(stage_dir: str | Path, stage: Any, x: torch.Tensor, card: str,
              number: str = "float") -> Path:
    """`stage_dir/hls/`: the HLS project of `stage` (eval mode) with golden data from `x`."""
    stage_dir = Path(stage_dir)
    stage_dir.mkdir(parents=True, exist_ok=True)
    with _eval_mode([stage.gm]):
        written = write_fpga_stage(stage_dir, stage.gm, x, card, number, stage_index=stage.index)
    final = stage_dir / HLS_DIR
    if final.exists():
        shutil.rmtree(final)
    written.rename(final)
    return final


def compile_fpga_stages(folder: str | Path, graph: Any, plan: Any, stages: Sequence[Any],
                        example_inputs: Sequence[Any] | None, number: str = "float") -> list[int]:
    """Write `folder/stage_<i>/hls/` for every FPGA stage of `plan`; returns their indices.

    `folder` is the compiled folder being written (write_output's temporary folder). Its
    `pipecc.json`, when present, gains "inference_only": true and "fpga_stages".
    """
    cards = plan.fpga_stages()
    if not cards:
        return []
    by_index = {s.index: s for s in stages}
    for i, card in cards.items():
        check_boundary(by_index[i], card)
    inputs = example_inputs if example_inputs is not None else example_inputs_for(graph)
    received = stage_inputs(stages, inputs, upto=max(cards))
    folder = Path(folder)
    info: dict[str, Any] = {}
    for i, card in sorted(cards.items()):
        hls = write_hls(folder / f"stage_{i}", by_index[i], received[i][0], card, number)
        meta = json.loads((hls / "stage.json").read_text())
        info[str(i)] = {"card": card, "number": meta["number"], "hls": f"stage_{i}/{HLS_DIR}",
                        "top": meta["top"]}
    from pipecc.runtime.folder import MARKER, update_marker  # the marker's one form
    if (folder / MARKER).is_file():
        update_marker(folder, dict(inference_only=True, fpga_stages=info,
                                   inference_only_reason="FPGA stages have no backward pass (forward-only "
                                   "C simulation); run the pipeline under torch.no_grad()"))
    return sorted(cards)


# ----------------------------------------------------------------------------- running
class FpgaPipelineStage(nn.Module):
    """Stage `index` on an FPGA, called like a torch stage: `(x,) -> (y,)` through the C
    simulation (FpgaStageModule: float32, forward only; a backward through it raises)."""

    def __init__(self, hls_dir: str | Path, index: int, *, threaded: bool = False,
                 keep: Any = None) -> None:
        super().__init__()
        self.index = int(index)
        self.fpga = FpgaStageModule(hls_dir, threaded=threaded)
        self._keep = keep  # e.g. the finalizer of a temporary folder holding hls_dir

    def forward(self, *args: Any) -> tuple:
        if len(args) != 1 or not isinstance(args[0], torch.Tensor):
            raise PipeccError(f"FPGA stage {self.index} takes one tensor, got {len(args)} values")
        x = args[0]
        y = self.fpga(x.to(torch.float32))
        return (y.to(x.dtype) if x.dtype.is_floating_point else y,)

    def extra_repr(self) -> str:
        return f"stage {self.index} (C simulation)"


def _usable_hls(hls: Path) -> tuple[Path, Any]:
    """`hls`, or a temporary copy when it is not writable (the build goes into csim_build/)."""
    if os.access(hls, os.W_OK):
        return hls, None
    tmp = Path(tempfile.mkdtemp(prefix="pipecc-fpga-"))
    shutil.copytree(hls, tmp / HLS_DIR, ignore=shutil.ignore_patterns("csim_build"))
    return tmp / HLS_DIR, _Cleanup(tmp)


def mixed_pipelined_module(model: nn.Module, graph: Any, plan: Any, stages: Sequence[Any],
                           example_inputs: Sequence[Any] | None, *,
                           devices: Sequence[Any] | None = None, number: str = "float",
                           fpga_dir: str | Path | None = None) -> Any:
    """`pipecc.compile`'s drop-in module when the plan has FPGA stages: each FPGA stage's HLS
    project is written (into `fpga_dir`, else a temporary folder removed with the module),
    built with g++, and run in place of its torch stage."""
    from pipecc.backends.torch.stages import ports_json
    from pipecc.runtime.local import PipelinedModule

    cards = plan.fpga_stages()
    keep = None
    if fpga_dir is None:
        root = Path(tempfile.mkdtemp(prefix="pipecc-fpga-"))
    else:
        root = Path(fpga_dir)
        root.mkdir(parents=True, exist_ok=True)
    try:
        compile_fpga_stages(root, graph, plan, stages, example_inputs, number)
        if fpga_dir is None:
            keep = _Cleanup(root)
        modules: list[nn.Module] = [
            FpgaPipelineStage(root / f"stage_{s.index}" / HLS_DIR, s.index, keep=keep)
            if s.index in cards else s.gm for s in stages]
    except BaseException:
        if fpga_dir is None:
            shutil.rmtree(root, ignore_errors=True)
        raise
    ports = [ports_json(s, len(stages)) for s in stages]
    pm = PipelinedModule(modules, ports, owner=model, microbatches=plan.microbatches,
                         devices=devices)
    _mark_inference_only(pm, cards)
    return pm


class _Cleanup:
    """Removes a temporary folder when the last FPGA stage holding it is collected."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._fin = weakref.finalize(self, shutil.rmtree, str(root), True)


def load_mixed(out_dir: str | Path, *, devices: Sequence[Any] | None = None,
               microbatches: int | None = None, threaded: bool = False, folder: Any = None) -> Any:
    """`pipecc.load` for a compiled folder with `stage_<i>/hls/`: those stages run through
    the C simulation (built with g++ on first use, cached in `hls/csim_build/`). `folder`: the
    `CompiledFolder` already opened (`pipecc.load`'s), not read again."""
    from pipecc.runtime.local import PipelinedModule
    from pipecc.runtime.stagefile import assemble_owner, load_stage

    out = Path(out_dir)
    from pipecc.runtime.folder import CompiledFolder
    if folder is None:  # checked, the torch code and weights recorded by hash; a library caller's words when none
        folder = CompiledFolder.open(out, f"{out} is not a folder written by `pipecc compile` "
                                          "(no readable pipecc.json)")
    from pipecc.runtime.folder_sums import check, read_regular, recorded_files
    for rel in recorded_files(out):  # the HLS projects too, before any is copied or built
        if "/hls/" in f"/{rel}":
            check(out, rel, read_regular(out / rel), folder.sums)
    loaded = [load_stage(out / f"stage_{i}") for i in range(folder.num_stages)]
    torch_modules, ports = [m for m, _ in loaded], [p for _, p in loaded]
    owner = assemble_owner(torch_modules)  # every stage's weights, FPGA stages' too
    modules: list[nn.Module] = []
    fpga: dict[int, str] = {}
    for i, (module, spec) in enumerate(zip(torch_modules, ports)):
        hls = out / f"stage_{i}" / HLS_DIR
        if not hls.is_dir():
            modules.append(module)
            continue
        _check_ports_json(i, spec)
        where, keep = _usable_hls(hls)
        modules.append(FpgaPipelineStage(where, i, threaded=threaded, keep=keep))
        fpga[i] = json.loads((hls / "stage.json").read_text()).get("card", "fpga")
    m = microbatches if microbatches is not None else folder.microbatches
    pm = PipelinedModule(modules, ports, owner=owner, microbatches=m, devices=devices)
    _mark_inference_only(pm, fpga)
    return pm


def _check_ports_json(index: int, spec: Mapping[str, Any]) -> None:
    def ok(ports: Sequence[Mapping[str, Any]]) -> bool:
        return len(ports) == 1 and ports[0].get("kind") == "tensor" \
            and ports[0].get("dtype") == "float32"
    def names(ports: Sequence[Mapping[str, Any]]) -> str:
        return ", ".join(repr(p.get("producer", p["name"])) for p in ports)
    if not (ok(spec["receives"]) and ok(spec["sends"])):
        raise PipeccError(f"FPGA stage {index}: the FPGA stage boundary must be a single float32 "
                          f"tensor in and out, but it receives [{names(spec['receives'])}] and "
                          f"sends [{names(spec['sends'])}]")


def _mark_inference_only(pm: Any, cards: Mapping[int, str]) -> None:
    pm.inference_only = True  # type: ignore[attr-defined]
    pm.fpga_stages = dict(cards)  # type: ignore[attr-defined]
