"""`PlanOptions`: every planning option, its default and its check.

The command line (`pipecc.cli.plan.options_from_args` converts the parsed flags once),
`pipecc.driver.plan` (its keywords are these fields, `PlanOptions.of`) and `pipecc.compile`
(`**plan_options`) all build one of these; the planner's passes (`passes.plan_*`, the
technique modules) read it. A bad value is one `UsageError` line naming the flag and the
choices, raised when the options are built (`__post_init__`), before any search runs.

The defaults are the Python API's (`driver.plan`, `pipecc.compile`): the plain pipeline
(`replicas=1`) and no activation balancing, because one process (the drop-in module) cannot
run replica groups or BPipe's pairs side by side, and every device given (`use_all_devices`:
the drop-in's caller names the devices its stages go to). The command line's own defaults are
its flags' (`--replicas auto`, `--activation-balancing auto`, `--fpga-number float`, fewer
devices when they are predicted faster unless `--use-all-devices`).

What needs the model is resolved by the driver: `batch_size=None` is the graph's example
batch, and a `microbatch_sizes` list fixes the schedule, replicas and micro-batch count
(`techniques.umpipe.plan.base_options`).

A technique's switches are its package's (`pipecc.techniques.<name>.OPTIONS`, one
`techniques.options.Option` each): `PlanOptions` is `BaseOptions`, the fields every plan has, with
one field per switch added (`dataclasses.make_dataclass`; the field's name is the option's
`dest`, its type `type`, its default `planner_default`) and one per planner field it has
without a switch (`SETTINGS`, `techniques.options.Setting`: UMPIPE's search budget,
Bi-Partition's window), so adding a technique adds no field here.
A switch's value is checked against its `choices`, and a technique's checks across options
are its package's `options_problem(options)` (None, or the one line the error says).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pipecc.ir.precision import PRECISIONS
from pipecc.errors import UsageError
from pipecc.ir.schedule.registry import TRAINING_SCHEDULES
from pipecc.techniques import TECHNIQUES
from pipecc.techniques.options import Option, Setting

__all__ = ["BaseOptions", "PlanOptions"]


def switches() -> list[Option]:
    """Every technique's switches (`OPTIONS`), in `TECHNIQUES` order: `PlanOptions`' own fields."""
    return [option for technique in TECHNIQUES for option in getattr(technique, "OPTIONS", ())]


def settings() -> list[Setting]:
    """Every technique's planner fields without a switch (`SETTINGS`), in `TECHNIQUES` order."""
    return [setting for technique in TECHNIQUES for setting in getattr(technique, "SETTINGS", ())]


@dataclass
class BaseOptions:
    """The options every plan has, without the techniques' switches: `PlanOptions` adds those
    (module docstring); build a `PlanOptions`, not one of these."""

    batch_size: int | None = None     # None: the graph's example batch (the driver resolves it)
    microbatches: int | str = "auto"  # M or "auto"
    schedule: str = "auto"            # "auto" or one of the registry's training schedules
    training: bool = True             # False: forward passes only (the inference schedule)
    optimizer_states: int = 2         # Adam: two moments per weight
    dtype: str = "fp32"               # the devices' peak FLOP/s looked up for it (see precision)
    # mixed precision the run will use: "fp32", or "bf16"/"fp16" (forward and loss under
    # torch.autocast, float32 messages in that dtype): the bytes held and sent follow autocast
    # (pipecc.cost_precision) and GPUs compute at that dtype's peak
    precision: str = "fp32"
    coarse: bool = False              # cut only at block boundaries
    choose_order: bool = False        # order interchangeable devices
    split_layers: bool = True         # intra-layer splits (passes.split_search)
    virtual_stages: int = 2           # stages per rank under interleaved
    compare: bool = False             # add the baselines' partitions to the plan
    fpga_number: str | None = None    # FPGA stages' number format (None: from dtype)
    profile: Any = None               # measured costs (a `pipecc profile` file, its dict or Profile)
    calibrate: Any = None             # a `pipecc run --json` document (file, dict or Calibration): measured
                                      # stage times mapped back onto the nodes (pipecc.targets.calibrated)
    replicas: int | str = 1           # PP x DP degree: N or "auto" (techniques.replicas.search)
    flash_attention: bool = False     # cost fused attention as flash attention runs it (cost.annotate)
    # False: a plan on fewer of the devices (one, when pipelining does not pay) is a candidate
    # (`passes.device_count`); True: every device gets a stage (or a replica)
    use_all_devices: bool = True

    def __post_init__(self) -> None:
        if self.schedule != "auto" and self.schedule not in TRAINING_SCHEDULES:
            raise UsageError(f"--schedule {self.schedule!r}: choose auto, {', '.join(TRAINING_SCHEDULES[:-1])} or "
                             f"{TRAINING_SCHEDULES[-1]}")
        for option in switches():
            why = option.problem(getattr(self, option.dest))
            if why is not None:
                raise UsageError(why)
        if self.replicas != "auto" and (isinstance(self.replicas, bool) or not isinstance(self.replicas, int)
                                        or self.replicas < 1):
            raise UsageError(f"--replicas {self.replicas!r}: use auto or a positive integer")
        if self.precision not in PRECISIONS:
            raise UsageError(f"--precision {self.precision!r}: choose {', '.join(PRECISIONS[:-1])} or {PRECISIONS[-1]}")
        for technique in TECHNIQUES:  # its checks across options, once every value is one it takes
            check = getattr(technique, "options_problem", None)
            why = check(self) if check is not None else None
            if why is not None:
                raise UsageError(why)
        if self.fpga_number is not None:
            from pipecc.targets.fpga_model import parse_number  # NOTE: imports torch
            parse_number(self.fpga_number)  # a bad format is an error even without FPGA devices

    @property
    def compute_dtype(self) -> str:
        """The dtype whose peak a CPU's or GPU's roofline uses: the precision's under mixed
        precision, else `dtype`."""
        return self.precision if self.precision != "fp32" else self.dtype

    @classmethod
    def of(cls, options: PlanOptions | None = None, **fields: Any) -> PlanOptions:
        """`options` (default: the defaults) with `fields` replacing its values; an unknown
        field is one line naming the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise UsageError(f"unknown plan option {unknown[0]!r}; the plan options are "
                             f"{', '.join(sorted(known))}")
        return dataclasses.replace(options, **fields) if options is not None else cls(**fields)


# What the planner may choose and how it costs the model: `BaseOptions`, every technique's switch and setting
# (module docstring). Its fields, as the Python API takes them: `dataclasses.fields(PlanOptions)`.
PlanOptions = dataclasses.make_dataclass(
    "PlanOptions", [*((o.dest, o.type, dataclasses.field(default=o.planner_default)) for o in switches()),
                    *((s.dest, s.type, dataclasses.field(default=s.default)) for s in settings())],
    bases=(BaseOptions,), namespace={"__doc__": "What the planner may choose and how it costs the model "
                                            "(`passes.plan_options` docstring)."})
PlanOptions.__module__ = __name__
