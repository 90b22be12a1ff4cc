"""`pipecc compile` glue for FPGA stages: what `write_output` must add for a plan that puts
stages on FPGA cards (their HLS projects under `OUT/stage_<i>/hls/`).

    writers = fpga_compile.writers(graph, plan, stages, example_inputs, number=args.fpga_number)
    out = write_output(OUT, graph, plan, stages, force=..., writers=writers)
    for line in fpga_compile.notes(plan): print(line)

A plan without FPGA stages gets no writer and no note. Plans with FPGA stages compile for
training too, but the compiled folder is inference-only (`pipecc.json`: "inference_only": true;
FPGA stages have no backward pass): `pipecc.load(OUT)` runs forward, a backward raises.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

from pipecc.errors import PipeccError


def fpga_stages(plan: Any) -> dict[int, str]:
    """Stage index -> FPGA card of the stages `plan` places on FPGA devices."""
    out: dict[int, str] = {}
    for s in plan.stages:
        dev = plan.devices[s.device] if 0 <= s.device < len(plan.devices) else {}
        if dev.get("kind") == "fpga":
            out[int(s.index)] = str(dev.get("name"))
    return out


def writers(graph: Any, plan: Any, stages: Sequence[Any], example_inputs: Sequence[Any] | None,
            number: str = "float") -> list[Callable[[Path], None]]:
    """The `write_output(..., writers=...)` list for `plan` ([] without FPGA stages).

    Checks now what can be checked without writing (one tensor at each FPGA stage boundary,
    the number format), so a bad plan fails before any file is written.
    """
    cards = fpga_stages(plan)
    if not cards:
        return []
    from pipecc.backends.fpga.pipeline import check_boundary, compile_fpga_stages
    from pipecc.targets.fpga_model import parse_number
    parse_number(number)
    by_index = {s.index: s for s in stages}
    for i, card in cards.items():
        if i not in by_index:
            raise PipeccError(f"the plan puts stage {i} on {card} but no such stage was cut")
        check_boundary(by_index[i], card)
    inputs = tuple(example_inputs) if example_inputs is not None else None

    def write_fpga(folder: Path) -> None:
        compile_fpga_stages(folder, graph, plan, stages, inputs, number)
    return [write_fpga]


def notes(plan: Any, out: str | Path | None = None) -> list[str]:
    """Lines to print after compiling: where each FPGA stage's project is; inference-only."""
    cards = fpga_stages(plan)
    if not cards:
        return []
    where = f"{out}/" if out is not None else ""
    lines = [f"stage {i} on {card}: HLS project {where}stage_{i}/hls (check it with "
             f"`pipecc csim {out or 'OUT'} --stage {i}`)" for i, card in sorted(cards.items())]
    lines.append("FPGA stages run forward only: this pipeline is inference-only")
    return lines
