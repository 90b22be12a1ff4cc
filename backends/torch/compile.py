"""The torch backend's outputs: a compiled folder on disk, or the drop-in module in memory.

`write_output(OUT, graph, plan, stages)` writes, atomically:

    OUT/pipecc.json          marker: format version, model (and its file's sha256), schedule,
                             micro-batches, stages, "replicas" (PP x DP: devices per stage, each
                             replica loading the same stage_<i>/; `pipecc run` starts one rank
                             per device), each technique's entries (its codegen part's
                             `marker_fields`: "microbatch_sizes", UMPIPE's size lists, null for
                             equal splits; "bipartition", "ship" when the workers hold
                             Bi-Partition segments, else ""; "activation_balancing", BPipe's
                             pairs, [] when off) and the list of files written ("files")
    OUT/plan.json            the plan (`Plan.dumps()`)
    OUT/schedule.txt         the plan's validated action list in the schedule IR's text form
                             (`pipecc.techniques.schedule_of`, `pipecc.ir.schedule.format`): what
                             `pipecc run` parses, validates and executes (`SCHEDULE_FILE`)
    OUT/stage_<i>/stage.py   readable standalone nn.Module (see codegen.py)
    OUT/stage_<i>/weights.safetensors, OUT/stage_<i>/ports.json
    OUT/stage_<i>/segment_<b>.{py,safetensors}   Bi-Partition segments (its codegen part's
                             `write_stages`; traced once there: one AOTAutograd cannot split is refused)
    OUT/run_stage.py         the entry torchrun starts: `torchrun --nproc-per-node P OUT/run_stage.py`
    + extra_files            e.g. report.html, written by the caller's generators
    + writers                callables given the temporary folder before the rename (e.g. the
                             FPGA backend adding `stage_<i>/hls/`); an exception from one
                             fails the whole compile, leaving no OUT

Everything is written into a temporary folder beside OUT, which replaces OUT by rename only
when complete: a failed compile leaves no OUT (an existing pipecc OUT stays as it was), no
temporary folder and no parent folder it created.

Never delete what pipecc did not write. The marker lists every file the compile wrote
(`"files"`), each with a keyed hash (`"files_mac"`, `backends.torch.manifest`: a hand-made
marker proves nothing); a folder from before that list counts the files matching pipecc's layout
(`LAYOUT`) as pipecc's. Recompiling into OUT replaces those (and the caches made from them,
`CACHE`); every other file of OUT is carried into the new OUT (a hard link, so a kill at any
moment loses nothing) and named on stderr (`progress.notice`). One that sits where the new OUT
has a file is an error naming it, or with `force=True` replaced and named. A folder without a
marker is written into only with `force=True` (or when empty); a file or a symbolic link as
OUT never.

Temporary names carry the host and pid of their writer (`temp_prefix`); the next write of the
same OUT removes those of dead processes (and any older than an hour), so a SIGKILL leaves
litter only until then (`clean_stale_temps`).

`pipelined_module(model, stages, ...)` is the in-memory counterpart (`pipecc.compile`): the stage
GraphModules over the model's own parameters, wrapped in `pipecc.runtime.PipelinedModule`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Mapping, Sequence

import torch

from pipecc import progress

from pipecc.backends.torch.codegen import write_stage, written_as
from pipecc.techniques import first_answer, hooks
from pipecc.backends.torch.inplace import ClonesInputs, written_inputs
from pipecc.backends.torch.manifest import CACHE, LAYOUT, pipecc_wrote, sign  # noqa: F401 (CACHE, LAYOUT: re-exported)
from pipecc.backends.torch.stages import Stage, plan_as_cut, ports_json
from pipecc.errors import PipeccError
from pipecc.ir.graph import AnnotatedGraph
from pipecc.ir.plan import Plan
from pipecc.techniques import schedule_of
from pipecc.ir.schedule.text import format as schedule_text
from pipecc.runtime.local import PipelinedModule
from pipecc.runtime.folder import MARKER_VERSION, CompiledFolder, update_marker, write_marker
from pipecc.runtime.schedule_file import SCHEDULE_FILE
from pipecc.runtime.trust import file_sha256
from pipecc.runtime.atomic import (HOST, NAME_MAX, STALE_AFTER_S, TEMP_NAME, TEMP_TAG, entries,  # noqa: F401 (re-exported)
                                   make_parents, same_file, short_name, temp_prefix, temp_status, umask_modes)

FORMAT = "pipecc-compile"
FORMAT_VERSION = MARKER_VERSION  # the one layout the runtime reads (pipecc.runtime.folder)
# NOTE: `pipecc run` imports the model file only when its hash is this one (pipecc.runtime.trust)
MODEL_HASH = "model_sha256"

RUN_STAGE = '''"""Entry point of a compiled pipeline: `torchrun --nproc-per-node P run_stage.py [--steps N]`.

Generated by pipecc. Each process runs the stages its rank holds through the distributed
runtime, `pipecc.runtime.dist.main`, with this folder and the command-line arguments.
"""
import sys
from pathlib import Path


def main() -> int:
    try:
        from pipecc.runtime import dist
    except ImportError as exc:
        sys.exit(f"run_stage.py: the pipecc distributed runtime (pipecc.runtime.dist) cannot be "
                 f"imported ({exc}); install pipecc in this environment")
    return dist.main([str(Path(__file__).resolve().parent), *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
'''


def write_output(out_dir: str | Path, graph: AnnotatedGraph, plan: Plan, stages: Sequence[Stage], *,
                 force: bool = False, extra_files: Mapping[str, str | bytes] | None = None,
                 writers: Sequence[Callable[[Path], None]] = ()) -> Path:
    """Write the compiled folder `out_dir` atomically (see the module docstring); returns it.

    Each of `writers` is called, in order, with the complete temporary folder before it
    replaces `out_dir`. Any OSError (a parent that is a file, a folder that cannot be
    written, a name too long) becomes a one-line PipeccError; nothing is left on disk.
    """
    out = Path(out_dir)
    check_output_folder(out, force)
    clean_stale_temps(out)
    created: list[Path] = []
    tmp: Path | None = None
    try:
        make_parents(out.parent, created)
        tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(out, "new"), dir=out.parent))
        _write_all(tmp, graph, plan, stages, extra_files or {})
        for writer in writers:
            writer(tmp)
        _add_manifest(tmp)
        umask_modes(tmp)
        _replace(tmp, out, force)
    except BaseException as exc:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        for folder in reversed(created):
            with contextlib.suppress(OSError):
                folder.rmdir()
        if isinstance(exc, OSError):
            raise PipeccError(f"cannot write {out}: {_why(exc)}") from exc
        raise
    return out


def _mixing(graph: AnnotatedGraph) -> dict[str, str] | None:
    """The node that mixes samples (`pipecc.passes.batchdim`, found by the driver), for
    `pipecc run -m N` to refuse a run that splits the batch; None when micro-batches are sound."""
    found = graph.gm.meta.get("pipecc.batch_mixing")
    return dataclasses.asdict(found) if dataclasses.is_dataclass(found) else None


def _loss_reduction(graph: AnnotatedGraph) -> dict[str, str]:
    """How the model file's loss_fn combines over micro-batches (`pipecc.runtime.loss_reduction`,
    found by the driver's analysis): the runtime weights each micro-batch loss by it."""
    found = graph.gm.meta.get("pipecc.loss_reduction")
    return found.to_json() if hasattr(found, "to_json") else {"kind": "mean", "why": ""}


def _write_all(tmp: Path, graph: AnnotatedGraph, plan: Plan, stages: Sequence[Stage],
               extra_files: Mapping[str, str | bytes]) -> None:
    n = len(stages)
    if n != len(plan.stages):
        raise PipeccError(f"the plan has {len(plan.stages)} stages but {n} were cut")
    # NOTE: the techniques' scope the driver asked before any stage was cut
    # (`pipecc.techniques.requires`); here only what the folder records is derived
    fields: dict[str, Any] = {}
    for marker_fields in hooks("codegen", "marker_fields"):  # each technique's entries, checked (UMPIPE's sizes, ...)
        fields.update(marker_fields(plan))
    (tmp / "plan.json").write_text(plan_as_cut(plan, graph).dumps(), encoding="utf-8")  # the stage.py's nodes
    # NOTE: first, so that a stage calling a model-file function loads here too (segment tracing):
    # it finds the model file through the marker (pipecc.runtime.modelfuncs)
    marker = {"format": FORMAT, "version": FORMAT_VERSION, "model": graph.model_name,
              "model_path": plan.model_path, "model_args": plan.model_args,
              "batch_size": plan.batch_size, "microbatches": plan.microbatches,
              "schedule": plan.schedule, "num_stages": n, "devices": plan.devices,
              "replicas": plan.replicas, "microbatch_sizes": None, "bipartition": None,
              "precision": plan.options.get("precision", "fp32"),
              "activation_balancing": None,
              "source": graph.source, "torch": torch.__version__,
              "batch_mixing": _mixing(graph),
              "loss_reduction": _loss_reduction(graph),
              "model_inputs": stages[0].model_inputs if stages else [],
              "model_output": stages[-1].model_output if stages else None,
              MODEL_HASH: _sha256(plan.model_path)}
    # NOTE: the techniques' entries take the places pipecc.json has always had them (`update`
    # keeps a key's place: the file reads as before); a new technique's follow the rest
    marker.update(fields)
    if plan.options.get("lengths"):  # a declared length range (pipecc.varlen): `pipecc run --length`
        marker["lengths"] = {k: v for k, v in plan.options["lengths"].items() if k != "table"}
    write_marker(tmp, marker)
    try:
        schedule = schedule_of(plan)
    except ValueError as e:
        raise PipeccError(f"the plan's schedule cannot be built: {getattr(e, 'summary', e)}; plan again") from None
    (tmp / SCHEDULE_FILE).write_text(schedule_text(schedule) + "\n", encoding="utf-8")
    # a technique that writes the stage folders itself (Bi-Partition: cores and segments per worker)
    written = any(write_stages(tmp, graph, plan, stages, lambda d: _device_desc(plan, d))
                  for write_stages in hooks("codegen", "write_stages"))
    for stage, planned in zip(stages, plan.stages):
        if written:
            break
        write_stage(tmp / f"stage_{stage.index}", stage, model_name=graph.model_name, num_stages=n,
                    device_desc=_device_desc(plan, planned.device), recompute=planned.recompute)
    (tmp / "run_stage.py").write_text(RUN_STAGE, encoding="utf-8")
    for rel, content in extra_files.items():
        path = _inside(tmp, rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")


def _sha256(path: str) -> str | None:
    """Hex sha256 of the model file compiled, or None (no file: a module compiled in memory)."""
    return file_sha256(path) if path and Path(path).is_file() else None


def _device_desc(plan: Plan, index: int) -> str:
    if not 0 <= index < len(plan.devices):
        return f"device {index}"
    d = plan.devices[index]
    place = d.get("place") or d.get("placement")
    return f"{d.get('name', '?')} ({d.get('kind', '?')})" + (f" @ {place}" if place else "")


def _inside(root: Path, rel: str) -> Path:
    parts = PurePosixPath(rel).parts
    if not parts or PurePosixPath(rel).is_absolute() or ".." in parts:
        raise PipeccError(f"extra output file {rel!r} must be a relative path inside OUT")
    return root.joinpath(*parts)


# ----------------------------------------------------------------------------- replacing OUT
def check_output_folder(out: str | Path, force: bool = False) -> None:
    """Refuse, with a one-line PipeccError, an OUT that cannot be written or must not be
    replaced: a name too long, a parent that is a file or cannot be written, an OUT that is a
    file or a symbolic link, or a non-empty folder pipecc did not write (unless `force`).
    Cheap: the CLI calls it before the analysis, `write_output` again before writing."""
    out = Path(out)
    check_writable_target(out)
    _check_not_cwd(out)
    if out.is_symlink():
        raise PipeccError(f"{out} is a symbolic link; give the folder it points to as -o")
    if out.exists() and not out.is_dir():
        raise PipeccError(f"{out} exists and is not a folder; pipecc will not replace it")
    if out.is_dir() and not force and _read_marker(out) is None and any(out.iterdir()):
        raise PipeccError(f"{out} exists and was not written by pipecc; use --force to write into "
                          "it (files pipecc did not write are kept)")


def _check_not_cwd(out: Path) -> None:
    """OUT is replaced by renaming a new folder over it: the folder this process (and the user's
    shell) is in, or one above it, cannot be (`-o .`, `-o sub/..`: "Device or resource busy", or
    a shell left in a deleted folder). Refused before anything is written."""
    try:
        here = Path.cwd().resolve()
        target = Path(os.path.abspath(out))
        if target.exists() and not target.is_symlink():
            target = target.resolve()
    except OSError:
        return
    if target == here or target in here.parents:
        raise PipeccError(f"-o {out} is the folder you are in{'' if target == here else ' (or above it)'}; "
                          "pipecc replaces OUT as a whole, so run it from outside that folder "
                          "(e.g. cd .. and give -o NAME)")


def check_writable_target(path: str | Path) -> None:
    """A one-line PipeccError unless `path` (a file or folder to create) can be created: every
    name within the file system's limit, and its nearest existing folder writable (probed by
    creating and removing a temporary folder there, which also catches /proc and /sys)."""
    path = Path(path)
    for name in path.parts:
        size = len(os.fsencode(name))
        if size > NAME_MAX:
            raise PipeccError(f"the name {name[:24]!r}... is {size} bytes, over the {NAME_MAX} a "
                              "file system allows; choose a shorter one")
    base = path.parent
    while not base.exists() and base != base.parent:
        if base.is_symlink():  # a dangling link: mkdir would fail on it
            break
        base = base.parent
    if not base.is_dir():
        raise PipeccError(f"{path}: {base} is not a folder")
    try:
        probe = tempfile.mkdtemp(prefix=".pipecc-probe-", dir=base)
        os.rmdir(probe)
    except OSError as exc:
        raise PipeccError(f"{path}: cannot write in {base} ({exc.strerror or exc})") from None


def _why(exc: OSError) -> str:
    where = f"{exc.filename}: " if exc.filename else ""
    return f"{where}{exc.strerror or exc}"


def _read_marker(out: Path) -> dict | None:
    """OUT/pipecc.json when it is a pipecc compile marker, else None (not pipecc's folder)."""
    previous = CompiledFolder.peek(out)  # a regular file, size-capped (a FIFO there is not read)
    return previous.marker if previous is not None and previous.marker.get("format") == FORMAT else None


def _add_manifest(tmp: Path) -> None:
    """Record in the marker every file this compile wrote: a later compile replaces only those."""
    from pipecc.runtime import folder_sums
    sums = folder_sums.record(tmp)  # checked at every load (the runtime's folder_sums)
    files = sorted(rel for rel, kind in entries(tmp) if kind != "dir")
    # files_mac: the evidence a recompile checks (manifest.py)
    update_marker(tmp, {folder_sums.KEY: sums, "files": files, "files_mac": sign(tmp, files)})


@dataclass
class Merge:
    """What replacing OUT by a new compile does with OUT's files pipecc did not write."""

    keep: list[tuple[str, str]] = field(default_factory=list)   # carried into the new OUT
    in_the_way: list[str] = field(default_factory=list)         # where the new OUT has a file


def plan_merge(out: Path, new: Path) -> Merge:
    """Sort OUT's entries that pipecc did not write into kept and in-the-way (a path the new
    folder `new` uses for a file, or one inside such a path, or a file where it needs a folder)."""
    wrote = pipecc_wrote(_read_marker(out), out)
    new_files = {rel for rel, kind in entries(new) if kind != "dir"}
    new_dirs = {str(PurePosixPath(rel).parents[k]) for rel in new_files
                for k in range(len(PurePosixPath(rel).parents) - 1)}
    merge = Merge()
    for rel, kind in entries(out):
        if wrote(rel):
            continue
        above = {str(p) for p in PurePosixPath(rel).parents}
        if rel in new_files or (rel in new_dirs and kind != "dir") or above & new_files:
            merge.in_the_way.append(rel)
        else:
            merge.keep.append((rel, kind))
    return merge


def _carry(out: Path, tmp: Path, keep: Sequence[tuple[str, str]]) -> None:
    """Put the kept entries of OUT into the new folder: hard links (a copy where the file system
    has none), so OUT keeps them too until the swap, and a kill at any point loses nothing."""
    for rel, kind in keep:
        src, dst = out / rel, tmp / rel
        if kind == "dir":
            dst.mkdir(parents=True, exist_ok=True)
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        if kind == "link":
            os.symlink(os.readlink(src), dst)
            continue
        try:
            os.link(src, dst, follow_symlinks=False)
        except OSError:
            shutil.copy2(src, dst, follow_symlinks=False)


def _listing(names: Sequence[str], most: int = 5) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _replace(tmp: Path, out: Path, force: bool) -> None:
    """Move `tmp` to `out`. An existing `out` keeps the entries pipecc did not write (carried
    into `tmp`); one in the way is an error unless `force`, which replaces it and says so. The
    old `out` is moved aside first and deleted after."""
    check_output_folder(out, force)  # again: it may have appeared while we were writing
    if not out.exists():
        os.replace(tmp, out)
        return
    merge = plan_merge(out, tmp)
    if merge.in_the_way and not force:
        raise PipeccError(f"{out}: {len(merge.in_the_way)} file(s) pipecc did not write are where "
                          f"it writes: {_listing(merge.in_the_way)}; move them away, or use --force "
                          "to replace them")
    _carry(out, tmp, merge.keep)
    old = Path(tempfile.mkdtemp(prefix=temp_prefix(out, "old"), dir=out.parent))
    aside = old / "previous"
    os.replace(out, aside)
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(aside, out)  # if even this fails, `old` keeps it: the next write puts it back
        old.rmdir()
        raise
    shutil.rmtree(old, ignore_errors=True)  # the kept files live on in OUT (linked or copied)
    kept = [rel for rel, kind in merge.keep if kind != "dir"]
    if kept:
        progress.notice(f"kept {len(kept)} file(s) in {out} that pipecc did not write: {_listing(kept)}")
    if merge.in_the_way:
        progress.notice(f"replaced {len(merge.in_the_way)} file(s) in {out} that pipecc did not write "
                        f"(--force): {_listing(merge.in_the_way)}")


# ----------------------------------------------------------------------------- temporary folders
def clean_stale_temps(target: str | Path) -> None:
    """Remove the temporary files and folders a killed write of `target` left beside it: those
    of a process on this host that is gone, or older than STALE_AFTER_S (other hosts, and
    names from before the pid was recorded). A stale `old` folder whose `target` is missing
    (killed between the two renames of `_replace`) is put back as `target` first; files in it
    that pipecc did not write and the new `target` lacks are never deleted."""
    target = Path(target)
    prefix = f".{short_name(target.name)}{TEMP_TAG}"
    try:
        names = [n for n in os.listdir(target.parent) if n.startswith(prefix)]
    except OSError:
        return
    for name in sorted(names, key=lambda n: not n[len(prefix):].startswith("old-")):  # restore first
        path = target.parent / name
        kind, stale = temp_status(path, name[len(prefix):])
        if not stale:
            continue
        with contextlib.suppress(OSError):
            if kind == "old":
                _settle_old(path, target)
            elif path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()


def _settle_old(old: Path, target: Path) -> None:
    """A stale folder holding a replaced OUT (`old/previous`): back in place if OUT is missing;
    else deleted, except entries pipecc did not write that OUT does not hold (then kept)."""
    previous = old / "previous"
    if not previous.is_dir():
        shutil.rmtree(old)
        return
    if not target.exists() and not target.is_symlink():
        os.replace(previous, target)
        shutil.rmtree(old)
        return
    wrote = pipecc_wrote(_read_marker(previous), previous)
    orphans = [rel for rel, kind in entries(previous) if kind != "dir" and not wrote(rel)
               and not same_file(previous / rel, target / rel)]
    if orphans:
        progress.notice(f"left {old}: it holds {len(orphans)} file(s) pipecc did not write that "
                        f"{target} lacks: {_listing(orphans)}")
        return
    shutil.rmtree(old)


def pipelined_module(model: torch.nn.Module, stages: Sequence[Stage], *, microbatches: int = 1,
                     devices: Sequence[str | torch.device] | None = None,
                     recompute: Sequence[bool] = (), precision: str = "fp32") -> PipelinedModule:
    """The drop-in module over `stages` cut from `model`'s own graph (parameters shared);
    stage k runs as the techniques' hooks wrap it for its plan entry (`wrap_module`: under
    activation recomputation when `recompute[k]`, as its stage.py does), and under
    torch.autocast with a mixed `precision` (the plan's)."""
    ports = [ports_json(s, len(stages)) for s in stages]
    modules: list[torch.nn.Module] = []
    for k, s in enumerate(stages):
        written = written_inputs(s.gm)
        module = ClonesInputs(s.gm, written) if written else s.gm
        wrapped = first_answer("codegen", "wrap_module", module, written_as(k, recompute[k])) if k < len(recompute) else None
        modules.append(module if wrapped is None else wrapped)
    return PipelinedModule(modules, ports, owner=model, microbatches=microbatches, devices=devices,
                           precision=precision)
