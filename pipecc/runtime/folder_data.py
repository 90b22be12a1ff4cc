"""The compiled folder's data files as ``CompiledFolder`` reads them for showing (``pipecc inspect``,
the report page, ``pipecc.load``'s ``module.plan``): plan.json as a typed ``Plan`` and what makes
one read from disk unusable (``plan_problem``); ports.json, graph.json, timeline.json and an FPGA
stage's estimates.json as JSON (``read_data``). The folder is data from disk: every problem is one
``PipeccError`` line naming the file.

Imports ``pipecc.errors``, ``pipecc.ir.plan`` and ``pipecc.runtime.folder_sums`` only.
"""

from __future__ import annotations

import json
import math
from numbers import Real
from pathlib import Path
from typing import Any

from pipecc.errors import PipeccError
from pipecc.ir.plan import Plan

__all__ = ["DATA_MAX_BYTES", "plan_problem", "read_data", "read_typed_plan"]

DATA_MAX_BYTES = 256 << 20  # graph.json of a large model; a FIFO or a device there is never read


def read_data(path: Path, what: str) -> Any:
    """``path`` parsed as JSON (a regular file, size-capped), refused in one line naming ``what``."""
    from pipecc.runtime.folder_sums import read_regular
    try:  # a regular file only, size-capped: a FIFO or a device there would hang the read
        return json.loads(read_regular(path, DATA_MAX_BYTES).decode("utf-8"))
    except PipeccError as exc:
        raise PipeccError(f"{path}: cannot read the {what} ({str(exc).split('; ')[0]})") from None
    except OSError as exc:
        raise PipeccError(f"{path}: cannot read the {what} ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise PipeccError(f"{path}: the {what} is not valid JSON ({exc})") from None
    except RecursionError:
        raise PipeccError(f"{path}: the {what} nests too deeply to read; it is damaged: compile "
                          "the folder again") from None


def read_typed_plan(out: str | Path, data: Any = None) -> Plan:
    """OUT/plan.json as a Plan; a missing, unreadable or malformed file is a PipeccError (its
    figures are not checked: see `plan_problem`). ``data``: the file already parsed
    (``CompiledFolder.typed_plan``), else read here."""
    path = Path(out)
    try:
        return Plan.from_json(read_data(path / "plan.json", "plan") if data is None else data)
    except (TypeError, KeyError, AttributeError, ValueError) as exc:
        raise PipeccError(f"{path}/plan.json does not match this pipecc's plan format ({exc})") from None


def plan_problem(plan: Plan) -> str | None:
    """What makes a plan read from disk unusable by the views, in words, or None. The views
    index devices by `stage.device` and stages by `stage.index`, and do arithmetic on the
    figures: a plan.json edited by hand (or cut short) must not reach them."""
    def number(x: Any) -> bool:
        return isinstance(x, Real) and not isinstance(x, bool) and math.isfinite(x) and x >= 0

    def count(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 1

    if not isinstance(plan.devices, list) or not all(
            isinstance(d, dict) and isinstance(d.get("name"), str) and isinstance(d.get("kind"), str)
            for d in plan.devices):
        return "devices must be a list of {name, kind}"
    if not isinstance(plan.stages, list) or not plan.stages:
        return "it has no stages"
    for k, s in enumerate(plan.stages):
        if s.index != k or isinstance(s.index, bool):
            return (f"stage {k} says index {s.index!r}; stages are numbered 0..{len(plan.stages) - 1} "
                    "in order")
        if not isinstance(s.device, int) or isinstance(s.device, bool) \
                or not 0 <= s.device < len(plan.devices):
            have = f"devices 0..{len(plan.devices) - 1}" if plan.devices else "no devices"
            return f"stage {k} is on device {s.device!r}, but the plan has {have}"
        if not isinstance(s.nodes, list) or not all(isinstance(n, str) for n in s.nodes):
            return f"stage {k}'s nodes must be a list of names"
        for f in ("forward_s", "backward_s", "comm_s", "send_bytes", "recv_bytes", "peak_memory_bytes",
                  "forward_flops", "param_bytes"):
            if not number(getattr(s, f)):
                return f"stage {k}'s {f} is {getattr(s, f)!r}, not a number >= 0"
    for f in ("batch_size", "microbatches", "virtual_stages", "replicas"):
        if not count(getattr(plan, f)):
            return f"{f} is {getattr(plan, f)!r}, not a positive integer"
    for f in ("bottleneck_s", "lower_bound_s", "predicted_iteration_s", "bubble_fraction"):
        if not number(getattr(plan, f)):
            return f"{f} is {getattr(plan, f)!r}, not a number >= 0"
    if len(plan.devices) % plan.replicas:
        return f"replicas {plan.replicas} does not divide its {len(plan.devices)} devices"
    sizes = plan.microbatch_sizes
    if sizes is not None:  # UMPIPE: one list of positive sizes per stage, each summing to the batch
        if not isinstance(sizes, list) or len(sizes) != len(plan.stages):
            return f"microbatch_sizes must hold one list per stage ({len(plan.stages)}), got {sizes!r}"
        for k, row in enumerate(sizes):
            if not isinstance(row, list) or not row or not all(count(b) for b in row) \
                    or sum(row) != plan.batch_size:
                return (f"stage {k}'s microbatch_sizes {row!r} must be positive integers summing "
                        f"to the batch size {plan.batch_size}")
    for k, s in enumerate(plan.stages):
        group = s.replica_devices
        if not isinstance(group, list) or not all(
                isinstance(g, int) and not isinstance(g, bool) and 0 <= g < len(plan.devices)
                for g in group):
            return f"stage {k}'s replica_devices {group!r} are not devices of the plan"
    if not isinstance(plan.model, str) or not isinstance(plan.schedule, str):
        return "model and schedule must be names"
    return None
