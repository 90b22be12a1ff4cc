"""Writing files whole or not at all, the one way pipecc does it.

``write_atomic(path, data)`` writes ``data`` (bytes, text as UTF-8, or a function that writes the
temporary file given its path) into a temporary file beside ``path`` and renames it over
``path``: a reader sees the old file or the new one, never half of one, and a failure (a full
disk, an exception in the writer) leaves nothing behind.

Every temporary file or folder pipecc makes beside a target has one name scheme,
``.<name>.pipecc-<kind>-<host>-<pid>-<random>`` (``temp_prefix``; kind ``file`` for a file,
``new``/``old`` for a compiled folder being replaced): the host and pid say whose it is, so a
later write of the same target can tell one a killed process left behind from one a running
process is writing (``temp_status``; ``pipecc.backends.torch.compile.clean_stale_temps``).

The generic file-system helpers of the compiled folder's writer live here too (``make_parents``,
``umask_modes``, ``entries``, ``same_file``). Imports the standard library only.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["HOST", "NAME_MAX", "STALE_AFTER_S", "TEMP_NAME", "TEMP_TAG", "alive", "entries", "make_parents",
           "same_file", "short_name", "temp_prefix", "temp_status", "umask", "umask_modes", "write_atomic"]

NAME_MAX = 255                 # bytes in one file name (ext4, xfs, btrfs, tmpfs, APFS)
TEMP_TAG = ".pipecc-"          # temporary files and folders beside a target: .<target>.pipecc-...
TEMP_NAME = re.compile(r"(new|old|file)-([0-9a-f]{8})-(\d+)-")
HOST = hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]
STALE_AFTER_S = 3600.0         # a temporary of another host (or an older pipecc) is stale after


def temp_prefix(target: Path, kind: str) -> str:
    """`.<name>.pipecc-<kind>-<host>-<pid>-` for a temporary file or folder beside `target`: the
    host and pid say whose it is, so a later write can tell a killed one from a running one."""
    return f".{short_name(Path(target).name)}{TEMP_TAG}{kind}-{HOST}-{os.getpid()}-"


def short_name(name: str) -> str:
    """`name`, shortened (with a hash) when the temporary name would exceed NAME_MAX."""
    if len(os.fsencode(name)) <= NAME_MAX - 80:
        return name
    digest = hashlib.sha1(os.fsencode(name)).hexdigest()[:10]
    return os.fsencode(name)[:100].decode("utf-8", errors="ignore") + "~" + digest


def write_atomic(path: str | os.PathLike, data: bytes | str | Callable[[str], None], *,
                 mode: int | None = None) -> Path:
    """Write `data` to `path` whole or not at all (module docstring): bytes, text (UTF-8), or a
    function called with the temporary file's path that writes it. The file gets `mode`
    (default: what the umask gives a new file, as `open` would); returns `path`."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path, "file"), dir=path.parent)
    try:
        if callable(data):
            os.close(fd)
            data(tmp)
        else:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.chmod(tmp, 0o666 & ~umask() if mode is None else mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def temp_status(path: Path, rest: str) -> tuple[str, bool]:
    """(kind, whether `path` is stale) from the part of its name after `.pipecc-`: a temporary of
    a process on this host that is gone, or one older than STALE_AFTER_S (another host's, or a
    name from before the pid was recorded)."""
    m = TEMP_NAME.match(rest)
    kind = m.group(1) if m else ("old" if rest.startswith("old-") else "new")
    if m and m.group(2) == HOST:
        return kind, not alive(int(m.group(3)))
    try:
        age = time.time() - path.lstat().st_mtime
    except OSError:
        return kind, False
    return kind, age > STALE_AFTER_S


def alive(pid: int) -> bool:
    """Whether process `pid` (of this host) runs (someone else's counts as running)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: someone else's, alive
        return True
    return True


# ----------------------------------------------------------------------------- folders


def make_parents(folder: Path, created: list[Path]) -> None:
    """mkdir -p `folder`, appending each folder it creates to `created` (outermost first) as
    it goes, so a failure half-way still knows what to remove."""
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    for f in reversed(missing):
        f.mkdir()
        created.append(f)


def umask() -> int:
    """The process's umask (read by setting it and back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def umask_modes(tmp: Path) -> None:
    """The modes the user's umask gives new files and folders, on everything under `tmp`:
    mkdtemp makes a folder 0700 and safetensors writes through a 0600 temporary file."""
    mask = umask()
    for folder, dirs, files in os.walk(tmp):
        os.chmod(folder, 0o777 & ~mask)
        for name in files:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                os.chmod(path, 0o666 & ~mask)


def entries(root: Path) -> list[tuple[str, str]]:
    """(relative POSIX path, "file" | "link" | "dir") under `root`; links are not followed and
    only folders without entries are listed (the others are implied by their files). A folder
    that cannot be listed is an error: what cannot be seen cannot be kept."""
    def unreadable(exc: OSError) -> None:
        raise exc

    out: list[tuple[str, str]] = []
    for folder, dirs, files in os.walk(root, onerror=unreadable):
        rel = Path(folder).relative_to(root)
        for name in list(dirs):
            if (Path(folder) / name).is_symlink():
                dirs.remove(name)
                files.append(name)
        for name in files:
            out.append(((rel / name).as_posix(), "link" if (Path(folder) / name).is_symlink() else "file"))
        if not dirs and not files and rel != Path("."):
            out.append((rel.as_posix(), "dir"))
    return out


def same_file(a: Path, b: Path) -> bool:
    """Whether `a` and `b` are one file (a hard link of it), without following links."""
    try:
        return os.path.samestat(a.lstat(), b.lstat())
    except OSError:
        return False
