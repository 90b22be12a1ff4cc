"""Where the slack between a plan's bottleneck and its lower bound is (issue 31): for each
holdout-style model (bench/models_holdout) at batch 256 on 4xa100 and 2xa100,2xv100, planned
as a pipeline on every device (`driver.plan`'s defaults), the ratio bottleneck / lower_bound_s
of the plan before layer splits, factored exactly into

    B / LB = (B / opt) x (opt / LB_whole) x (LB_whole / LB)

opt: the exact optimum (`partition`) of the plan's own shape with whole units; LB_whole: the
bound of that shape with no unit splittable; LB: the plan's `lower_bound_s`. Also printed:
opt / LB_whole with messages free (1.0 means the whole-unit bound is exact without
communication) and, with --split-cost, what splitting each model's heaviest splittable layers
in two adds to the whole graph's time on one A100 (micro-batch 64).

    .venv/bin/python bench/bound_slack.py
    .venv/bin/python bench/bound_slack.py unet hf_bert --split-cost
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from pipecc import driver  # noqa: E402
from pipecc.passes import plan_emit, split_search  # noqa: E402
from pipecc.passes.bound import lower_bound  # noqa: E402
from pipecc.passes.partition import partition  # noqa: E402
from pipecc.passes.plan_options import PlanOptions  # noqa: E402
from pipecc.passes.plan_search import Planner  # noqa: E402
from pipecc.passes.split_layers import split_node  # noqa: E402
from pipecc.targets.devices import parse_devices  # noqa: E402

MODELS = ("unet", "mobilenet", "two_input", "hf_gpt2", "hf_bert")


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / "models_holdout" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _planner(graph, devices: str, **fields) -> Planner:
    opts, cluster = driver.resolve_options(PlanOptions.of(None, batch_size=256, **fields), graph,
                                           parse_devices(devices))
    names = split_search.splittable_names(graph) if opts.split_layers else []
    return Planner(graph, cluster, opts, splittable=names)


def slack(name: str, graph) -> None:
    for devices in ("4xa100", "2xa100,2xv100"):
        final, _ = driver.plan(graph, devices, batch_size=256)
        planner = _planner(graph, devices)
        plan, cand = planner.run()
        raw = cand.raw or cand.problem
        lb, lb_whole = plan.lower_bound_s, lower_bound(raw, None)
        opt = partition(raw).bottleneck
        free = dataclasses.replace(raw, link_time=lambda k, x: 0.0)
        exact_free = partition(free).bottleneck / lower_bound(raw, None, comm=False)
        print(f"| {name} | {devices} | {cand.schedule} m={cand.microbatches}, {len(cand.part.bounds) - 1} stages "
              f"| {plan.bottleneck_s / lb:.3f} | {plan.bottleneck_s / opt:.3f} | {opt / lb_whole:.3f} "
              f"| {lb_whole / lb:.3f} | {exact_free:.4f} "
              f"| {final.balance_ratio:.3f}, {len(final.split_layers)} split |", flush=True)


def split_cost(name: str, graph, top: int = 4) -> None:
    planner = _planner(graph, "1xa100", split_layers=False)

    def total(g) -> float:
        tables = _planner(g, "1xa100", split_layers=False).tables
        units = tables.builder.at(64)
        fwd, bwd = tables.times(units, 64)
        return float((fwd[0] + bwd[0]).sum())
    times = planner.tables.unit_times(planner.tables.builder.at(64), 64)
    whole = total(graph)
    for layer in sorted(split_search.splittable_names(graph), key=lambda n: -times.get(n, 0.0))[:top]:
        g = split_search.clone(graph)
        size = split_search._extent(graph, layer)
        split_node(g, layer, [size // 2, size - size // 2])
        extra = total(g) - whole
        print(f"| {name} | {layer} | {times[layer] * 1e6:.1f} | {extra * 1e6:+.1f} | {extra / times[layer]:+.0%} |",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("models", nargs="*", default=list(MODELS))
    parser.add_argument("--split-cost", action="store_true")
    args = parser.parse_args()
    graphs = {}
    for name in args.models:
        mod = _module(name)
        graphs[name] = driver.analyze_module(mod.build_model(), mod.example_inputs(2), model_name=name)
    print("| model | devices | plan (before layer splits) | B/LB | B/opt | opt/LB_whole | LB_whole/LB "
          "| opt/LB_whole, messages free | final plan: ratio, splits |")
    print("|---|---|---|--:|--:|--:|--:|--:|---|")
    for name, graph in graphs.items():
        slack(name, graph)
    if args.split_cost:
        print("\n| model | layer split in two | layer fwd+bwd us | added to the graph us | of the layer |")
        print("|---|---|--:|--:|--:|")
        for name, graph in graphs.items():
            split_cost(name, graph)


if __name__ == "__main__":
    main()
