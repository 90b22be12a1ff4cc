"""Choosing intra-layer splits (BaPipe): which heavy layers to shard, into what sizes.

Policy on top of two mechanisms: `passes.split_layers.split_node` (the graph rewrite) and
`passes.plan_search.Planner` (the exact partitioner). For each splittable layer heavier than half
a balanced stage (heaviest first, at most `max_layers`), on a copy of the graph:
  1. split it into q fine equal shards (q = min(4·stages, extent)): the partitioner then places
     contiguous runs of shards on neighbouring stages — choosing the shard sizes;
  2. merge the shards that landed on the same stage (re-split the original with those sizes),
     re-plan, and keep the split only if the bottleneck drops by more than 1%.
A layer heavier than a k-th of the work ends up on k stages this way. The same two steps also
run on a set of layers at once (every splittable layer next to a cut, and the heavy ones):
then every cut moves in fine steps together (`search` tries both ways). Copies share the
model's parameters (only the fx graph is copied), so trying a split costs no weight memory.
"""

from __future__ import annotations

import copy
import warnings
from typing import Callable

import torch.fx as fx
from torch import nn

from pipecc.errors import PipeccError
from pipecc.ir.graph import META_NAME, AnnotatedGraph
from pipecc.ir.plan import Plan, SplitLayer
from pipecc.passes.split_forms import owners_cached
from pipecc.passes.split_layers import extent, recost_added, split_node, splittable

IMPROVEMENT = 0.01   # stop when the bottleneck is within 1% of the lower bound
ACCEPT = 0.001       # keep a split that lowers the bottleneck by more than 0.1%: moving the
                     # bottleneck to another stage is progress even when the gain is small


def splittable_names(graph: AnnotatedGraph) -> list[str]:
    """Nodes `split_node` can split: fx layer modules, and linear / conv2d / embedding calls
    on parameters (torch.export, ONNX); `split_layers.recognise` says which and why not."""
    with owners_cached(graph.gm):
        return [n.meta[META_NAME] for n in graph.compute_nodes()
                if n.op in ("call_module", "call_function") and splittable(graph, n)]


def clone(graph: AnnotatedGraph) -> AnnotatedGraph:
    """A copy of the graph structure and annotations over the same modules and parameters."""
    with warnings.catch_warnings():
        # NOTE: torch 2.13's pytree warns (FutureWarning, on stderr before pipecc's own line)
        # when the graph's input treespec is deep-copied; the copy is right, the warning is torch's
        warnings.filterwarnings("ignore", message=r".*treespec", category=FutureWarning)
        copied = copy.deepcopy(graph.gm.graph)
    gm = _lazy_module(graph.gm, copied, type(graph.gm).__name__)
    # NOTE: GraphModule copies only what the graph references; a split layer's parameters
    # are referenced by none (its shards read them through an unregistered parent), so the
    # clone re-registers whatever the graph's module owns: it must own the same tensors.
    _adopt_missing(gm, graph.gm)
    # NOTE: what the graph module records about itself (its one captured mode and why, the batch
    # analysis' finding, flash attention) belongs to the copy too: every stage reads it
    gm.meta.update(graph.gm.meta)
    return AnnotatedGraph(gm=gm, symbols=graph.symbols, point=graph.point, source=graph.source,
                          model_name=graph.model_name, warnings=list(graph.warnings))


def _lazy_module(root: nn.Module, graph: fx.Graph, name: str) -> fx.GraphModule:
    """A GraphModule over `graph` that writes its Python code only when it is first run or
    read (`recompile` is lazy too): the search plans many clones and runs one.
    NOTE: torch.fx's lazy module is private API; a torch without it gets the eager one."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule, _make_graph_module
    except ImportError:
        return fx.GraphModule(root, graph, class_name=name)
    return _make_graph_module(root, graph, class_name=name, graph_module_cls=_LazyGraphModule)


def _adopt_missing(gm: fx.GraphModule, source: fx.GraphModule) -> None:
    """Register in `gm` every parameter and buffer of `source` it lacks, at the same path
    (the outermost missing module, or the tensor itself on the root)."""
    have = {n for n, _ in gm.named_parameters()} | {n for n, _ in gm.named_buffers()}
    wanted = [n for n, _ in source.named_parameters()] + [n for n, _ in source.named_buffers()]
    for name in wanted:
        if name in have:
            continue
        parts = name.split(".")
        for k in range(1, len(parts)):
            prefix = ".".join(parts[:k])
            if not _has_submodule(gm, prefix):
                gm.add_submodule(prefix, source.get_submodule(prefix))
                break
        else:
            if len(parts) == 1 and not hasattr(gm, name):
                tensor = getattr(source, name)
                if isinstance(tensor, nn.Parameter):
                    gm.register_parameter(name, tensor)
                else:
                    gm.register_buffer(name, tensor)
        have = {n for n, _ in gm.named_parameters()} | {n for n, _ in gm.named_buffers()}


def _has_submodule(gm: fx.GraphModule, name: str) -> bool:
    try:
        gm.get_submodule(name)
    except AttributeError:
        return False
    return True


def _extent(graph: AnnotatedGraph, name: str) -> int:
    # NOTE: a layer's extent is its own shape: remembered per graph during one `search` (it asks
    # again for every trial; each call walks the graph's names and recognises the layer)
    known = _EXTENTS.get(id(graph))
    if known is None or known[0] is not graph:
        known = _EXTENTS[id(graph)] = (graph, {})
        while len(_EXTENTS) > 8:
            _EXTENTS.pop(next(iter(_EXTENTS)))
    if name not in known[1]:
        known[1][name] = extent(graph, graph.by_name()[name], 0)
    return known[1][name]


_EXTENTS: dict[int, tuple[AnnotatedGraph, dict[str, int]]] = {}


def _even(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def _edge_candidates(graph: AnnotatedGraph, plan: Plan, names: list[str]) -> list[str]:
    """Splittable layers at the edges of the bottleneck stage: splitting one of them moves
    work across the slowest cut in finer steps than whole layers."""
    split = set(names)
    slowest = max(plan.stages, key=lambda st: st.forward_s + st.backward_s + st.comm_s).index
    out: list[str] = []
    for k, pick in ((slowest, -1), (slowest, 0), (slowest - 1, -1), (slowest + 1, 0)):
        if 0 <= k < len(plan.stages):
            inside = [n for n in plan.stages[k].nodes if n in split]
            if inside:
                out.append(inside[pick])
    return list(dict.fromkeys(out))


def _try(graph: AnnotatedGraph, plan: Plan, names: list[str], replan, stages: int):
    """(plan, graph, {layer: merged sizes}, {layer: shards}) for splitting `names` together,
    or None if every one of them stays whole (or no placement of the split graph exists)."""
    fine = clone(graph)
    fine_sizes: dict[str, list[int]] = {}
    fine_shards: dict[str, list[str]] = {}
    before = set(fine.gm.graph.nodes)
    with owners_cached(fine.gm):  # NOTE: a split registers shards owning no parameter (below)
        for name in names:
            extent = _extent(graph, name)
            q = min(4 * stages, extent)
            if q >= 2:
                fine_sizes[name] = _even(extent, q)
                fine_shards[name] = split_node(fine, name, fine_sizes[name], recost=False)
    if not fine_sizes:
        return None
    recost_added(fine, before)  # NOTE: once for every layer (issue 31: the same costs)
    try:
        stage_of = replan(fine, True).stage_of()
    except PipeccError:  # e.g. an FPGA stage that would have to hold shards it cannot generate
        return None
    merged_all: dict[str, list[int]] = {}
    for name, sizes in fine_sizes.items():
        merged: list[int] = []
        last_stage = None
        for shard, size in zip(fine_shards[name], sizes):
            if stage_of.get(shard) == last_stage and merged:
                merged[-1] += size
            else:
                merged.append(size)
                last_stage = stage_of.get(shard)
        if len(merged) >= 2:
            merged_all[name] = merged
    if not merged_all:
        return None
    trial = clone(graph)
    before = set(trial.gm.graph.nodes)
    # NOTE (issue 31): how many names each parameter has is counted once for the trial's
    # splits, not once per split (384 walks of the model's parameters at 48 layers): a split
    # registers shard modules that own no parameter (they read their parent's through an
    # unregistered reference) and removes no module, so the counts stay those of the clone
    with owners_cached(trial.gm):
        shards = {name: split_node(trial, name, merged, recost=False) for name, merged in merged_all.items()}
    recost_added(trial, before)
    try:
        return replan(trial, True), trial, merged_all, shards
    except PipeccError:
        return None


def _cut_neighbours(plan: Plan, names: list[str]) -> list[str]:
    """Splittable layers next to every cut: the last of each stage and the first of the next."""
    split = set(names)
    out: list[str] = []
    for st in plan.stages:
        inside = [n for n in st.nodes if n in split]
        if inside:
            out += [inside[0], inside[-1]]
    return list(dict.fromkeys(out))


def search(graph: AnnotatedGraph, plan: Plan, replan: Callable[[AnnotatedGraph, bool], Plan],
           layer_time: Callable[[str], float], max_layers: int | None = None,
           budget: int | None = None,
           note: Callable[[str], None] = lambda s: None,
           bound: Callable[[AnnotatedGraph, list[str]], float] | None = None) -> tuple[Plan, AnnotatedGraph]:
    """Improve `plan` by splitting layers, two ways, keeping the lower bottleneck: the layers
    next to every cut split together first and then one at a time, or one at a time only
    (each way is `_search`). Neither wins always: the joint split moves every cut in fine
    steps (VGG-16 on 4 A100s: ratio 1.15 -> 1.06), but fixes the shard sizes of a heavy layer
    before the greedy pass could choose them alone (GPT-2's lm_head: 1.09 one at a time, 1.10
    joint)."""
    results = []
    _EXTENTS.clear()  # NOTE: remembered within one search, whose graphs nothing rewrites
    for joint in (True, False):
        notes: list[str] = []
        used: list[bool] = []
        results.append((*_search(graph, plan, replan, layer_time, max_layers, budget,
                                 notes.append, joint, bound, used.append), notes))
        if joint and not used:
            # NOTE: pruned (issue 31): the joint split was not kept, so the rest of this way
            # ran the one-at-a-time search from the same plan: the other way would repeat
            # it, try for try, and tie (the joint way wins ties: its notes are the ones kept)
            break
    _EXTENTS.clear()
    best = min(results, key=lambda r: r[0].bottleneck_s)
    for line in best[2]:
        note(line)
    return best[0], best[1]


def _search(graph: AnnotatedGraph, plan: Plan, replan: Callable[[AnnotatedGraph, bool], Plan],
            layer_time: Callable[[str], float], max_layers: int | None, budget: int | None,
            note: Callable[[str], None], joint: bool,
            bound: Callable[[AnnotatedGraph, list[str]], float] | None = None,
            joined: Callable[[bool], None] = lambda b: None) -> tuple[Plan, AnnotatedGraph]:
    """One way of `search`. `replan(graph, fixed)` plans a graph (keeping the
    current schedule and micro-batch count when `fixed`); `layer_time(name)` is a layer's
    fwd+bwd time on its fastest device. Heavy layers (over half a balanced stage) are tried
    first, then layers at the edges of the bottleneck stage; at most `max_layers` splits are
    kept (default: one per stage) and `budget` layers tried (default: three per stage, at most
    16; each try costs two plans). The
    schedule and micro-batch count stay those of `plan`, so its lower bound still applies."""
    given, stages = plan, len(plan.stages)
    max_layers = stages if max_layers is None else max_layers
    budget = min(3 * stages, 16) if budget is None else budget
    lower, baselines = plan.lower_bound_s, plan.baselines
    names = splittable_names(graph)
    tried: set[str] = set()
    heavy = sorted((n for n in names if layer_time(n) > 0.5 * lower), key=layer_time, reverse=True)
    kept = 0

    def hopeless(names_: list[str], why: str) -> bool:
        """Pruned (issue 31): `bound(graph, names)` bounds the bottleneck of every plan of this
        shape with those layers split any way (`passes.plan_emit.shape_bound`); at or above
        what `accept` needs, the trial would be planned twice and then refused."""
        if bound is None:
            return False
        least = bound(graph, names_)
        if least < plan.bottleneck_s * (1 - ACCEPT):
            return False
        note(f"not splitting {why}: no split of it beats {plan.bottleneck_s * 1e3:.4g} ms by "
             f"{ACCEPT:.1%} (bound {least * 1e3:.4g} ms)")
        return True

    def accept(result, why: str) -> bool:
        nonlocal plan, graph, names, kept
        trial_plan, trial, merged, shards = result
        if trial_plan.bottleneck_s >= plan.bottleneck_s * (1 - ACCEPT):
            note(f"not splitting {why}: {trial_plan.bottleneck_s * 1e3:.4g} ms vs "
                 f"{plan.bottleneck_s * 1e3:.4g} ms")
            return False
        note(f"split {', '.join(f'{n} into {merged[n]}' for n in merged)}: bottleneck "
             f"{plan.bottleneck_s * 1e3:.4g} -> {trial_plan.bottleneck_s * 1e3:.4g} ms")
        trial_plan.split_layers = plan.split_layers + [
            SplitLayer(node=n, parts=len(merged[n]), dim=0, sizes=merged[n], shards=shards[n])
            for n in merged]
        plan, graph, names = trial_plan, trial, splittable_names(trial)
        kept += len(merged)
        return True

    # first every layer next to a cut (and every heavy one) at once: each cut then moves in
    # fine steps together with the others, which one layer at a time cannot do when the
    # bottleneck sits on another stage
    if joint and plan.bottleneck_s > lower * (1 + IMPROVEMENT):
        # NOTE: the greedy pass's filter: a layer lighter than the gap to the bound already
        # moves in finer steps than the gap (and a 20,000-node graph would clone 32 times)
        gap = plan.bottleneck_s - lower
        together = [n for n in dict.fromkeys(heavy + _cut_neighbours(plan, names))
                    if layer_time(n) > gap][: 2 * stages]
        if len(together) > 1 and not hopeless(together, f"{len(together)} layers next to the cuts together"):
            result = _try(graph, plan, together, replan, stages)
            if result is None:
                note(f"not splitting {len(together)} layers next to the cuts together: each "
                     "best fine split keeps them whole")
            elif accept(result, f"{len(together)} layers next to the cuts together"):
                joined(True)
    while kept < max_layers and len(tried) < budget and plan.bottleneck_s > lower * (1 + IMPROVEMENT):
        # a layer smaller than the gap to the bound is not what keeps the cut coarse:
        # moving whole layers already has finer steps than the gap, splitting cannot help
        gap = plan.bottleneck_s - lower
        edges = [n for n in _edge_candidates(graph, plan, names) if layer_time(n) > gap]
        queue = [n for n in heavy + edges if n not in tried and n in set(names)]
        if not queue:
            break
        improved = False
        for name in queue[: budget - len(tried)]:
            tried.add(name)
            if hopeless([name], name):
                continue
            result = _try(graph, plan, [name], replan, stages)
            if result is None:
                note(f"not splitting {name}: the best fine split keeps it on one stage "
                     "(or no split of it can be placed)")
                continue
            if accept(result, name):
                improved = True
                break
        if not improved:
            break
    # the bound and the baselines stay those of the unsplit graph: the bound already covers
    # every split, and other tools would partition the original layers (`given` has them and
    # stays as it was: the result is `given` itself when no split was kept)
    if plan is not given:
        plan.lower_bound_s, plan.baselines = lower, baselines
    return plan, graph
