"""Plan quality before/after a planner change: every zoo and holdout-style model planned on a
few clusters, its predicted iteration time recorded, and a later run compared with a record.

    .venv/bin/python bench/check_plan_quality.py --write /tmp/before.json     # on the old code
    .venv/bin/python bench/check_plan_quality.py --against /tmp/before.json  # on the new code

A row is (model, devices, mode): the zoo's models at their TINY sizes and the holdout-style
models (bench/models_holdout) at their defaults, batch 256 (64 for the zoo's TINY models),
on 4xa100 and 2xa100,2xv100, in two modes: "api" (`driver.plan`'s defaults: the plain
pipeline on every device, layer splits searched) and "cli" (`pipecc plan`'s defaults:
--replicas auto, --activation-balancing auto, fewer devices allowed). `--against` prints every
row whose predicted iteration time rose (relative 1e-9) and exits 1 if any did; a faster row
is listed as such. Nothing here is timed: the record is the planner's own predictions.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from pipecc import driver  # noqa: E402
from pipecc.errors import PipeccError  # noqa: E402

ZOO = ("mlp", "tiny_cnn", "gpt", "bert", "vgg16", "resnet50", "gnmt")
HOLDOUT = ("unet", "mobilenet", "two_input", "hf_gpt2", "hf_bert")
DEVICES = ("4xa100", "2xa100,2xv100")
MODES = {"api": {}, "cli": {"replicas": "auto", "activation_balancing": "auto", "use_all_devices": False}}
RTOL = 1e-9


def _module(name: str):
    if name in ZOO:
        return importlib.import_module(f"pipecc.models.{name}")
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / "models_holdout" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def rows(models: list[str]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for name in models:
        mod = _module(name)
        kwargs = dict(getattr(mod, "TINY", {})) if name in ZOO else {}
        batch = 64 if name in ZOO else 256
        graph = driver.analyze_module(mod.build_model(**kwargs), mod.example_inputs(2, **kwargs),
                                      model_name=name)
        for devices in DEVICES:
            for mode, fields in MODES.items():
                key = f"{name} {devices} {mode}"
                try:
                    plan, _ = driver.plan(graph, devices, batch_size=batch, **fields)
                    out[key] = {"iteration_s": plan.predicted_iteration_s, "schedule": plan.schedule,
                                "microbatches": plan.microbatches, "replicas": plan.replicas,
                                "stages": len(plan.stages), "split_layers": len(plan.split_layers),
                                "lower_bound_s": plan.lower_bound_s, "bottleneck_s": plan.bottleneck_s}
                except PipeccError as exc:
                    out[key] = {"error": str(exc)}
                print(key, out[key], flush=True)
    return out


def compare(now: dict[str, dict], before: dict[str, dict]) -> int:
    worse = 0
    for key, row in now.items():
        old = before.get(key)
        if old is None:
            print(f"{key}: not in the record")
            continue
        if "error" in old or "error" in row:
            if ("error" in old) != ("error" in row):
                print(f"{key}: {'now fails: ' + row['error'] if 'error' in row else 'now plans'}")
                worse += "error" in row
            continue
        a, b = old["iteration_s"], row["iteration_s"]
        if b > a * (1 + RTOL):
            worse += 1
            print(f"{key}: SLOWER {a:.6g} -> {b:.6g} s ({b / a - 1:+.3%})")
        elif b < a * (1 - RTOL):
            print(f"{key}: faster {a:.6g} -> {b:.6g} s ({b / a - 1:+.3%})")
    print(f"{len(now)} rows, {worse} worse than the record")
    return 1 if worse else 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="*", default=[*ZOO, *HOLDOUT])
    parser.add_argument("--write", help="write the rows to this JSON file")
    parser.add_argument("--against", help="compare with the rows of this JSON file")
    args = parser.parse_args()
    now = rows(args.models)
    if args.write:
        Path(args.write).write_text(json.dumps(now, indent=1))
    if args.against:
        sys.exit(compare(now, json.loads(Path(args.against).read_text())))


if __name__ == "__main__":
    main()
