"""`pipecc csim OUT [--stage I] [--threaded] [--fifo-depth N]`: C simulation of the FPGA stages
of a compiled folder with g++, compared with the torch stages.

For every `OUT/stage_<i>/hls/` (or only stage I): build the testbench (cached), run it on the
golden input taken from torch at compile time, and compare its output with the golden output
AND with the saved torch stage (`OUT/stage_<i>/stage.py`, eval mode) run again on that input.
Prints one row per stage: number format, max abs / rel error, the tolerance (float: 1e-5 x
max|torch|; fixed point: the propagated rounding bound), pass/fail and compile time; with
`--threaded` (bounded FIFOs, one thread per dataflow process) also each FIFO's high-water
mark against its depth, and a deadlock instead of a hang. Exit 1 when a stage fails or
deadlocks, or when OUT has no FPGA stage.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Sequence

from pipecc.errors import PipeccError, UsageError
from pipecc.report.formatting import printable, terminal_text


def add_parser(subparsers: Any, common_parent: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "csim", parents=[common_parent], help="C-simulate FPGA stages with g++ and compare with torch",
        description="Build each FPGA stage's C++ (OUT/stage_<i>/hls) with g++, run its testbench "
        "and compare with the torch stage: float to 1e-5 relative, fixed point within the "
        "stated rounding bound. --threaded runs every dataflow process in a thread with "
        "bounded FIFOs: it finds deadlocks and reports each FIFO's occupancy.")
    p.add_argument("out", metavar="OUT", help="a folder written by `pipecc compile`")
    p.add_argument("--stage", type=int, metavar="I", help="only stage I")
    p.add_argument("--threaded", action="store_true",
                   help="threads and bounded FIFOs: deadlock detection and FIFO occupancy")
    p.add_argument("--fifo-depth", type=int, metavar="N",
                   help="depth of every internal FIFO (implies --threaded; default: as declared)")
    p.add_argument("--timeout", type=float, default=120.0, metavar="S",
                   help="seconds before a stage's simulation counts as hung (default 120)")
    p.set_defaults(func=cmd_csim)
    return p


def fpga_stage_dirs(out: Path) -> dict[int, Path]:
    """Stage index -> `OUT/stage_<i>/hls` for a compiled folder."""
    from pipecc.runtime.folder import CompiledFolder
    n = int(CompiledFolder.read(out).marker.get("num_stages", 0))
    return {i: out / f"stage_{i}" / "hls" for i in range(n)
            if (out / f"stage_{i}" / "hls" / "stage.json").is_file()}


def _torch_reference(stage_dir: Path, meta: dict[str, Any]):
    """The saved torch stage (eval mode) on the testbench input: (B, *out_shape) float32."""
    import numpy as np
    import torch

    from pipecc.runtime.stagefile import load_stage
    module, _ = load_stage(stage_dir)
    module.eval()
    x = np.fromfile(stage_dir / "hls" / "tb_data" / "input.bin", dtype=np.float32)
    x = torch.from_numpy(x.reshape(meta["batch"], *meta["in_shape"]))
    with torch.no_grad():
        y = module(x)
    y = y[0] if isinstance(y, (tuple, list)) else y
    return y.detach().to(torch.float32).numpy().reshape(-1)


def check_stage(out: Path, index: int, hls: Path, *, threaded: bool, fifo_depth: int | None,
                timeout_s: float) -> dict[str, Any]:
    """Run one stage's C simulation; a row of the report."""
    import numpy as np

    from pipecc.backends.fpga import csim
    from pipecc.backends.fpga.csim import CsimError, check_no_links

    if (out / f"stage_{index}").is_symlink():
        raise CsimError(f"{out / f'stage_{index}'} is a symbolic link; the C simulation writes there, so "
                        "pipecc will not follow it: compile the folder again")
    check_no_links(hls)
    meta = json.loads((hls / "stage.json").read_text())
    r = csim(hls, threaded=threaded, fifo_depth=fifo_depth, timeout_s=timeout_s)
    row: dict[str, Any] = {
        "stage": index, "card": meta.get("card"), "number": meta.get("number"),
        "max_abs_err": r.max_abs_err, "max_rel_err": r.max_rel_err, "tolerance": r.tolerance,
        "tolerance_rule": meta.get("tolerance_rule", ""), "passed": r.passed,
        "deadlock": r.deadlock, "compile_s": r.compile_s, "fifo_occupancy": r.fifo_occupancy,
        "fifo_depth": r.fifo_depth, "message": r.message, "torch_check": None}
    got_path = hls / "tb_data" / "csim_output.bin"
    if r.deadlock or math.isnan(r.max_abs_err) or not got_path.is_file():
        row["passed"] = False
        return row
    # the torch stage written beside it, run again: the reference `pipecc run` would use
    ref = _torch_reference(out / f"stage_{index}", meta)
    got = np.fromfile(got_path, dtype=np.float32)
    if got.size != ref.size:
        row.update(passed=False, message=f"C simulation gave {got.size} values, torch {ref.size}")
        return row
    err = float(np.abs(got.astype(np.float64) - ref).max()) if ref.size else 0.0
    scale = max(float(np.abs(ref).max()) if ref.size else 0.0, 1e-30)
    row["torch_check"] = err <= r.tolerance
    row["max_abs_err"] = max(r.max_abs_err, err)
    row["max_rel_err"] = max(r.max_rel_err, err / scale)
    row["passed"] = bool(r.passed and row["torch_check"])
    return row


def _fmt(v: float) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3g}"


def format_table(rows: Sequence[dict[str, Any]], threaded: bool) -> str:
    head = ["stage", "card", "number", "max abs err", "max rel err", "tolerance (abs)", "result",
            "compile"]
    body = []
    for r in rows:
        result = "DEADLOCK" if r["deadlock"] else ("pass" if r["passed"] else "FAIL")
        body.append([str(r["stage"]), str(r["card"]), str(r["number"]), _fmt(r["max_abs_err"]),
                     _fmt(r["max_rel_err"]), _fmt(r["tolerance"]), result,
                     "cached" if r["compile_s"] == 0 else f"{r['compile_s']:.1f} s"])
    widths = [max(len(h), *(len(b[k]) for b in body)) for k, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths)) for b in body]
    for r in rows:
        lines.append(f"stage {r['stage']}: tolerance {r['tolerance_rule'] or '-'}"
                     + ("" if r["torch_check"] is None else
                        f"; saved torch stage re-run: {'agrees' if r['torch_check'] else 'DIFFERS'}"))
        if threaded and r["fifo_occupancy"]:
            occ = ", ".join(f"{name} {high}/{r['fifo_depth'].get(name, '?')}"
                            for name, high in r["fifo_occupancy"].items())
            lines.append(f"stage {r['stage']}: FIFO occupancy (high-water/depth): {occ}")
        if not r["passed"] and r["message"]:
            lines.append(f"stage {r['stage']}: " + " | ".join(r["message"].splitlines()[:6]))
    return "\n".join(lines)


def cmd_csim(args: argparse.Namespace) -> int:
    from pipecc.backends.fpga import toolchain_problem

    out = Path(args.out)
    stages = fpga_stage_dirs(out)
    if not stages:
        raise PipeccError(f"{out} has no FPGA stages (no stage_<i>/hls); compile with an FPGA "
                          "device such as --devices cpu,u250,cpu")
    if args.stage is not None:
        if args.stage not in stages:
            raise UsageError(f"--stage {args.stage}: not an FPGA stage of {out} "
                             f"(FPGA stages: {', '.join(map(str, sorted(stages)))})")
        stages = {args.stage: stages[args.stage]}
    if args.fifo_depth is not None and args.fifo_depth < 1:
        raise UsageError(f"--fifo-depth must be a positive integer, got {args.fifo_depth}")
    problem = toolchain_problem()
    if problem:
        raise PipeccError(f"cannot run the C simulation: {problem}")
    threaded = bool(args.threaded or args.fifo_depth is not None)
    rows = [check_stage(out, i, d, threaded=threaded, fifo_depth=args.fifo_depth,
                        timeout_s=args.timeout) for i, d in sorted(stages.items())]
    mode = "threaded, bounded FIFOs" if threaded else "sequential"
    print(terminal_text(f"C simulation of {len(rows)} FPGA stage(s) in {out} with g++ ({mode}):"))
    print(terminal_text(format_table(rows, threaded)))
    failed = [r for r in rows if not r["passed"]]
    if failed:
        what = ", ".join(f"stage {r['stage']} " + ("deadlocked" if r["deadlock"] else
                         f"max abs err {_fmt(r['max_abs_err'])} > {_fmt(r['tolerance'])}")
                         for r in failed)
        raise PipeccError(f"C simulation failed: {what}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m pipecc.cli.csim OUT ...`: the same command without the rest of the CLI."""
    from pipecc.cli.args import Parser

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show tracebacks")
    parser = Parser(prog="pipecc")
    add_parser(parser.add_subparsers(dest="command", parser_class=Parser), common)
    argv = ["csim", *(sys.argv[1:] if argv is None else argv)]
    try:
        args = parser.parse_args(argv)
        return cmd_csim(args)
    except PipeccError as exc:
        if "--debug" in argv:
            raise
        print(f"pipecc: error: {printable(str(exc).strip().splitlines()[0])}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
