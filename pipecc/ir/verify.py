"""The verifiers: the IR (`verify`) and a plan over it (`verify_plan`). Both raise `IRError`
naming the first violation: a failure is a bug in a pass, not a user error.

    verify(graph, costed=False)          fx lint; every node annotated (and costed)
    verify_plan(graph, plan)             every node placed once, stages non-empty, on valid
                                         devices and acyclic (no value flows backwards);
                                         every technique it uses admissible (below)
    verify_plan(graph, plan, stages)     and the cut stages' ports: every value crossing a
                                         cut is sent once and received once, in matching order

The driver runs them after each step with `debug` (tests always set it). `verify` itself
stays in `pipecc.ir.graph`, beside the annotations it checks, so that module keeps no import
of this one; it is re-exported here.

Placement rules `verify_plan` follows (the port convention of `pipecc.backends.torch.stages`):
`get_attr` nodes (parameters read directly) belong to no single stage, so a plan may list
each at most once but need not; a `getitem` unpacking a computed tuple runs where its tuple
is produced; a value produced at stage a and used at stage b > a is relayed: sent by every
stage a..b-1 and received by every stage a+1..b. Stages and ports are read by duck typing
(`index`, `nodes`, `receives`, `sends`; ports' `name`, `producer`, `stage`), so the IR
imports no backend.

Every technique the plan uses must be admissible (`pipecc.techniques.requires` on a compiled
folder's capabilities): replica groups (PP x DP: d divides the devices, stage k on rank k % P,
its group devices j*d .. j*d+d-1), BPipe pairs, unequal micro-batches, separate forward/backward
cuts, recomputation and zero-bubble schedules, each by its one rule.
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

import torch.fx as fx

from pipecc.ir.graph import META_NAME, META_VALUE, AnnotatedGraph, IRError, verify
from pipecc import techniques
from pipecc.ir.plan import Plan

__all__ = ["IRError", "verify", "verify_plan"]

BEFORE_FIRST = -1  # the "stage" that produces model inputs


def verify_plan(graph: AnnotatedGraph, plan: Plan, stages: Sequence[Any] | None = None) -> None:
    """Check that `plan` places `graph` soundly and, given the cut `stages`, that their ports
    match (see the module docstring). Raises IRError naming the first violation."""
    stage_of = _placement(graph, plan)
    _techniques(plan)
    _acyclic(graph, stage_of)
    if stages is not None:
        _ports(graph, plan, stages)


def _placement(graph: AnnotatedGraph, plan: Plan) -> dict[str, int]:
    """Node name -> stage; stages numbered in order, non-empty, on the plan's devices."""
    stage_of: dict[str, int] = {}
    for k, stage in enumerate(plan.stages):
        if stage.index != k:
            raise IRError(f"plan stage {k} has index {stage.index}; stages must be numbered 0..n-1")
        if not stage.nodes:
            raise IRError(f"stage {k} holds no node")
        if not 0 <= stage.device < len(plan.devices):
            raise IRError(f"stage {k} is on device {stage.device}, but the plan has "
                          f"{len(plan.devices)} devices")
        for name in stage.nodes:
            if name in stage_of:
                raise IRError(f"node {name!r} is placed twice: in stage {stage_of[name]} and stage {k}")
            stage_of[name] = k
    nodes = {n.meta[META_NAME]: n for n in graph.compute_nodes()}
    for name, k in stage_of.items():
        if name not in nodes:
            raise IRError(f"stage {k} lists {name!r}, which is no node of the graph")
    for name, node in nodes.items():
        if node.op != "get_attr" and name not in stage_of:
            raise IRError(f"node {name!r} is placed in no stage")
    return stage_of


def _techniques(plan: Plan) -> None:
    """The techniques' rules (`pipecc.techniques.requires`) on a compiled folder's
    capabilities: replica groups, BPipe pairs, unequal micro-batches, separate cuts, ..."""
    why = techniques.requires(plan, techniques.COMPILED)
    if why is not None:
        raise IRError(why)


def _follows_tuple(node: fx.Node) -> fx.Node | None:
    """The tuple a `getitem` unpacks, when that tuple is computed (it then runs there)."""
    if node.op == "call_function" and node.target is operator.getitem:
        src = node.args[0]
        if isinstance(src, fx.Node) and src.op not in ("placeholder", "get_attr") \
                and isinstance(src.meta.get(META_VALUE), (tuple, list)):
            return src
    return None


def _acyclic(graph: AnnotatedGraph, stage_of: dict[str, int]) -> None:
    """No node uses a value computed at a later stage."""
    placed: dict[fx.Node, int] = {}
    for node in graph.compute_nodes():
        if node.op == "get_attr":
            continue
        src = _follows_tuple(node)
        stage = placed[src] if src is not None else stage_of[node.meta[META_NAME]]
        for inp in node.all_input_nodes:
            if inp.op in ("placeholder", "get_attr"):
                continue
            if placed[inp] > stage:
                raise IRError(f"node {node.meta[META_NAME]!r} (stage {stage}) uses "
                              f"{inp.meta[META_NAME]!r} from the later stage {placed[inp]}: a value "
                              "flows backwards")
        placed[node] = stage


def _ports(graph: AnnotatedGraph, plan: Plan, stages: Sequence[Any]) -> None:
    """Every value crossing a cut: sent once by each stage it leaves or passes, received once
    by each stage it reaches or passes; a stage's sends are the next stage's receives."""
    if len(stages) != len(plan.stages):
        raise IRError(f"the plan has {len(plan.stages)} stages but {len(stages)} were cut")
    cut_of: dict[str, int] = {}
    for k, stage in enumerate(stages):
        if stage.index != k:
            raise IRError(f"cut stage {k} has index {stage.index}")
        for name in stage.nodes:
            if name in cut_of:
                raise IRError(f"node {name!r} was cut into stage {cut_of[name]} and stage {k}")
            cut_of[name] = k
        _no_repeats(k, "receives", stage.receives)
        _no_repeats(k, "sends", stage.sends)
        received, members = {p.name for p in stage.receives}, set(stage.nodes)
        for p in stage.receives:
            if not p.stage < k:
                raise IRError(f"stage {k} receives {p.producer!r}, produced at stage {p.stage}")
        for p in stage.sends:
            own = p.stage == k and p.producer in members
            if not own and p.name not in received:
                raise IRError(f"stage {k} sends {p.producer!r}, which it neither computes nor receives")
        if k == 0 and any(p.stage != BEFORE_FIRST for p in stage.receives):
            raise IRError("stage 0 receives values other than the model's inputs")
        if k + 1 < len(stages):
            sent = [(p.name, p.producer, p.stage) for p in stage.sends]
            got = [(p.name, p.producer, p.stage) for p in stages[k + 1].receives]
            if sent != got:
                raise IRError(f"stage {k} sends {[s[1] for s in sent]} but stage {k + 1} receives "
                              f"{[g[1] for g in got]}")
    n = len(stages)
    for node in graph.gm.graph.nodes if n else ():
        if node.op in ("placeholder", "get_attr"):
            continue
        if node.op == "output":
            user, where = "the model's output", n
        else:
            name = node.meta[META_NAME]
            if name not in cut_of:
                raise IRError(f"node {name!r} was cut into no stage")
            user, where = repr(name), cut_of[name]
        for inp in node.all_input_nodes:
            if inp.op == "get_attr":
                continue
            src = BEFORE_FIRST if inp.op == "placeholder" else cut_of.get(inp.meta[META_NAME])
            if src is None:
                raise IRError(f"node {inp.meta[META_NAME]!r} was cut into no stage")
            if src > where:
                raise IRError(f"{user} (stage {where}) uses {inp.name!r} from the later stage {src}")
            if src < where:
                ports = stages[where].receives if where < n else stages[n - 1].sends
                if inp.name not in {p.name for p in ports}:
                    side = f"stage {where} receives" if where < n else "the last stage sends"
                    raise IRError(f"{user} uses {inp.name!r} from stage {src}, but {side} no port "
                                  "for it")


def _no_repeats(k: int, what: str, ports: Sequence[Any]) -> None:
    seen: set[str] = set()
    for p in ports:
        if p.name in seen:
            raise IRError(f"stage {k} {what} {p.producer!r} twice")
        seen.add(p.name)
