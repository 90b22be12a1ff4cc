"""pipecc: a pipeline-parallel compiler for deep-learning models.

    pipecc.compile(model, example_inputs, devices, **plan_options) -> PipelinedModule
    pipecc.compile(model, example_inputs, devices, options=pipecc.PlanOptions(...))
    pipecc.load(OUT) -> PipelinedModule
    pipecc.distributed.load(OUT) -> DistributedPipeline (a training script under torchrun)
    pm.plan -> pipecc.Plan: print(pm.plan) or print(pm.plan.summary()) shows its stage table

Attributes load lazily so that `import pipecc` stays cheap and the runtime (which imports
`pipecc.ir.schedule`) never pulls in the compiler.
"""

from typing import Any as _Any

__version__ = "0.1.0"
__all__ = ["compile", "distributed", "load", "PipelinedModule", "Plan", "PlanOptions"]


def __dir__() -> list[str]:
    """The public names (they load lazily, so the module's namespace does not hold them)."""
    return sorted([*__all__, "__version__"])


def __getattr__(name: str) -> _Any:
    if name in ("compile", "load"):
        from pipecc import api
        return getattr(api, name)
    if name == "distributed":
        import importlib
        return importlib.import_module("pipecc.distributed")
    if name == "PipelinedModule":
        from pipecc.runtime.local import PipelinedModule
        return PipelinedModule
    if name == "Plan":
        from pipecc.ir.plan import Plan
        return Plan
    if name == "PlanOptions":
        from pipecc.passes.plan_options import PlanOptions
        return PlanOptions
    raise AttributeError(f"module 'pipecc' has no attribute {name!r}")
