"""Functions of the model file that a generated stage calls: imported from the hashed file.

A function the capture keeps as one node (one the user marks with `torch.fx.wrap` in the
model file, a leaf of the trace) is called by the stage file that holds it. pipecc imports a
model file by path under a name of its own (`pipecc.frontend.modelfile`), so no import
statement can reach the function; instead the stage file says

    helper_fn = model_function(__file__, "helper")

and `model_function` imports the model file the compiled folder records (`pipecc.json`'s
`model_path`, two folders up from the stage file; read through `CompiledFolder`, the folder's one
reader, `CompiledFolder.model_source`), only when its sha256 is the recorded one
(`pipecc.runtime.trust.model_file`, the check `pipecc run` makes before it imports the file
for its data). A compiled folder whose stages call model-file functions therefore loads only
beside its model file, unchanged; otherwise the stage fails to load with one line saying to
restore the file or compile again. Each model file is imported once per process.

Imports `pipecc.errors`, `pipecc.runtime.folder`, `pipecc.runtime.trust` and the model-file loader
(torch only).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipecc.errors import PipeccError
from pipecc.runtime.folder import MARKER, CompiledFolder
from pipecc.runtime.trust import HASH_KEY

__all__ = ["model_function"]

_IMPORTED: dict[tuple[str, str], Any] = {}  # (model file, its sha256) -> the imported module


def model_function(stage_file: str | Path, qualname: str) -> Any:
    """The object `qualname` ("helper", "Block.helper") of the compiled folder's model file."""
    stage = Path(stage_file).resolve()
    out = stage.parent.parent
    what = f"{stage.parent.name}/{stage.name} calls {qualname} of the model file"
    try:
        folder = CompiledFolder.read(out)  # the folder's one reader of pipecc.json (read as data)
    except PipeccError as e:  # what failed under it: OSError, JSONDecodeError, ...; PipeccError when not an object
        raise PipeccError(f"{what}, but {out / MARKER} cannot be read ({type(e.__context__ or e).__name__}); "
                          "compile the folder again") from None
    path, source = folder.model_source()  # raises on a changed file
    if path is None or not isinstance(source, bytes):
        raise PipeccError(f"{what}, but {source}; restore the model file beside the folder or compile again")
    key = (str(path.resolve()), str(folder.marker.get(HASH_KEY)))
    if key not in _IMPORTED:
        from pipecc.frontend.modelfile import import_model_file  # torch and pipecc.errors only
        _IMPORTED[key] = import_model_file(path, source)  # the bytes hashed, compiled from memory
    obj: Any = _IMPORTED[key]
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    if not callable(obj):
        raise PipeccError(f"{what}, but {path.name} defines no {qualname}; compile the folder again")
    return obj
