"""The profile cache: re-planning a model must not re-time it.

A profile is stored as `<cache dir>/<key>.json`, where the key is the sha256 of everything
the measurements depend on (`cache_key`): the model file's bytes, the model arguments, the
batch size, the devices timed and their hardware names (CPU model, GPU names), the torch
and pipecc versions, the timing settings and whether the link was measured. The directory
is `$XDG_CACHE_HOME/pipecc/profiles/` (default `~/.cache/pipecc/profiles/`).

NOTE: the key hashes the model file, not what it imports; a model split over several files
needs `--no-cache` after editing the others.

An entry is written atomically (`pipecc.runtime.atomic.write_atomic`), so a reader never sees a
half-written profile; one that does not parse, or belongs to another key, is a miss.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping

from pipecc.runtime.atomic import write_atomic
from pipecc.runtime.trust import file_sha256  # the hash pipecc.json records too

__all__ = ["cache_dir", "cache_key", "file_sha256", "load", "store"]


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pipecc" / "profiles"


def cache_key(parts: Mapping[str, Any]) -> str:
    """sha256 of the parts as canonical JSON (sorted keys; non-JSON values by repr)."""
    text = json.dumps(parts, sort_keys=True, default=repr, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def load(key: str, directory: Path | None = None) -> dict[str, Any] | None:
    """The cached profile for `key`, or None (missing, unreadable or not this key's)."""
    path = (directory or cache_dir()) / f"{key}.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("cache_key") == key else None


def store(key: str, profile: Mapping[str, Any], directory: Path | None = None) -> Path | None:
    """Write the profile under `key`; returns its path, or None when the cache cannot be
    written (a read-only home must not fail the command: the profile is still output)."""
    directory = directory or cache_dir()
    path = directory / f"{key}.json"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(profile, indent=1), mode=0o600)
    except OSError:  # disk full, permissions: as unwritable
        return None
    return path
