"""Choosing intra-layer splits (BaPipe): which heavy layers to shard, into what sizes.

Policy on top of two mechanisms: `passes.split_layers.split_node` (the graph rewrite) and
`passes.balance.Balancer` (the exact partitioner). For each splittable layer heavier than half
a balanced stage (heaviest first, at most `max_layers`), on a copy of the graph:
  1. split it into q fine equal shards (q = min(4·stages, extent)): the partitioner then places
     contiguous runs of shards on neighbouring stages — choosing the shard sizes;
  2. merge the shards that landed on the same stage (re-split the original with those sizes),
     re-plan, and keep the split only if the bottleneck drops by more than 1%.
A layer heavier than a k-th of the work ends up on k stages this way. Copies share the
model's parameters (only the fx graph is copied), so trying a split costs no weight memory.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch.fx as fx

from pipecc.ir import META_NAME, AnnotatedGraph
from pipecc.plan import Plan, SplitLayer
from pipecc.passes.split_layers import split_node, splittable

IMPROVEMENT = 0.01


def splittable_names(graph: AnnotatedGraph) -> list[str]:
    return [n.meta[META_NAME] for n in graph.compute_nodes() if n.op == "call_module"
            and splittable(graph, n)]


def clone(graph: AnnotatedGraph) -> AnnotatedGraph:
    """A copy of the graph structure and annotations over the same modules and parameters."""
    gm = fx.GraphModule(graph.gm, copy.deepcopy(graph.gm.graph), class_name=type(graph.gm).__name__)
    return AnnotatedGraph(gm=gm, symbols=graph.symbols, point=graph.point, source=graph.source,
                          model_name=graph.model_name, warnings=list(graph.warnings))


def _extent(graph: AnnotatedGraph, name: str) -> int:
    node = graph.by_name()[name]
    module = graph.gm.get_submodule(node.target)
    for attr in ("out_features", "out_channels", "num_embeddings"):
        if hasattr(module, attr):
            return int(getattr(module, attr))
    raise ValueError(name)


def _even(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def search(graph: AnnotatedGraph, plan: Plan, replan: Callable[[AnnotatedGraph, bool], Plan],
           layer_time: Callable[[str], float], max_layers: int = 3,
           note: Callable[[str], None] = lambda s: None) -> tuple[Plan, AnnotatedGraph]:
    """Improve `plan` by splitting heavy layers. `replan(graph, fixed)` plans a graph (with the
    current schedule and micro-batch count when `fixed`); `layer_time(name)` is the layer's
    fwd+bwd time on its fastest device."""
    stages = len(plan.stages)
    share = plan.lower_bound_s
    heavy = sorted((n for n in splittable_names(graph) if layer_time(n) > 0.5 * share),
                   key=layer_time, reverse=True)[:max_layers]
    for name in heavy:
        if plan.bottleneck_s <= plan.lower_bound_s * (1 + IMPROVEMENT):
            break
        extent = _extent(graph, name)
        q = min(4 * stages, extent)
        if q < 2:
            continue
        fine = clone(graph)
        fine_sizes = _even(extent, q)
        shards = split_node(fine, name, fine_sizes)
        fine_plan = replan(fine, True)
        stage_of = fine_plan.stage_of()
        merged: list[int] = []
        last_stage = None
        for shard, size in zip(shards, fine_sizes):
            if stage_of.get(shard) == last_stage and merged:
                merged[-1] += size
            else:
                merged.append(size)
                last_stage = stage_of.get(shard)
        if len(merged) < 2:
            note(f"not splitting {name}: the best fine split keeps it on one stage")
            continue
        trial = clone(graph)
        shards = split_node(trial, name, merged)
        trial_plan = replan(trial, False)
        if trial_plan.bottleneck_s < plan.bottleneck_s * (1 - IMPROVEMENT):
            note(f"split {name} ({layer_time(name) * 1e3:.3g} ms fwd+bwd, over half a balanced "
                 f"stage) into {len(merged)} shards {merged}: bottleneck "
                 f"{plan.bottleneck_s * 1e3:.4g} -> {trial_plan.bottleneck_s * 1e3:.4g} ms")
            trial_plan.split_layers = plan.split_layers + [
                SplitLayer(node=name, parts=len(merged), dim=0, sizes=merged, shards=shards)]
            # the bound and the baselines stay those of the unsplit graph: the bound already
            # covers every split, and other tools would partition the original layers
            trial_plan.lower_bound_s = plan.lower_bound_s
            trial_plan.baselines = plan.baselines
            plan, graph = trial_plan, trial
        else:
            note(f"not splitting {name}: {len(merged)} shards would give "
                 f"{trial_plan.bottleneck_s * 1e3:.4g} ms vs {plan.bottleneck_s * 1e3:.4g} ms")
    return plan, graph
