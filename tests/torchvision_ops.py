"""Make `import torchvision` work where its C extension cannot load.

The only torchvision wheel the registry has for torch 2.13 (0.28.0) is a CUDA build: its `_C.so`
links libtorch_cuda, which the CPU torch does not ship, so the library fails to load and
torchvision's import then dies registering fake kernels for `torchvision::nms`/`qnms` ("operator
torchvision::nms does not exist"); transformers and timm, which import torchvision when it is
installed, fail with it. The classification models the real-model suite builds never call a
torchvision C op, so defining the two schemas the import needs is enough: torchvision's own
`_has_ops()` stays False, and a detection op (nms, roi_align, ...) still raises torchvision's
"Couldn't load custom C++ ops" error instead of running. Where `_C` does load (a CPU wheel on
another machine), it is loaded here first and nothing is defined.

Import this module before torchvision (tests/conftest.py does, and every model file the suite
writes does, since `pipecc compile`/`run` import the model file in processes of their own).
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

import torch

# The schemas torchvision's C++ library declares for the ops its import registers fakes for.
SCHEMAS = ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
           "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_LIBRARY: torch.library.Library | None = None  # kept alive: dropping it removes the schemas


def _extension_loads(folder: Path) -> bool:
    """Whether torchvision's `_C` extension loads into this torch (and load it if so)."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = folder / f"_C{suffix}"
        if path.exists():
            try:
                torch.ops.load_library(str(path))
                return True
            except (OSError, RuntimeError):
                return False
    return False


def ensure_importable() -> str:
    """Prepare torchvision's import; says what was done: "absent", "native" or "schemas"."""
    global _LIBRARY
    if "torchvision" in sys.modules or _LIBRARY is not None:
        return "native" if _LIBRARY is None else "schemas"
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return "absent"
    if _extension_loads(Path(next(iter(spec.submodule_search_locations)))):
        return "native"
    _LIBRARY = torch.library.Library("torchvision", "DEF")
    for schema in SCHEMAS:
        _LIBRARY.define(schema)
    return "schemas"


MODE = ensure_importable()
