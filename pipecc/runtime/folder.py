"""The compiled folder (``pipecc compile -o OUT``), read once and asked by everyone.

``CompiledFolder.open(OUT)`` reads ``OUT/pipecc.json`` (the marker: a regular file, size-capped,
one-line errors naming the fix) and checks its fields (``check_marker``: the recorded hashes,
the format version, counts that are positive whole numbers, the devices, the fields plan.json
repeats). This module is the one parser of a compiled folder's ``pipecc.json``, ``plan.json``
and ``schedule.txt`` (through ``folder_data`` and ``schedule_file``, its helpers); nobody else
opens them. What the launcher (``pipecc run``), every rank (``pipecc.runtime.rank``),
``pipecc.load`` and ``pipecc.distributed.load`` ask of a folder is answered here, each fact in
one place with its one default:

    num_stages, stage_dirs          the stages (pipecc.json's count; the stage_<i>/ folders)
    microbatches, batch(specs)      micro-batches (default 4) and the batch's rows
    schedule, precision             the compiled schedule (default 1f1b) and precision (fp32)
    devices, compiled_device        plan devices; "cpu" when every stage runs on a CPU (or FPGA)
    replicas                        how many replicas run every stage (1 when absent)
    microbatch_sizes, sizes_for     UMPIPE's per-stage sizes (None: equal splits)
    activation_balancing            BPipe's pairs (None when off)
    fpga_stages, never_trains, why  inference-only folders, and why they are
    forward_only(schedule, ...)     whether a run does forward passes only (refusing training asks)
    lengths, plan, schedule_file    the declared length range, plan.json, schedule.txt (lazily)
    checked_plan, virtual_stages    plan.json read strictly (`pipecc run`), its virtual stages
    plan_sha256, given_devices      plan.json's hash (a run names its plan); the compile's devices
    model_path, model_source()      the model file, and its bytes when they hash to the recorded sha256

``CompiledFolder.peek(OUT)`` reads the marker only to look (None when there is none it can
read: what a command reads, a compile's previous OUT, a run's document). ``read_checked(path)``
gives a stage file's bytes checked against the folder's recorded sha256. ``write_marker`` and
``update_marker`` are the one form the compile writes the marker in (into its temporary folder,
which replaces OUT whole: ``pipecc.backends.torch.compile``; the FPGA backend adds its fields).

Compile writes the micro-batch count three times: pipecc.json's ``microbatches``, plan.json's and
schedule.txt's (its actions' micro-batches). pipecc.json's is the fact every reader asks for here
(``microbatches``); the copies are checked against it, each one line naming the file when a hand
edit made them disagree: plan.json's (with ``replicas`` and ``batch_size``, the other counts it
repeats) when the folder is opened (``check_copies``), schedule.txt's whenever it is read
(``schedule_file``, ``saved_schedule``). The files stay as compile wrote them.

``CompiledFolder.show(OUT)`` reads a folder for showing it (``pipecc inspect``, the report page),
not running it: the marker unchecked, then every file the views draw, read and checked now, so
a damaged one is one line before anything prints: ``typed_plan`` (plan.json as a ``Plan``),
``stage_ports``, ``graph``, ``timeline``, ``saved_schedule`` and ``estimates``.

``CompiledFolder(path, marker)`` builds one from a marker already read (no checks; tests and
stubs). Imports ``pipecc.errors`` and the runtime only (``pipecc.ir.plan`` for ``typed_plan``);
torch only when a checker needs it.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from pipecc.errors import PipeccError, UsageError
from pipecc.runtime import folder_sums
from pipecc.runtime.folder_sums import MARKER_MAX_BYTES, RECOMPILE, read_regular

__all__ = ["DEFAULT_MICROBATCHES", "DEFAULT_PRECISION", "DEFAULT_SCHEDULE", "MARKER", "MARKER_VERSION",
           "CompiledFolder", "check_marker", "find_stage_dirs", "plan_json", "plan_sha256", "read_checked",
           "read_json", "stage_devices", "update_marker", "write_marker"]

MARKER = "pipecc.json"
PLAN = "plan.json"
MARKER_VERSION = 1  # the layout this runtime reads; the compile writes it (backends.torch.compile.FORMAT_VERSION)
DEFAULT_MICROBATCHES = 4  # neither pipecc.json nor plan.json says (compile always writes both)
DEFAULT_SCHEDULE = "1f1b"
DEFAULT_PRECISION = "fp32"


def read_json(path: Path, what: str) -> dict[str, Any]:
    """``path`` (pipecc.json or plan.json) parsed as a JSON object, refused in one line: not a
    regular file, missing, not JSON, nested too deeply, not an object."""
    if path.exists() and not path.is_file():  # a FIFO or a device: reading it could hang
        raise PipeccError(f"{path} is not a regular file; compile again")
    try:
        data = json.loads(read_regular(path, MARKER_MAX_BYTES).decode("utf-8"))
    except (OSError, PipeccError):
        raise PipeccError(f"{path.parent} is not a compiled folder (no {path.name}); run "
                          f"`pipecc compile MODEL -d DEVICES -o {path.parent}` first") from None
    except ValueError as exc:
        raise PipeccError(f"{path} is not valid JSON ({exc}); compile again") from None
    except RecursionError:
        raise PipeccError(f"{path} nests too deeply to read; it is damaged: compile again") from None
    if not isinstance(data, dict):
        raise PipeccError(f"{path} is not {what}; compile again")
    return data


def plan_json(out: Path) -> dict[str, Any]:
    """``out/plan.json`` as plain JSON ({} when missing, not a regular file or unreadable: what
    reads it for predictions then has none; ``pipecc inspect`` refuses it: ``CompiledFolder.typed_plan``)."""
    path = Path(out) / PLAN
    if not path.is_file():  # a FIFO there would hang the read
        return {}
    try:
        plan = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}
    return plan if isinstance(plan, dict) else {}


def plan_sha256(out: Path) -> str | None:
    """The sha256 of ``out/plan.json``'s bytes (None when it cannot be read): what names the plan
    a run ran (``pipecc.runtime.timing.plan_identity``; ``inspect --run`` compares them)."""
    try:
        return hashlib.sha256((Path(out) / PLAN).read_bytes()).hexdigest()
    except OSError:
        return None


def read_checked(path: str | Path) -> bytes:
    """The bytes of a compiled folder's file (inside a ``stage_<i>/``), read once and checked
    against the sha256 its ``pipecc.json`` records (``folder_sums.check``); a file outside a
    stage folder, or of a folder recording none, is read unchecked."""
    path = Path(path)
    data = read_regular(path)
    where = folder_sums.locate(path)
    if where is not None:
        folder = CompiledFolder.peek(where[0])
        folder_sums.check(where[0], where[1], data, folder.sums if folder is not None else None)
    return data


def write_marker(out: Path, marker: dict[str, Any]) -> None:
    """Write ``marker`` as ``out/pipecc.json``, in the one form the compile writes it. ``out`` is a
    folder being compiled (its temporary folder, which replaces OUT whole, so each file in it is
    written plainly: ``pipecc.backends.torch.compile.write_output``)."""
    (Path(out) / MARKER).write_text(json.dumps(marker, indent=1, default=str), encoding="utf-8")


def update_marker(out: Path, fields: dict[str, Any]) -> None:
    """Add ``fields`` to the ``pipecc.json`` of ``out``, a folder being compiled (``write_marker``)."""
    marker = CompiledFolder.read(out).marker
    marker.update(fields)
    write_marker(out, marker)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_marker(out: str | Path, marker: dict[str, Any] | None) -> None:
    """The fields of ``OUT/pipecc.json`` a run is built from, checked before anything starts:
    an edited marker (``"num_stages": "2"``, a batch of 0, micro-batches that do not divide it,
    no devices, another format version) would otherwise fail later, in some rank, with a
    traceback. One line naming the field; nothing is run. (Counts that plan.json repeats, such as
    ``replicas`` the plan was not made with: ``CompiledFolder.check_copies``, after this.)"""
    if marker is None:
        return
    folder_sums.require(out, marker)  # the code and weights a run loads, recorded by hash
    path = Path(out) / MARKER

    def bad(what: str) -> PipeccError:
        return PipeccError(f"{path}: {what}; it was edited or is damaged: {RECOMPILE}")
    version = marker.get("version", MARKER_VERSION)
    if version != MARKER_VERSION:
        raise PipeccError(f"{path} is format version {version!r}, this pipecc reads version "
                          f"{MARKER_VERSION}; {RECOMPILE} with this pipecc")
    for key in ("num_stages", "batch_size", "microbatches", "replicas"):
        if key in marker and marker[key] is not None and not _count(marker[key]):
            raise bad(f"{key} is {marker[key]!r}, not a positive whole number")
    batch, m = marker.get("batch_size"), marker.get("microbatches")
    if batch and m and not marker.get("microbatch_sizes") and batch % m:
        raise bad(f"microbatches {m} does not divide batch_size {batch}")
    devices = marker.get("devices")
    if "devices" in marker and (not isinstance(devices, list) or not devices
                                or not all(isinstance(d, dict) for d in devices)):
        raise bad(f"devices is {devices!r}, not the list of the plan's devices")
    # the counts plan.json repeats are checked against these by CompiledFolder.check_copies


def find_stage_dirs(out: Path) -> list[Path]:
    """``out``'s ``stage_<i>/`` folders, in order (refused unless they are stage_0 .. stage_<n-1>)."""
    dirs = sorted((p for p in out.glob("stage_*") if p.is_dir() and p.name[6:].isdigit()),
                  key=lambda p: int(p.name[6:]))
    if not dirs:
        raise PipeccError(f"{out} holds no stage_<i>/ folders; run `pipecc compile` first")
    if [int(p.name[6:]) for p in dirs] != list(range(len(dirs))):
        raise PipeccError(f"{out}: stage folders {[p.name for p in dirs]} are not stage_0 .. stage_{len(dirs) - 1}")
    return dirs


def _technique_answer(hook: str, *args: Any) -> Any:
    """What the techniques' folder parts answer of the folder (``pipecc.techniques``' ``folder.*``
    hooks; torch-free, as `pipecc run`'s launcher needs: their runtime parts import torch)."""
    from pipecc.techniques import first_answer
    return first_answer("folder", hook, *args)


@dataclass(frozen=True)
class CompiledFolder:
    """A compiled folder and its ``pipecc.json`` (``marker``), checked by ``open``."""

    path: Path
    marker: dict[str, Any]

    @classmethod
    def open(cls, path: str | Path, missing: str | None = None) -> CompiledFolder:
        """``path``'s marker read and checked; a one-line ``PipeccError`` when it has none
        (``missing``, the caller's words, else `pipecc run`'s; ``find``: None instead)."""
        out = Path(path)
        if missing is not None and not (out / MARKER).exists():
            raise PipeccError(missing)
        marker = cls.read(out).marker
        check_marker(out, marker)  # an edited field is one line here, not a traceback in a rank
        folder = cls(out, marker)
        folder.check_copies()
        return folder

    @classmethod
    def show(cls, path: str | Path) -> CompiledFolder:
        """``path`` read for showing (``pipecc inspect``, the report page): the marker as data
        (inspect shows what a run would refuse), then every file the views draw, read and checked
        now, in this order; a missing folder, one `pipecc compile` did not write, a damaged file
        or copies of a count that disagree (``check_copies``) is one line."""
        out = Path(path)
        if not out.exists():
            raise PipeccError(f"{out}: no such folder (compile one with `pipecc compile MODEL -o {out}`)")
        if not out.is_dir() or not (out / MARKER).is_file():
            raise PipeccError(f"{out} is not a folder written by `pipecc compile` (no pipecc.json)")
        folder = cls.read(out)
        if folder.marker.get("format") != "pipecc-compile":
            raise PipeccError(f"{out}/pipecc.json is not a pipecc compile marker")
        from pipecc.runtime.folder_data import plan_problem
        problem = plan_problem(folder.typed_plan)
        if problem:
            raise PipeccError(f"{out}/plan.json is damaged: {problem}; recompile the folder")
        folder.check_copies()
        # each read (and cached) now, in this order: a damaged one is refused before anything is drawn
        folder.stage_ports, folder.graph, folder.timeline, folder.saved_schedule, folder.estimates  # noqa: B018
        return folder

    @classmethod
    def read(cls, path: str | Path) -> CompiledFolder:
        """``path``'s marker read, not checked: for readers that show a folder rather than run it."""
        out = Path(path)
        return cls(out, read_json(out / MARKER, "a pipecc marker"))

    @classmethod
    def peek(cls, path: str | Path) -> CompiledFolder | None:
        """``path``'s marker as data, not checked, or None when it has none this can read (absent,
        not a regular file, larger than pipecc writes, not a JSON object): for readers that only
        look (what a command reads, a compile's previous OUT, a run's document)."""
        out = Path(path)
        try:
            data = json.loads(read_regular(out / MARKER, MARKER_MAX_BYTES).decode("utf-8"))
        except (PipeccError, ValueError, RecursionError):
            return None
        return cls(out, data) if isinstance(data, dict) else None

    @classmethod
    def find(cls, path: str | Path) -> CompiledFolder | None:
        """``open``, or None when ``path`` holds no ``pipecc.json`` at all."""
        out = Path(path)
        if not (out / MARKER).exists():
            return None
        return cls.open(out)

    @property
    def marker_path(self) -> Path:
        return self.path / MARKER

    # ------------------------------------------------------------------ stages and batch

    @cached_property
    def num_stages(self) -> int:
        """pipecc.json's ``num_stages`` (required)."""
        try:
            num_stages = int(self.marker["num_stages"])
        except (KeyError, TypeError, ValueError):
            raise PipeccError(f"{self.marker_path} has no num_stages; compile again") from None
        if num_stages < 1:
            raise PipeccError(f"{self.marker_path} says {num_stages} stages; compile again")
        return num_stages

    @cached_property
    def stage_dirs(self) -> list[Path]:
        """The ``stage_<i>/`` folders, in order (refused unless they are stage_0 .. stage_<n-1>)."""
        return find_stage_dirs(self.path)

    @property
    def microbatches(self) -> int:
        """The micro-batches the folder was compiled for: pipecc.json's, the fact plan.json and
        schedule.txt repeat (``check_copies``); a marker without one (older): plan.json's, else
        ``DEFAULT_MICROBATCHES``."""
        m = self.marker.get("microbatches")
        if "microbatches" not in self.marker:
            m = self.plan.get("microbatches")
            m = m if isinstance(m, int) and not isinstance(m, bool) and m > 0 else None
        return int(m or DEFAULT_MICROBATCHES)

    def check_copies(self) -> None:
        """The counts plan.json repeats (``replicas``, ``batch_size``, ``microbatches``) agree with
        pipecc.json's, the facts: a hand-edited copy is one line, before anything runs or is
        drawn. A folder whose marker lacks a count (older) is not compared on it."""
        plan = self.plan
        for key in ("replicas", "batch_size", "microbatches"):
            if key in self.marker and key in plan and self.marker[key] != plan[key]:
                raise PipeccError(f"{self.marker_path}: {key} is {self.marker[key]!r}, but the folder was compiled "
                                  f"with {plan[key]!r} (plan.json); it was edited or is damaged: {RECOMPILE}")

    def run_microbatches(self, asked: int | None) -> int:
        """A run's micro-batches: ``asked`` (``--microbatches``) or the folder's."""
        return asked or self.microbatches

    @property
    def batch_size(self) -> int:
        """pipecc.json's ``batch_size`` (0 when absent)."""
        return int(self.marker.get("batch_size") or 0)

    def batch(self, specs: list[dict[str, Any]]) -> int:
        """The rows of one batch: pipecc.json's ``batch_size``, else stage 0's ports' (0: unknown;
        a run then draws its data at the model file's own ``example_inputs`` default)."""
        if self.batch_size:
            return self.batch_size
        from pipecc.runtime.dtypes import dtype_name
        from pipecc.runtime.ports import StagePorts
        return int(StagePorts.from_json(specs[0], dtype_name).batch_size or 0)  # dtypes by name: no torch

    @property
    def replicas(self) -> int:
        """How many replicas run every stage (``replicas``; 1 when absent: compiled before PP x DP)."""
        value = self.marker.get("replicas", 1)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PipeccError(f"{self.marker_path} says replicas {value!r}; compile again")
        return value

    # ------------------------------------------------------------------ how it runs

    @property
    def schedule(self) -> str:
        """The schedule the folder was compiled for (``DEFAULT_SCHEDULE`` when absent)."""
        return str(self.marker.get("schedule") or DEFAULT_SCHEDULE)

    @property
    def precision(self) -> str:
        """The precision the folder was compiled for (``compile --precision``; fp32 when absent)."""
        return str(self.marker.get("precision") or DEFAULT_PRECISION)

    @property
    def devices(self) -> list[dict[str, Any]]:
        """The plan's devices as pipecc.json records them ([] when absent)."""
        return [d for d in self.marker.get("devices") or [] if isinstance(d, dict)]

    @property
    def stage_devices(self) -> list[str | None]:
        """Where each stage runs under torchrun (``stage_devices`` of plan.json)."""
        return stage_devices(self.plan)

    @property
    def compiled_device(self) -> str | None:
        """"cpu" when the pipeline was compiled for CPUs (and FPGA cards, whose stages run as a C
        simulation on the host CPU) only: then it runs on the CPU, over gloo, even where CUDA is
        available; None otherwise: the runtime's default, cuda:LOCAL_RANK with NCCL."""
        devices = self.marker.get("devices") or []
        if devices and all(isinstance(d, dict) and d.get("kind") in ("cpu", "fpga") for d in devices):
            return "cpu"
        return None

    @property
    def has_sizes(self) -> bool:
        """True when the plan gives its stages unequal micro-batches (``microbatch_sizes``)."""
        return bool(self.marker.get("microbatch_sizes"))

    @property
    def microbatch_sizes(self) -> list[list[int]] | None:
        """UMPIPE's per-stage micro-batch sizes (None: equal splits)."""
        return self.sizes_for(None)

    def sizes_for(self, asked: int | None) -> list[list[int]] | None:
        """``microbatch_sizes``, refusing an ``asked`` ``--microbatches`` when the folder has them
        (the techniques' folder parts' ``folder_sizes``: UMPIPE's)."""
        return _technique_answer("folder_sizes", self.marker, asked)

    @property
    def activation_balancing(self) -> list[dict] | None:
        """BPipe's pairs (``activation_balancing``; None when off: the techniques' folder parts'
        ``folder_balancing``)."""
        return _technique_answer("folder_balancing", self.marker)

    @property
    def lengths(self) -> Any:
        """The declared length range (``pipecc.runtime.lengths.Lengths``; None when none)."""
        from pipecc.runtime.lengths import Lengths
        return Lengths.from_json(self.marker.get("lengths"))

    # ------------------------------------------------------------------ inference-only folders

    @cached_property
    def fpga_stages(self) -> list[int]:
        """The stages that run on an FPGA card: ``fpga_stages``, and those with a ``stage_<i>/hls/``."""
        listed = {int(k) for k in self.marker.get("fpga_stages") or {} if str(k).isdigit()}
        return sorted(listed | {int(p.parent.name[6:]) for p in self.path.glob("stage_*/hls")
                                if p.is_dir() and p.parent.name[6:].isdigit()})

    @property
    def never_trains(self) -> bool:
        """FPGA stages (``"inference_only": true``, or a ``stage_<i>/hls/``): the C simulation has
        no backward pass, so no schedule trains it."""
        return bool(self.fpga_stages or self.marker.get("inference_only"))

    @property
    def inference_compiled(self) -> bool:
        """Compiled with ``--inference`` (schedule "inference"): forward only unless a training
        schedule is asked for."""
        return self.never_trains or self.marker.get("schedule") == "inference"

    @property
    def why(self) -> str:
        """Why the folder runs forward passes only, for messages ("" when it trains)."""
        if self.fpga_stages:
            return f"FPGA stages: {self.fpga_stages}"
        if self.never_trains:
            return str(self.marker.get("inference_only_reason") or "compiled so")
        return "compiled with --inference" if self.inference_compiled else ""

    def forward_only(self, schedule: str | None, optimizer: Any = None, lr: Any = None) -> bool:
        """True when a run with ``--schedule schedule`` does forward passes only (an inference-only
        folder, or ``--schedule inference``); a ``UsageError`` when a folder that runs forward only
        is asked to train (a training schedule of one that never trains, ``--optimizer``, ``--lr``)."""
        if not self.inference_compiled and schedule != "inference":
            return False
        why = (self.why or "--schedule inference") + ("; FPGA stages have no backward pass" if self.fpga_stages else "")
        if schedule not in (None, "inference"):
            if self.never_trains:
                raise UsageError(f"{self.path} is an inference-only pipeline ({why}): `pipecc run` runs forward "
                                 f"passes only; --schedule {schedule} would train it")
            return False  # compiled with --inference for CPUs/GPUs: a training schedule trains it
        asked = [flag for flag, value in (("--optimizer", optimizer), ("--lr", lr)) if value is not None]
        if asked:
            hint = "; give --schedule gpipe or 1f1b to train it" if self.inference_compiled and not self.never_trains else ""
            raise UsageError(f"{self.path} is an inference-only pipeline ({why}): `pipecc run` runs forward passes "
                             f"only, so {' and '.join(asked)} {'do' if len(asked) > 1 else 'does'} not apply{hint}")
        return True

    # ------------------------------------------------------------------ the other files

    @cached_property
    def plan(self) -> dict[str, Any]:
        """``plan.json`` as plain JSON ({} when missing, not a regular file or unreadable): the
        one read ``checked_plan`` makes, or where that refuses the file, ``plan_json``'s."""
        try:
            return self.checked_plan
        except PipeccError:
            return plan_json(self.path)

    @cached_property
    def checked_plan(self) -> dict[str, Any]:
        """``plan.json`` as plain JSON read strictly, as ``pipecc run`` reads it: {} when there is
        none, a one-line PipeccError when it is there but not a JSON object (``read_json``)."""
        path = self.path / PLAN
        return read_json(path, "a plan") if path.exists() else {}

    @property
    def virtual_stages(self) -> int:
        """The stages each rank holds under an interleaved schedule: ``checked_plan``'s
        ``virtual_stages`` (1 when absent)."""
        return int(self.checked_plan.get("virtual_stages") or 1)

    @property
    def plan_sha256(self) -> str | None:
        """The sha256 of ``plan.json`` (None when it cannot be read; ``plan_sha256``)."""
        return plan_sha256(self.path)

    def given_devices(self, devices: list[Any]) -> list[Any]:
        """``devices`` given one per device of the compile's ``--devices`` for a plan that uses
        fewer (plan.json's ``options.devices_given``; ``passes.device_count``): each stage's own,
        by its device's ``given_index``. Any other count (or a plan.json without them) is
        ``devices`` as given, for the caller to refuse."""
        plan = self.plan
        try:
            if int(plan.get("options", {}).get("devices_given", 0)) != len(devices):
                return devices
            return [devices[int(plan["devices"][int(s["device"])]["given_index"])]
                    for s in plan["stages"]][:self.num_stages]
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            return devices

    def schedule_file(self, num_stages: int | None = None) -> Any:
        """``schedule.txt``, parsed and checked against the folder (``pipecc.runtime.schedule_file``:
        its stages, and its micro-batches against ``microbatches``' pipecc.json)."""
        from pipecc.runtime.schedule_file import read_schedule_file
        return read_schedule_file(self.path, self.num_stages if num_stages is None else num_stages, self.marker)

    @property
    def model_path(self) -> str | None:
        """The model file the folder was compiled from (``model_path``; None when it names none)."""
        path = self.marker.get("model_path")
        return path if isinstance(path, str) and path else None

    @property
    def sums(self) -> dict[str, Any] | None:
        """The recorded sha256 of the stage code and weights (``folder_sums``; None when none)."""
        sums = self.marker.get(folder_sums.KEY)
        return sums if isinstance(sums, dict) else None

    def model_source(self) -> tuple[Path | None, bytes | str]:
        """(the model file, its bytes) when they hash to pipecc.json's ``model_sha256``, else (None,
        why not); ``pipecc.runtime.trust.model_source`` (a changed file is refused there)."""
        from pipecc.runtime.trust import model_source
        return model_source(self.marker, self.path)

    # ------------------------------------------------------------------ what inspect shows (``show``)

    @cached_property
    def typed_plan(self) -> Any:
        """``plan.json`` as a ``pipecc.ir.plan.Plan`` (a PipeccError when missing or not a plan;
        ``show`` also checks its figures: ``folder_data.plan_problem``). Built from ``plan``'s one
        read of the file when that read it; else read here, for ``read_typed_plan``'s message."""
        from pipecc.runtime.folder_data import read_typed_plan
        data = None
        if (self.path / PLAN).is_file():
            try:
                data = copy.deepcopy(self.checked_plan)  # NOTE: a copy: Plan.from_json may keep its parts
            except PipeccError:
                data = None
        return read_typed_plan(self.path, data)

    @cached_property
    def stage_ports(self) -> list[dict[str, Any]]:
        """Each plan stage's ``ports.json`` as JSON ({} for a stage without one)."""
        from pipecc.runtime.folder_data import read_data
        files = [self.path / f"stage_{i}" / "ports.json" for i in range(len(self.typed_plan.stages))]
        return [read_data(f, "stage ports") if f.is_file() else {} for f in files]

    @cached_property
    def graph(self) -> dict[str, Any] | None:
        """``graph.json`` (None in a folder compiled before it)."""
        return self._data("graph.json", "graph")

    @cached_property
    def timeline(self) -> dict[str, Any] | None:
        """``timeline.json`` (None in a folder compiled before it)."""
        return self._data("timeline.json", "timeline")

    @cached_property
    def saved_schedule(self) -> Any:
        """``schedule.txt`` parsed and checked against the folder (``schedule_file``, over the plan's
        stages); None in a folder compiled before it."""
        from pipecc.runtime.schedule_file import SCHEDULE_FILE
        if not (self.path / SCHEDULE_FILE).is_file():
            return None
        return self.schedule_file(len(self.typed_plan.stages))

    @cached_property
    def estimates(self) -> dict[int, dict[str, Any]]:
        """The FPGA stages' ``estimates.json``, by stage."""
        from pipecc.runtime.folder_data import read_data
        files = {i: self.path / f"stage_{i}" / "estimates.json" for i in range(len(self.typed_plan.stages))}
        return {i: read_data(f, "FPGA estimates") for i, f in files.items() if f.is_file()}

    def _data(self, name: str, what: str) -> Any:
        from pipecc.runtime.folder_data import read_data
        return read_data(self.path / name, what) if (self.path / name).is_file() else None


def stage_devices(plan: dict[str, Any]) -> list[str | None]:
    """Where each stage of a compiled plan runs under torchrun: "cpu" for a CPU or FPGA device (an
    FPGA stage is a C simulation on the host) or one placed on the CPU (`h200@cpu`), the placement
    given (`h200@cuda:1`), else None (cuda:LOCAL_RANK). [] when plan.json says nothing."""
    devices, out = plan.get("devices") or [], []
    for stage in plan.get("stages") or []:
        try:
            d = devices[int(stage["device"])]
        except (KeyError, IndexError, TypeError, ValueError):
            return []
        place = d.get("placement") if isinstance(d, dict) else None
        out.append("cpu" if not isinstance(d, dict) or d.get("kind") in ("cpu", "fpga") or place == "cpu"
                   else place)
    return out
