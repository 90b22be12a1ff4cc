"""Which files of a compiled folder pipecc wrote: the evidence a recompile needs before it
deletes or replaces anything there.

A folder's `pipecc.json` lists the files the compile wrote (`"files"`), but anyone can write a
`pipecc.json`: a hand-made one naming `thesis.txt` must not make `pipecc compile -o` delete the
user's thesis. So the list is evidence only with a keyed hash per file (`"files_mac"`): HMAC-
SHA256, under a key of this user's (`key()`: 32 random bytes in `~/.cache/pipecc/manifest.key`,
mode 0600, made on first use), of the file's path and the sha256 of its bytes. A file counts as
pipecc's only when its MAC checks: listed by a marker pipecc did not write, changed since (an
edited stage.py), or compiled by another user, it is the user's, and is kept (or, in the way
of a new file, refused without --force). Folders from before the MAC (a list without it, or
no list) count only the files matching pipecc's own layout (`LAYOUT`).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from pathlib import Path
from typing import Any, Callable

KEY_FILE = "manifest.key"
KEY_BYTES = 32
# What pipecc writes, for folders compiled before the marker listed its files; and the caches
# made from them later (Python's bytecode, an FPGA stage's C-simulation build).
LAYOUT = re.compile(r"(pipecc\.json|plan\.json|schedule\.txt|run_stage\.py|report\.html|graph\.json|timeline\.json"
                    r"|stage_\d+/(stage\.py|weights\.safetensors|ports\.json|estimates\.json|segment_\d+\.(py|safetensors)|hls/.+))")
CACHE = re.compile(r"(^|/)__pycache__/|^stage_\d+/hls/csim_build/")
MARKER = "pipecc.json"


def key_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pipecc" / KEY_FILE


def key() -> bytes | None:
    """This user's manifest key, made on first use (O_EXCL: two compiles at once agree on one);
    None when the cache folder cannot be written (then no folder's files are provably pipecc's,
    and every recompile keeps them all)."""
    path = key_path()
    for _ in range(2):
        try:
            data = path.read_bytes()
            if len(data) == KEY_BYTES:
                return data
            if data:
                return None  # a damaged key: prove nothing rather than guess
        except FileNotFoundError:
            pass
        except OSError:
            return None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            continue  # another compile made it just now (it may still be writing: read again)
        except OSError:
            return None
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(KEY_BYTES))
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return data if len(data) == KEY_BYTES else None


def file_mac(secret: bytes, root: Path, rel: str) -> str | None:
    """HMAC-SHA256 of `rel` and the sha256 of the bytes of root/rel (None: not a plain file)."""
    path = root / rel
    if path.is_symlink() or not path.is_file():
        return None
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return hmac.new(secret, f"{rel}\0{digest.hexdigest()}".encode(), hashlib.sha256).hexdigest()


def sign(root: Path, files: list[str]) -> dict[str, str]:
    """`"files_mac"` for the files a compile wrote (empty without a key)."""
    secret = key()
    if secret is None:
        return {}
    macs = {rel: file_mac(secret, root, rel) for rel in files if rel != MARKER}
    return {rel: mac for rel, mac in macs.items() if mac is not None}


def pipecc_wrote(marker: dict[str, Any] | None, root: Path | None = None) -> Callable[[str], bool]:
    """Whether a file of the folder `root` (a relative POSIX path) is pipecc's (module docstring):
    the marker itself when it is pipecc's; a listed file whose MAC checks; in an older folder, one
    matching pipecc's layout; in all, a cache made from them. Nothing in a folder without a marker."""
    if marker is None:
        return lambda rel: False
    files = marker.get("files")
    listed = set(files) if isinstance(files, list) and all(isinstance(f, str) for f in files) else None
    macs = marker.get("files_mac")
    secret = key() if isinstance(macs, dict) and root is not None else None

    def wrote(rel: str) -> bool:
        if CACHE.search(rel) or rel == MARKER:
            return True
        if listed is None:
            return bool(LAYOUT.fullmatch(rel))
        if rel not in listed:
            return False
        if not isinstance(macs, dict):  # a list from before the MACs: pipecc's layout only
            return bool(LAYOUT.fullmatch(rel))
        if secret is None or root is None or not isinstance(macs.get(rel), str):
            return False
        mac = file_mac(secret, root, rel)
        return mac is not None and hmac.compare_digest(mac, macs[rel])
    return wrote
