"""A compiled folder's stages checked before a run without running any of the folder's code, or
importing torch (`pipecc run`'s launcher checks with it before torchrun starts; every rank again):
``check_folder`` (each ``ports.json`` parses, fits its neighbour's, each ``stage.py`` is there,
each ``weights.safetensors`` readable: ``check_weights_file``). `pipecc.runtime.stagefile`,
which loads the stages, re-exports these names.

Imports ``pipecc.errors``, safetensors and torch-free runtime modules only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from pipecc.errors import PipeccError
from pipecc.runtime.dtypes import dtype_name
from pipecc.runtime.ports import StagePorts, boundary_digest

__all__ = ["RECOMPILE", "check_folder", "check_weights_file", "gist"]

RECOMPILE = "compile the folder again"  # the fix for a damaged folder


def gist(error: BaseException) -> str:
    """``TypeName: first line of the message``."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def check_weights_file(path: str | Path) -> None:
    """Raise a one-line ``PipeccError`` unless ``path`` is a readable safetensors file (its
    header is parsed and must cover the file: truncation is caught, flipped data bytes are not). Opened
    for numpy, whose header checks are torch's: the launcher checks it without importing torch."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            f.keys()
    except FileNotFoundError:
        raise PipeccError(f"{path} is missing; {RECOMPILE}") from None
    except Exception as e:  # safetensors' SafetensorError: corrupt or truncated
        raise PipeccError(f"{path} is not a readable safetensors file ({gist(e)}): it is corrupt or "
                          f"truncated; {RECOMPILE}") from None


def check_folder(out: str | Path, num_stages: int, files: bool = True) -> list[dict[str, Any]]:
    """Every stage's ``ports.json`` (parsed, ready for ``StagePorts``), after checking what can be
    checked without running any of the folder's code: each ``ports.json`` parses, every stage
    receives what the stage before it sends and (``files``) each ``stage.py`` is there and each
    ``weights.safetensors`` is readable. One-line ``PipeccError``s naming the file and the fix."""
    out = Path(out)
    specs, parsed = [], []
    for i in range(num_stages):
        folder = out / f"stage_{i}"
        path = folder / "ports.json"
        try:
            spec = json.loads(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise PipeccError(f"cannot read {path} ({e.strerror or e}); {RECOMPILE}") from None
        except ValueError as e:
            raise PipeccError(f"{path} is not valid JSON ({e}); {RECOMPILE}") from None
        except RecursionError:
            raise PipeccError(f"{path} nests too deeply to read; {RECOMPILE}") from None
        try:
            if not isinstance(spec, dict):
                raise TypeError(f"a JSON {type(spec).__name__}, not an object")
            if spec.get("stage", i) != i:  # two stages' ports.json swapped, or one copied over another
                raise PipeccError(f"it says stage {spec['stage']!r} but is stage_{i}'s")
            parsed.append(StagePorts.from_json(spec, dtype_name))  # dtypes by name: no torch
        except PipeccError as e:
            raise PipeccError(f"{path}: {e}; {RECOMPILE}") from None
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
            raise PipeccError(f"{path} is not a valid port spec ({gist(e)}); {RECOMPILE}") from None
        if files and not (folder / "stage.py").is_file():
            raise PipeccError(f"{folder / 'stage.py'} is missing; {RECOMPILE}")
        if files:
            check_weights_file(folder / "weights.safetensors")
        specs.append(spec)
    for k in range(1, num_stages):
        sent, received = parsed[k - 1].out_leaves, parsed[k].in_leaves
        if boundary_digest(sent) != boundary_digest(received):
            raise PipeccError(f"{out / f'stage_{k}' / 'ports.json'} does not fit {out / f'stage_{k - 1}' / 'ports.json'}"
                              f" (stage {k} receives {_ports_text(received)}, stage {k - 1} sends "
                              f"{_ports_text(sent)}): one was changed after compile; {RECOMPILE}")
    return specs


def _ports_text(leaves: Sequence[Any]) -> str:
    from pipecc.runtime.ports import describe

    text = ", ".join(f"{p.name}:{describe(p)}" for p in leaves[:4])
    return f"({text}{', ...' if len(leaves) > 4 else ''})"
