"""pipecc: a pipeline-parallel compiler for deep-learning models.

    pipecc.compile(model, example_inputs, devices, **plan_options) -> PipelinedModule
    pipecc.load(OUT) -> PipelinedModule

Attributes load lazily so that `import pipecc` stays cheap and the runtime (which imports
`pipecc.ir.schedule`) never pulls in the compiler.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["compile", "load", "PipelinedModule"]


def __getattr__(name: str) -> Any:
    if name in ("compile", "load"):
        from pipecc import api
        return getattr(api, name)
    if name == "PipelinedModule":
        from pipecc.runtime.local import PipelinedModule
        return PipelinedModule
    raise AttributeError(f"module 'pipecc' has no attribute {name!r}")
