"""A compiled stage as an ONNX file, checked against the torch stage with onnxruntime.

    export_and_check(OUT, i, DIR) -> OnnxCheck      DIR/stage_<i>.onnx and the comparison
    check_stages(OUT, DIR, [i, ...]) -> OnnxCheck per stage (the chain runs once)

Why per stage: a stage file is the unit that runs on one device; its ONNX form opens in Netron
(to look at what a stage computes) and runs in onnxruntime (to trust that it is the same).

How: `load_stage(OUT/stage_<i>)` gives the stage's nn.Module with its saved weights. Its inputs
come from running the pipeline's stages in order (torch, eval mode) on the model's example
inputs at the micro-batch size — from the model file's `example_inputs` when it is still there,
else random tensors shaped as stage 0's ports say — so every stage sees realistic values (token
ids in range, consistent sizes). Ports that are not tensors (an int from `x.size(1)`) cannot be
ONNX inputs or outputs: they are folded in as constants and listed in `OnnxCheck.constants`.
The export is static-shaped at the micro-batch size (`torch.onnx.export(..., dynamo=True)`).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch
from torch import nn

from pipecc.errors import PipeccError

if TYPE_CHECKING:
    from pipecc.runtime.folder import CompiledFolder

RTOL = 1e-4
ATOL = 1e-5             # plus ATOL_REL * max |torch output|
ATOL_REL = 1e-4
EXTERNAL_DATA_BYTES = 1 << 30  # weights above this go to DIR/stage_<i>.onnx.data
RELAY_SUFFIX = ".relayed"      # an output that passes an input on gets this name in the ONNX file


@dataclass
class OnnxCheck:
    """One stage's export and its comparison with the torch stage."""

    stage: int
    path: str
    ok: bool
    max_abs_diff: float
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    constants: list[str] = field(default_factory=list)   # non-tensor ports folded in
    message: str = ""

    def describe(self) -> str:
        folded = f"; non-tensor ports left out: {', '.join(self.constants)}" if self.constants else ""
        verdict = "matches torch" if self.ok else "DIFFERS from torch"
        return (f"stage {self.stage}: {self.path} {verdict} (max |onnx - torch| = "
                f"{self.max_abs_diff:.3g}; {len(self.inputs)} inputs, {len(self.outputs)} outputs"
                f"{folded}){': ' + self.message if self.message else ''}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class TensorStage(nn.Module):
    """The stage with its non-tensor inputs fixed and only its tensor outputs returned."""

    def __init__(self, stage: nn.Module, args: Sequence[Any]) -> None:
        super().__init__()
        self.stage = stage
        self.tensor_slots = [k for k, a in enumerate(args) if isinstance(a, torch.Tensor)]
        self.fixed = {k: a for k, a in enumerate(args) if not isinstance(a, torch.Tensor)}
        self.n_args = len(args)
        self.out_slots: list[int] = []

    def forward(self, *tensors: torch.Tensor) -> tuple:
        given = dict(zip(self.tensor_slots, tensors))
        args = [given[k] if k in given else self.fixed[k] for k in range(self.n_args)]
        outs = self.stage(*args)
        outs = outs if isinstance(outs, tuple) else (outs,)
        # NOTE: a relayed value is an input returned as is; ONNX needs a node to produce each
        # output under its own name, so it goes out as a copy.
        return tuple(outs[k].clone() if any(outs[k] is t for t in tensors) else outs[k]
                     for k in self.out_slots)


# ----------------------------------------------------------------------------- stage inputs
def model_inputs(folder: CompiledFolder, batch: int, seed: int = 0) -> dict[str, Any]:
    """Port name -> value of the model's inputs at `batch`, from the model file when it exists
    (``folder``: the ``CompiledFolder``, its marker read once by the caller)."""
    out, marker = folder.path, folder.marker
    ports = json.loads((out / "stage_0" / "ports.json").read_text(encoding="utf-8"))
    specs = sorted(ports.get("model_inputs") or marker.get("model_inputs") or [], key=lambda d: d["index"])
    # the model file's hashed bytes, checked as `pipecc run` checks them (`CompiledFolder.model_source`:
    # a model_path that is not the file compiled is one line; `inspect --onnx` runs the folder's code)
    path, source = folder.model_source()
    if path is not None and isinstance(source, bytes):
        from pipecc.frontend.modelfile import _call_with_accepted, import_model_file
        module = import_model_file(path, source)  # the bytes hashed, compiled from memory
        values = _call_with_accepted(module.example_inputs, batch, **(marker.get("model_args") or {}))
        values = tuple(values) if isinstance(values, (tuple, list)) else (values,)
        return {d["name"]: values[d["index"]] for d in specs if d["index"] < len(values)}
    gen = torch.Generator().manual_seed(seed)
    by_name = {p["name"]: p for p in ports["receives"]}
    env: dict[str, Any] = {}
    for d in specs:
        p = by_name.get(d["name"])
        if p is None or p.get("kind") != "tensor":
            env[d["name"]] = p.get("value") if p else None
            continue
        shape = list(p["shape"])
        if p.get("batch_dim") is not None:
            shape[p["batch_dim"]] = batch
        dtype = getattr(torch, p["dtype"])
        env[d["name"]] = (torch.randn(shape, generator=gen, dtype=dtype) if dtype.is_floating_point
                          else torch.zeros(shape, dtype=dtype))
    return env


def stage_modules_and_inputs(out: str | Path, upto: int | None = None) -> list[tuple[nn.Module, dict, list]]:
    """[(module, ports, positional inputs)] for stages 0..upto, inputs from running the chain."""
    from pipecc.runtime.folder import CompiledFolder
    from pipecc.runtime.folder_sums import require
    from pipecc.runtime.stagefile import load_stage
    out = Path(out)
    folder = CompiledFolder.read(out)
    require(out, folder.marker)  # the stage code run below, checked by hash (pipecc.runtime.folder_sums)
    n = folder.num_stages
    last = n - 1 if upto is None else upto
    if not 0 <= last < n:
        raise PipeccError(f"stage {upto}: {out} has stages 0..{n - 1}")
    batch = max(folder.batch_size // folder.microbatches, 1)  # one micro-batch
    env = model_inputs(folder, batch)
    result = []
    with torch.no_grad():
        for i in range(last + 1):
            module, ports = load_stage(out / f"stage_{i}")
            module.eval()
            missing = [p["name"] for p in ports["receives"] if p["name"] not in env]
            if missing:
                raise PipeccError(f"stage {i} receives {missing}, which no earlier stage sends")
            args = [env[p["name"]] for p in ports["receives"]]
            outs = module(*args)
            outs = outs if isinstance(outs, tuple) else (outs,)
            env.update({p["name"]: v for p, v in zip(ports["sends"], outs)})
            result.append((module, ports, args))
    return result


# ----------------------------------------------------------------------------- export, check
def export_stage(module: nn.Module, ports: dict[str, Any], args: Sequence[Any], path: str | Path
                 ) -> tuple[TensorStage, list[str], list[str], list[str]]:
    """Write `path` (ONNX); returns the tensor-only wrapper and the input, output, constant names."""
    wrapper = TensorStage(module, args)
    with torch.no_grad():
        outs = module(*args)
    outs = outs if isinstance(outs, tuple) else (outs,)
    wrapper.out_slots = [k for k, o in enumerate(outs) if isinstance(o, torch.Tensor)]
    names_in = [ports["receives"][k]["name"] for k in wrapper.tensor_slots]
    names_out = [ports["sends"][k]["name"] for k in wrapper.out_slots]
    names_out = [f"{name}{RELAY_SUFFIX}" if name in names_in else name for name in names_out]
    constants = [f"{ports['receives'][k]['name']}={v!r} (input, fixed)" for k, v in wrapper.fixed.items()]
    constants += [f"{ports['sends'][k]['name']} (output)" for k, o in enumerate(outs)
                  if not isinstance(o, torch.Tensor)]
    if not names_out:
        raise PipeccError(f"stage {ports.get('stage')} returns no tensors; nothing to export")
    tensors = tuple(args[k] for k in wrapper.tensor_slots)
    weight_bytes = sum(t.numel() * t.element_size() for t in module.state_dict().values())
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with _quiet_exporter():
            program = torch.onnx.export(wrapper.eval(), tensors, dynamo=True, verbose=False)
            _name_ports(program.model.graph, names_in, names_out)
    except Exception as exc:  # the exporter's failure is the user's answer: say which stage
        first = (str(exc).strip().splitlines() or [""])[0]
        raise PipeccError(f"stage {ports.get('stage')}: ONNX export failed: "
                          f"{type(exc).__name__}: {first}") from exc
    _save_whole(program, path, weight_bytes > EXTERNAL_DATA_BYTES)
    return wrapper, names_in, names_out, constants


def _save_whole(program: Any, path: Path, external: bool) -> None:
    """Save into a temporary folder beside `path` under the final names (an external-data file
    is referred to by name), then rename into place: a full disk leaves no partial .onnx."""
    import shutil
    import tempfile
    from pipecc.runtime.atomic import temp_prefix
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(path, "new"), dir=path.parent))
    try:
        with _quiet_exporter():
            program.save(str(tmp / path.name), external_data=external)
        for item in sorted(tmp.iterdir(), key=lambda p: p.name == path.name):  # the .onnx last
            os.replace(item, path.parent / item.name)
    except OSError as exc:
        raise PipeccError(f"cannot write {path}: {exc.strerror or exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _name_ports(graph: Any, names_in: Sequence[str], names_out: Sequence[str]) -> None:
    """Name the ONNX graph's inputs and outputs after the stage's ports. The exporter names
    its own values after their ops (`add_1`), which can be a port's name too: such a value is
    renamed first (`add_1__1`), so every name is defined once."""
    ports = dict(zip(graph.inputs, names_in))
    ports.update(zip(graph.outputs, names_out))
    wanted = set(ports.values())
    used = {v.name for v in graph.inputs} | {v.name for node in graph for v in node.outputs}
    used |= set(graph.initializers) | wanted
    for node in graph:
        for value in node.outputs:
            if value.name in wanted and value not in ports:
                k = 1
                while f"{value.name}__{k}" in used:
                    k += 1
                value.name = f"{value.name}__{k}"
                used.add(value.name)
    for value, name in ports.items():
        value.name = name


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """The exporter logs warnings about optional packages (torchvision) and prints progress;
    neither is the user's business here."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def run_onnx(path: str | Path, names_in: Sequence[str], tensors: Sequence[torch.Tensor]) -> list[Any]:
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.log_severity_level = 3
    try:
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        feeds = {i.name: t.detach().cpu().numpy() for i, t in zip(session.get_inputs(), tensors)}
        if [i.name for i in session.get_inputs()] != list(names_in):
            feeds = {n: t.detach().cpu().numpy() for n, t in zip(names_in, tensors)}
        return session.run(None, feeds)
    except Exception as exc:  # onnxruntime's own errors: one line, naming the file
        first = (str(exc).strip().splitlines() or [""])[0]
        raise PipeccError(f"onnxruntime cannot run {path}: {first}") from exc


def compare(reference: Sequence[torch.Tensor], got: Sequence[Any]) -> tuple[bool, float, str]:
    """(ok, max abs diff, message) with tolerance rtol RTOL, atol ATOL + ATOL_REL * max|ref|."""
    if len(reference) != len(got):
        return False, float("inf"), f"{len(got)} outputs, torch has {len(reference)}"
    worst, ok, msg = 0.0, True, ""
    for k, (ref, value) in enumerate(zip(reference, got)):
        value = torch.as_tensor(value)
        if tuple(value.shape) != tuple(ref.shape):
            return False, float("inf"), f"output {k} has shape {tuple(value.shape)}, torch {tuple(ref.shape)}"
        if not ref.is_floating_point():
            diff = float((value.to(ref.dtype) != ref).sum())
            ok, worst = ok and diff == 0, max(worst, diff)
            continue
        ref64, val64 = ref.double(), value.double()
        diff = float((val64 - ref64).abs().max()) if ref.numel() else 0.0
        scale = float(ref64.abs().max()) if ref.numel() else 0.0
        worst = max(worst, diff)
        try:
            torch.testing.assert_close(val64, ref64, rtol=RTOL, atol=ATOL + ATOL_REL * scale)
        except AssertionError as exc:
            ok, msg = False, f"output {k}: " + str(exc).strip().splitlines()[0]
    return ok, worst, msg


def check_destination(dest: str | Path) -> None:
    """A one-line PipeccError unless DEST is a folder, or can be created as one."""
    dest = Path(dest)
    if dest.exists() and not dest.is_dir():
        raise PipeccError(f"--onnx {dest}: it is a file, not a folder; give a folder for the "
                          "stage_<i>.onnx files")
    if not dest.is_dir():
        from pipecc.backends.torch.compile import check_writable_target
        check_writable_target(dest)


def export_and_check(out: str | Path, stage: int, dest: str | Path) -> OnnxCheck:
    """Export stage `stage` of OUT to DEST/stage_<i>.onnx and compare it with the torch stage."""
    return next(check_stages(out, dest, [stage]))


def check_stages(out: str | Path, dest: str | Path, stages: Sequence[int] | None = None
                 ) -> Iterator[OnnxCheck]:
    """`export_and_check` for several stages (default all), running the chain once."""
    check_destination(dest)
    chain = stage_modules_and_inputs(out, max(stages) if stages else None)
    for i in (stages if stages is not None else range(len(chain))):
        module, ports, args = chain[i]
        path = Path(dest) / f"stage_{i}.onnx"
        wrapper, names_in, names_out, constants = export_stage(module, ports, args, path)
        tensors = [args[k] for k in wrapper.tensor_slots]
        with torch.no_grad():
            reference = list(wrapper(*tensors))
        ok, diff, msg = compare(reference, run_onnx(path, names_in, tensors))
        yield OnnxCheck(i, str(path), ok, diff, names_in, names_out, constants, msg)
