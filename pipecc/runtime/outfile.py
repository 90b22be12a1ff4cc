"""One rule for every output file pipecc writes (`plan -o`, `profile -o`, `run --trace`,
`inspect --report`, `export-checkpoint`): what may be written where, checked before the work
and again at the write.

- A regular file is replaced atomically (a temporary file beside it, renamed over it), never
  when it is an input of the same command (the model file, a --profile, a run document, a
  file inside the compiled folder or checkpoint folder it reads), and, without ``--force``,
  only when pipecc wrote it (it holds one of pipecc's signatures below) or it is empty.
- A character device (``/dev/null``, ``/dev/stdout`` on a terminal) is written into, never
  renamed over: renaming would turn the system's device node into a regular file.
- A FIFO (``-o >(gzip > f.gz)``) is written into when a reader holds it open; without one
  the write would block forever, so it is refused.
- Anything else (a folder, a block device, a socket) is refused in one line.

A symbolic link is followed: the file it points to is what the rules above judge, and what
is replaced (the link stays a link)."""
from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from pipecc.errors import PipeccError
from pipecc.runtime.atomic import temp_prefix, umask

# Bytes every file of one kind pipecc writes contains: a file holding one of them was written
# by pipecc (a plan's JSON, a profile, a Chrome trace of `run --trace`, the HTML report, an
# exported model state).
SIGNATURES = (b'"balance_ratio_compute":', b'"format": "pipecc.profile"', b'"format": "pipecc-trace"',
              b"<title>pipecc report", b"pipecc-model-state/")
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Target:
    """Where an output goes: ``path`` as given, ``real`` with links followed, ``kind`` one of
    "new" (nothing there yet), "file" (a regular file to replace), "device", "fifo"."""
    path: Path
    real: Path
    kind: str


def check(path: str | os.PathLike, flag: str, inputs: Iterable[str | os.PathLike | None] = (),
          force: bool = False) -> Target:
    """The Target for ``path``, or a one-line PipeccError naming why pipecc will not write it.
    ``flag`` names the option in messages (``-o``, ``--trace``); ``inputs`` are the files and
    folders the command reads (None entries are skipped)."""
    given = Path(path).expanduser()
    shown = f"{flag} {path}" if flag else str(path)
    try:
        st = os.stat(given)  # links followed
    except (FileNotFoundError, NotADirectoryError):
        st = None
    except OSError as exc:
        if exc.errno != errno.ENAMETOOLONG:
            raise PipeccError(f"{shown}: cannot look at it ({exc.strerror or exc}); give another file") from None
        st = None  # nothing can be there: the writer's own check names the long name
    if st is not None and (stat.S_ISCHR(st.st_mode) or stat.S_ISFIFO(st.st_mode)):
        # opened by the name given: /dev/stdout's link to a pipe has no path to resolve to
        return Target(given, given, "device" if stat.S_ISCHR(st.st_mode) else "fifo")
    real = Path(os.path.realpath(given))
    if st is None:
        if not real.parent.is_dir():
            if real.parent.exists():
                raise PipeccError(f"{shown}: {real.parent} is not a folder; give a file in a folder")
            return Target(given, real, "new")  # the writer creates the folders
        _check_inputs(real, None, shown, inputs)
        return Target(given, real, "new")
    mode = st.st_mode
    if stat.S_ISDIR(mode):
        raise PipeccError(f"{shown} is a folder; give a file name (e.g. {given / 'out.json'})")
    if not stat.S_ISREG(mode):
        what = "a block device" if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a file"
        raise PipeccError(f"{shown} is {what}; pipecc writes only regular files, character devices and "
                          "pipes: give a file name")
    _check_inputs(real, st, shown, inputs)
    if not force and st.st_size and not written_by_pipecc(real):
        raise PipeccError(f"{shown} exists and was not written by pipecc; give --force to replace it, "
                          "or another file name")
    return Target(given, real, "file")


def _check_inputs(real: Path, st: os.stat_result | None, shown: str,
                  inputs: Iterable[str | os.PathLike | None]) -> None:
    """Refuse an output that is one of the command's inputs, or inside an input folder."""
    for item in inputs:
        if item is None:
            continue
        src = Path(os.path.realpath(Path(item).expanduser()))
        try:
            src_st = os.stat(src)
        except OSError:
            continue
        if stat.S_ISDIR(src_st.st_mode):
            inside = src == real or src in real.parents
            if inside and st is not None:
                raise PipeccError(f"{shown} would replace {real.name} inside {item}, which this command reads; "
                                  "give a file outside it")
            continue
        same = st is not None and (st.st_dev, st.st_ino) == (src_st.st_dev, src_st.st_ino)
        if same or src == real:
            raise PipeccError(f"{shown} is {item}, which this command reads; give another file name")


def written_by_pipecc(path: str | os.PathLike) -> bool:
    """True when the regular file ``path`` holds one of pipecc's output signatures."""
    keep = max(len(s) for s in SIGNATURES)
    tail = b""
    try:
        with open(path, "rb") as fh:
            while True:
                chunk = fh.read(_CHUNK)
                if not chunk:
                    return False
                window = tail + chunk
                if any(s in window for s in SIGNATURES):
                    return True
                tail = window[-keep:]
    except OSError:
        return False


def write(path: str | os.PathLike, data: str | bytes, flag: str, inputs: Iterable[str | os.PathLike | None] = (),
          force: bool = False, prefix: str | None = None) -> Target:
    """Write ``data`` to ``path`` by the rules above (checked again now); an OSError becomes a
    one-line PipeccError and leaves no temporary behind. Returns the Target written."""
    blob = data.encode("utf-8") if isinstance(data, str) else data
    return write_with(path, lambda fh: fh.write(blob), flag, inputs, force, prefix)


def write_with(path: str | os.PathLike, produce: Callable, flag: str,
               inputs: Iterable[str | os.PathLike | None] = (), force: bool = False,
               prefix: str | None = None) -> Target:
    """Like ``write``, with ``produce(binary_file)`` writing the bytes (or ``produce(str_path)``
    when it is marked ``produce.wants_path = True``: a library that saves to a path)."""
    inputs = list(inputs)
    target = check(path, flag, inputs, force)
    shown = f"{flag} {path}" if flag else str(path)
    try:
        if target.kind in ("device", "fifo"):
            _write_into(target, produce, shown)
        else:
            _replace(target, produce, prefix)
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename and str(exc.filename) != str(path) else ""
        raise PipeccError(f"cannot write {shown} ({where}{exc.strerror or exc}); nothing was written") from None
    return target


def _replace(target: Target, produce: Callable, prefix: str | None) -> None:
    real = target.real
    created: list[Path] = []
    folder = real.parent
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    tmp: str | None = None
    try:
        for f in reversed(missing):
            f.mkdir()
            created.append(f)
        fd, tmp = tempfile.mkstemp(prefix=prefix or temp_prefix(real, "file"), dir=real.parent)
        if getattr(produce, "wants_path", False):
            os.close(fd)
            produce(tmp)
        else:
            with os.fdopen(fd, "wb") as fh:
                produce(fh)
        with contextlib.suppress(OSError):  # keep a replaced file's permissions
            if target.kind == "file":
                os.chmod(tmp, stat.S_IMODE(os.stat(real).st_mode))
            else:
                os.chmod(tmp, 0o666 & ~umask())
        # the check again, just before the rename: nothing in between may have put a device here
        if os.path.lexists(real) and not stat.S_ISREG(os.stat(real).st_mode):
            raise PipeccError(f"{target.path} changed into a non-file while pipecc worked; nothing was written")
        os.replace(tmp, real)
        tmp = None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            for f in reversed(created):
                with contextlib.suppress(OSError):
                    f.rmdir()


def _write_into(target: Target, produce: Callable, shown: str) -> None:
    """Write into a character device or a FIFO in place (never renamed over)."""
    flags = os.O_WRONLY | getattr(os, "O_CLOEXEC", 0)
    if target.kind == "fifo":
        try:
            fd = os.open(target.real, flags | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno == errno.ENXIO:
                raise PipeccError(f"{shown} is a pipe that nobody reads; start its reader first, or give a "
                                  "file name") from None
            raise
        os.set_blocking(fd, True)
    else:
        fd = os.open(target.real, flags)
    if getattr(produce, "wants_path", False):
        with tempfile.TemporaryDirectory(prefix="pipecc-out-") as tmpdir, os.fdopen(fd, "wb") as out:
            staged = os.path.join(tmpdir, "out")
            produce(staged)
            with open(staged, "rb") as src:
                while chunk := src.read(_CHUNK):
                    out.write(chunk)
        return
    with os.fdopen(fd, "wb") as out:
        produce(out)


def compiled_inputs(out: str | os.PathLike) -> list[str]:
    """What a command reading the compiled folder ``out`` reads: the folder and the model file
    its ``pipecc.json`` names (``CompiledFolder.peek``: a regular file, size-capped; a damaged
    marker adds none)."""
    from pipecc.runtime.folder import CompiledFolder
    folder = CompiledFolder.peek(out)
    model = folder.model_path if folder is not None else None
    return [str(out), model] if model else [str(out)]
