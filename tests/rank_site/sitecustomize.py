"""Run tests/torchvision_ops.py at every interpreter start of the real-model suite's commands.

The suite's `pipecc compile`/`run` children get this folder on PYTHONPATH (tests/real_zoo.py), so
each Python process they start (the torchrun ranks too, which inherit the environment) defines
torchvision's C-op schemas before anything imports torchvision. The model file does the same for
itself, but a rank imports the generated stage file first, and a stage that calls a torchvision
function by module path (`torchvision.ops.stochastic_depth`) imports torchvision before the model
file: without this the rank fails where a real CPU torchvision would import fine.

Python imports only the first `sitecustomize` on sys.path, so this one shadows the system's
(Debian's apport crash-report hook, nothing the suite needs); the suite's venv has none of its own.
"""
import importlib.abc
import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parents[1])  # tests/, for torchvision_ops


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    """Imports torchvision_ops just before the first `import torchvision`, so a process that
    never imports torchvision (pip, a plain CLI call) does not pay for importing torch here."""

    def find_spec(self, name, path=None, target=None):  # noqa: ANN001 - importlib's protocol
        if name == "torchvision":
            sys.meta_path.remove(self)
            if _TESTS not in sys.path:
                sys.path.append(_TESTS)
            import torchvision_ops  # noqa: F401  (defines the schemas when _C cannot load)
        return None  # the usual finders import torchvision itself


sys.meta_path.insert(0, _BeforeTorchvision())
