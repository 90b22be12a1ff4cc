"""Functions of the model file that a generated stage calls: imported from the hashed file.

A function the capture keeps as one node (one the user marks with `torch.fx.wrap` in the
model file, a leaf of the trace) is called by the stage file that holds it. pipecc imports a
model file by path under a name of its own (`pipecc.frontend.modelfile`), so no import
statement can reach the function; instead the stage file says

    helper_fn = model_function(__file__, "helper")

and `model_function` imports the model file the compiled folder records (`pipecc.json`'s
`model_path`, two folders up from the stage file), only when its sha256 is the recorded one
(`pipecc.runtime.trust.model_file`, the check `pipecc run` makes before it imports the file
for its data). A compiled folder whose stages call model-file functions therefore loads only
beside its model file, unchanged; otherwise the stage fails to load with one line saying to
restore the file or compile again. Each model file is imported once per process.

Imports `pipecc.errors`, `pipecc.runtime.trust` and the model-file loader (torch only).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipecc.errors import PipeccError
from pipecc.runtime.trust import HASH_KEY, model_source

__all__ = ["model_function"]

_IMPORTED: dict[tuple[str, str], Any] = {}  # (model file, its sha256) -> the imported module


def model_function(stage_file: str | Path, qualname: str) -> Any:
    """The object `qualname` ("helper", "Block.helper") of the compiled folder's model file."""
    stage = Path(stage_file).resolve()
    out = stage.parent.parent
    what = f"{stage.parent.name}/{stage.name} calls {qualname} of the model file"
    try:
        meta = json.loads((out / "pipecc.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise PipeccError(f"{what}, but {out / 'pipecc.json'} cannot be read ({type(e).__name__}); "
                          "compile the folder again") from None
    path, source = model_source(meta if isinstance(meta, dict) else None, out)  # raises on a changed file
    if path is None or not isinstance(source, bytes):
        raise PipeccError(f"{what}, but {source}; restore the model file beside the folder or compile again")
    key = (str(path.resolve()), str(meta.get(HASH_KEY)))
    if key not in _IMPORTED:
        from pipecc.frontend.modelfile import import_model_file  # torch and pipecc.errors only
        _IMPORTED[key] = import_model_file(path, source)  # the bytes hashed, compiled from memory
    obj: Any = _IMPORTED[key]
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    if not callable(obj):
        raise PipeccError(f"{what}, but {path.name} defines no {qualname}; compile the folder again")
    return obj
