"""The real-model pass table: library models as their libraries build them (transformers,
torchvision, timm; random weights, small configs) through the path the README teaches.

    .venv/bin/python bench/real_models.py                                 # all models, prints
    .venv/bin/python bench/real_models.py --write bench/RESULTS.md        # ~15-25 min on 2 cores
    .venv/bin/python bench/real_models.py --models gpt2 resnet18 --checks cost dropin

The models and the checks are tests/real_zoo.py's, the ones tests/test_real_models.py asserts
(its xfail marks are this table's failures): cost (matmul-class FLOPs forward/backward as a
ratio of FlopCounterMode's, within 2 %), `pipecc compile --devices 2xcpu` with the defaults and
with `--replicas 1` (stages x replicas), `pipecc run --verify` on the `--replicas 1` folder
(train) and on a `--inference --replicas 1` folder (eval), and the drop-in `pipecc.compile`
(eval-mode outputs, their type and the gradients), and for the encoder-decoders `run --verify
--schedule zb-h1` on the `--replicas 1` folder. Each failure is listed under the table with
its one-line error. The table says what happened on this checkout, nothing more: it does not
compare against a stored answer.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_zoo  # noqa: E402
from results import replace_section  # noqa: E402

SECTION = "real-models"
HEADERS = {"cost": "cost (fwd/bwd)", "compile": "compile", "compile_r1": "compile --replicas 1",
           "verify_train": "verify train", "verify_eval": "verify eval", "dropin": "drop-in",
           "verify_zb": "verify zb-h1"}


def run_matrix(names: list[str], checks: list[str], say=print) -> list[dict]:
    """Every (model, check) result, one dict per model: name, library, seconds, results."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="pipecc-real-") as tmp:
        for name in names:
            model = real_zoo.BY_NAME[name]
            folder = Path(tmp) / name
            folder.mkdir()
            run = real_zoo.ModelRun(model, folder)
            t0 = time.perf_counter()
            results = {}
            for check in checks:
                if check in real_zoo.checks_of(model):
                    results[check] = run.result(check)
                    say(f"{name:22s} {check:13s} {results[check][0]:4s} {results[check][1]}")
            rows.append({"name": name, "library": model.library, "build": model.build,
                         "seconds": round(time.perf_counter() - t0, 1), "results": results})
    return rows


def markdown(rows: list[dict], checks: list[str], wall_s: float) -> str:
    """The pass table, its failures numbered below it."""
    failures: list[str] = []
    refusals: list[str] = []
    lines = ["| model | library | " + " | ".join(HEADERS[c] for c in checks) + " | s |",
             "|---|---|" + "---|" * len(checks) + "---|"]
    for row in rows:
        cells = []
        for check in checks:
            if check not in row["results"]:
                cells.append("—")
                continue
            status, detail = row["results"][check]
            if status == "pass":
                cells.append(detail if check in ("cost", "compile", "compile_r1") else "pass")
            elif real_zoo.BY_NAME[row["name"]].checks:  # a row kept to show the library default's refusal
                refusals.append(f"{row['name']} {HEADERS[check]}: {detail}")
                cells.append(f"refused ({len(refusals)})")
            else:
                failures.append(f"{row['name']} {HEADERS[check]}: {detail}")
                cells.append(f"**FAIL** [{len(failures)}]")
        lines.append(f"| {row['name']} | {row['library']} | " + " | ".join(cells) + f" | {row['seconds']:.0f} |")
    passed = sum(r == "pass" for row in rows for r, _ in row["results"].values())
    total = sum(len(row["results"]) for row in rows) - len(refusals)
    head = [f"Real models (`bench/real_models.py`): {passed} of {total} checks pass, and {len(refusals)} "
            f"refusals of library defaults no pipeline can run as written (one line each, listed below); "
            f"{wall_s:.0f} s wall "
            f"on {os.cpu_count()} CPUs (load average {os.getloadavg()[0]:.1f} at the end). Compile "
            "cells: stages x replicas of the plan on 2xcpu, batch 4. Cost: pipecc's matmul-class "
            "FLOPs over FlopCounterMode's (grouped-convolution backward fixed), forward/backward.", ""]
    tail = ["", "Failures:", ""] + [f"{i}. {f}" for i, f in enumerate(failures, 1)] if failures else []
    tail += ["", "Refusals (the rows that keep a library default):", ""] + [
        f"({i}) {f}" for i, f in enumerate(refusals, 1)] if refusals else []
    return "\n".join(head + lines + tail) + "\n"


def main(argv: list[str] | None = None) -> int:
    names = [m.name for m in real_zoo.MODELS]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=names, default=names)
    parser.add_argument("--checks", nargs="+", choices=real_zoo.CHECKS, default=real_zoo.CHECKS)
    parser.add_argument("--write", type=Path, metavar="FILE", help=f"put the table in FILE's {SECTION} section")
    parser.add_argument("--json", type=Path, metavar="FILE", help="every result as JSON")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    rows = run_matrix(args.models, args.checks, say=lambda s: print(s, file=sys.stderr, flush=True))
    text = markdown(rows, args.checks, time.perf_counter() - t0)
    print(text)
    if args.write:
        replace_section(args.write, SECTION, text)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
