"""Cutting the annotated graph into pipeline stages: one fx GraphModule per stage plus its ports.

Mechanism only: *which* node goes to which stage is the planner's decision (`stage_of`, a map
from every compute node's human name `META_NAME` to a stage index). This module checks that
placement, then builds each stage as an executable `fx.GraphModule` that shares the original
parameter and submodule objects (no weight is copied).

Port convention (what the cost model assumes, what every runtime relies on):

  * cut k lies between stage k and stage k+1; model inputs count as produced at stage -1 and
    the model's outputs as used at stage n (after the last stage);
  * a value is *live across cut k* when it is produced at a stage <= k and used at a stage > k;
  * stage k receives exactly the values live across cut k-1 and sends exactly those live across
    cut k. So a value that skips stages is RELAYED through every stage in between, stage 0
    receives every model input that any stage uses, and the last stage sends the outputs.

Stage GraphModules take their received values positionally in `receives` order and return a
tuple in `sends` order (relayed values pass straight through). Ports may carry non-tensor values
(an int from `x.size(1)`, a `torch.device`): runtimes send those as Python objects; a runtime
that moves values between devices replaces a `torch.device` value by its stage's device.

Three placement rules adjust `stage_of` (see `normalise_stage_of`):

  * a `getitem` that unpacks a tuple (an LSTM's `(out, (h, c))`, `x.split(...)`) follows its
    tuple's producer, so only whole tensors and scalars cross cuts, never tuples;
  * `getattr(x, "device")` (or `.dtype`) moves to the first stage that uses it: a device is
    no value to send (x is relayed to that stage instead);
  * `get_attr` nodes (parameters and buffers read directly) belong to no single stage: every
    stage that uses one gets its own reference to the same tensor. A parameter referenced by more
    than one stage is a *tied weight*; `Stage.tied` lists it. In one process the stages share the
    tensor, so gradients accumulate on it; a distributed runtime must all-reduce its gradient
    across the stages listed.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Union

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from pipecc.ir.graph import (META_NAME, META_OUTPUT_CLASS, META_VALUE, AnnotatedGraph, IRError, ScalarInfo,
                             TensorInfo)
from pipecc.ir.train_flag import follow

PortValue = Union[TensorInfo, ScalarInfo, tuple, None]
BEFORE_FIRST = -1  # the "stage" that produces model inputs


@dataclass(frozen=True)
class Port:
    """One value crossing a cut, as the compiler sees it (written to `ports.json`, which the
    runtime reads back as its own `pipecc.runtime.ports.Port`: the same value, seen from the
    other side of the file).

    `name` is the fx name of the node that computes it in the captured graph (unique, used to match
    a send with a receive), `producer` that node's human name (`META_NAME`, what plans list) and
    `stage` the stage computing it (`-1` for model inputs).
    """

    name: str
    value: PortValue
    producer: str
    stage: int = BEFORE_FIRST


@dataclass
class Stage:
    """One pipeline stage: an executable graph over the original weights, and its ports."""

    index: int
    gm: fx.GraphModule
    receives: list[Port]
    sends: list[Port]
    nodes: list[str]                      # human names of the compute nodes it holds, graph order
    tied: list[str] = field(default_factory=list)   # parameters other stages reference too
    # id(tensor) -> every qualified name the original module knows it by (first = primary)
    tensor_names: dict[int, tuple[str, ...]] = field(default_factory=dict, repr=False)
    nonpersistent: frozenset[int] = frozenset()  # ids of buffers left out of state_dict()
    model_inputs: list[dict[str, Any]] = field(default_factory=list)  # forward's arguments
    model_output: Any = None              # JSON tree of the model's output, see `output_tree`
    point: dict[Any, int] = field(default_factory=dict, repr=False)  # symbol -> example value

    def __call__(self, *args: Any) -> tuple:
        return self.gm(*args)


def _is_tuple_value(node: fx.Node) -> bool:
    return isinstance(node.meta.get(META_VALUE), (tuple, list))


def normalise_stage_of(graph: AnnotatedGraph, stage_of: dict[str, int]) -> dict[str, int]:
    """Check `stage_of` and return the placement the cut uses (node human name -> stage).

    Every compute node except `get_attr` must be placed; stages of connected nodes must not
    decrease along an edge (contiguous, acyclic stages). Tuple-unpacking `getitem`s move to their
    tuple's stage. Raises `IRError` naming the first offending node.
    """
    placed: dict[str, int] = {}
    for node in graph.compute_nodes():
        if node.op == "get_attr":
            continue
        name = node.meta[META_NAME]
        if name not in stage_of:
            raise IRError(f"node {name!r} is not assigned to a stage")
        stage = stage_of[name]
        if not isinstance(stage, int) or stage < 0:
            raise IRError(f"node {name!r} has stage {stage!r}; expected an index >= 0")
        if node.op == "call_function" and node.target is operator.getitem:
            src = node.args[0]
            if isinstance(src, fx.Node) and src.op not in ("placeholder", "get_attr") \
                    and _is_tuple_value(src):
                stage = placed[src.meta[META_NAME]]
        for inp in node.all_input_nodes:
            if inp.op in ("placeholder", "get_attr"):
                continue
            if placed[inp.meta[META_NAME]] > stage:
                raise IRError(f"node {name!r} (stage {stage}) uses {inp.meta[META_NAME]!r} from the "
                              f"later stage {placed[inp.meta[META_NAME]]}; stages must be contiguous")
        placed[name] = stage
    for node in graph.compute_nodes():  # x.device / x.dtype: computed where first used
        users = [u for u in node.users if u.op != "output"]
        if _is_metadata(node) and users:
            placed[node.meta[META_NAME]] = min(placed[u.meta[META_NAME]] for u in users)
    for node in graph.compute_nodes():
        buffer = _buffer_write(node)
        if buffer is not None:  # written where it is computed: no port for the new value
            readers = [placed[u.meta[META_NAME]] for u in buffer.users if u is not node]
            source = [placed[n.meta[META_NAME]] for n in node.all_input_nodes
                      if n.op not in ("placeholder", "get_attr")]
            placed[node.meta[META_NAME]] = max(source + readers, default=placed[node.meta[META_NAME]])
    return placed


def plan_as_cut(plan: Any, graph: AnnotatedGraph) -> Any:
    """`plan` with each stage's `nodes` as the cut places them (`normalise_stage_of`): a
    tuple-unpacking `getitem` listed on the next stage, or an `x.device` listed on an earlier
    one, is where its stage.py computes it. The compiled folder's plan.json and report.html
    show this, so they, `pipecc inspect` (which reads plan.json and graph.json) and each
    stage.py's docstring list the same nodes (issue 21, item 6). Parameter reads (`get_attr`,
    which a plan may list) belong to no stage and are left out: each stage.py reads its own
    weights. The moved nodes cost nothing (tuple items, device and dtype reads, parameter
    reads), so the stages' figures stay the plan's. The same plan object when nothing moves."""
    import dataclasses
    placed = normalise_stage_of(graph, plan.stage_of())
    reads = {n.meta[META_NAME] for n in graph.compute_nodes() if n.op == "get_attr"}
    where = {name: placed.get(name, s.index) for s in plan.stages for name in s.nodes if name not in reads}
    if all(where.get(name) == s.index for s in plan.stages for name in s.nodes):
        return plan
    order = [name for s in plan.stages for name in s.nodes if name in where]
    stages = [dataclasses.replace(s, nodes=[n for n in order if where[n] == s.index]) for s in plan.stages]
    return dataclasses.replace(plan, stages=stages)


def _buffer_write(node: fx.Node) -> fx.Node | None:
    """The buffer's get_attr when `node` is torch.export's write-back of a buffer mutated in
    forward (`copy_(buffer, new value)`, used by nothing), else None."""
    if node.op != "call_function" or node.target is not torch.ops.aten.copy_.default or node.users:
        return None
    target = node.args[0] if node.args else None
    return target if isinstance(target, fx.Node) and target.op == "get_attr" else None


def _is_metadata(node: fx.Node) -> bool:
    """`getattr(x, "device")` and the like: a value no runtime can send as JSON."""
    value = node.meta.get(META_VALUE)
    return (node.op == "call_function" and node.target is getattr
            and isinstance(value, ScalarInfo) and value.value is None)


def cut_stages(graph: AnnotatedGraph, stage_of: dict[str, int]) -> list[Stage]:
    """Cut `graph` into stages 0..max(stage_of); see the module docstring for the port rules.

    Precondition: `graph` passed `pipecc.ir.graph.verify`. The stage GraphModules reference the very
    submodules and parameters of `graph.gm`, so gradients and optimizer steps reach the model.
    """
    placed = normalise_stage_of(graph, stage_of)
    num_stages = max(placed.values(), default=0) + 1
    nodes = list(graph.gm.graph.nodes)
    output_node = next(n for n in nodes if n.op == "output")

    def stage_of_node(n: fx.Node) -> int:
        return BEFORE_FIRST if n.op == "placeholder" else placed[n.meta[META_NAME]]

    # last stage that uses each value (the output node counts as stage n)
    last_use: dict[fx.Node, int] = {}
    for n in nodes:
        if n.op in ("placeholder", "get_attr", "output"):
            continue
        for inp in n.all_input_nodes:
            if inp.op != "get_attr":
                last_use[inp] = max(last_use.get(inp, BEFORE_FIRST), placed[n.meta[META_NAME]])
    for inp in output_node.all_input_nodes:
        if inp.op == "get_attr":
            raise IRError(f"the model returns the attribute {inp.target!r} directly; not supported")
        last_use[inp] = num_stages

    def live_across(cut: int) -> list[fx.Node]:
        return [n for n in nodes if n in last_use and stage_of_node(n) <= cut < last_use[n]]

    def port(n: fx.Node) -> Port:
        return Port(n.name, n.meta.get(META_VALUE), n.meta[META_NAME], stage_of_node(n))

    names = _tensor_names(graph.gm)
    nonpersistent = frozenset(id(m._buffers[b]) for m in graph.gm.modules()
                              for b in m._non_persistent_buffers_set if m._buffers.get(b) is not None)
    users_by_stage = _attribute_users(graph, placed)
    inputs = [{"name": n.name, "arg": str(n.target), "index": i}
              for i, n in enumerate(n for n in nodes if n.op == "placeholder")]
    tree = output_tree(graph)
    stages = []
    for k in range(num_stages):
        receives = [port(n) for n in live_across(k - 1)]
        sends = [port(n) for n in live_across(k)]
        members = [n for n in nodes if n.op not in ("placeholder", "get_attr", "output")
                   and placed[n.meta[META_NAME]] == k]
        gm = _build_stage_graph(graph.gm, members, live_across(k - 1), live_across(k))
        tied = sorted(names[t][0] for t in users_by_stage.get(k, ())
                      if any(t in users_by_stage.get(j, ()) for j in range(num_stages) if j != k))
        stages.append(Stage(k, gm, receives, sends, [n.meta[META_NAME] for n in members], tied,
                            names, nonpersistent, inputs, tree, dict(graph.point)))
    return stages


def _build_stage_graph(root: fx.GraphModule, members: list[fx.Node], receives: list[fx.Node],
                       sends: list[fx.Node]) -> fx.GraphModule:
    """A GraphModule over `root`'s objects: placeholders for `receives`, `members`, tuple of `sends`."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in receives:
        env[n] = g.placeholder(n.name)
        env[n].meta = dict(n.meta)
    for n in members:
        for inp in n.all_input_nodes:
            if inp.op == "get_attr" and inp not in env:  # one reference per stage, before first use
                env[inp] = g.node_copy(inp, lambda x: env[x])
        env[n] = g.node_copy(n, lambda x: env[x])
    g.output(tuple(env[n] for n in sends))
    follow(g, root)  # constants captured per mode read the stage's own train flag
    gm = fx.GraphModule(root, g, class_name="PipeccStage")
    gm.graph.lint()
    return gm


def _tensor_names(gm: fx.GraphModule) -> dict[int, tuple[str, ...]]:
    """id(parameter or buffer) -> all its qualified names in `gm`, in registration order."""
    out: dict[int, list[str]] = {}
    for name, t in gm.named_parameters(remove_duplicate=False):
        out.setdefault(id(t), []).append(name)
    for name, t in gm.named_buffers(remove_duplicate=False):
        out.setdefault(id(t), []).append(name)
    return {k: tuple(v) for k, v in out.items()}


def _attribute_users(graph: AnnotatedGraph, placed: dict[str, int]) -> dict[int, set[int]]:
    """Stage -> ids of the parameters its nodes reference (through call_module or get_attr)."""
    by_stage: dict[int, set[int]] = {s: set() for s in set(placed.values()) | {0}}
    for n in graph.gm.graph.nodes:
        if n.op == "call_module":
            ids = {id(p) for p in graph.gm.get_submodule(n.target).parameters()}
            by_stage[placed[n.meta[META_NAME]]] |= ids
        elif n.op == "get_attr":
            obj = _resolve(graph.gm, str(n.target))
            if isinstance(obj, torch.nn.Parameter):
                for user in n.users:
                    if user.op != "output":
                        by_stage[placed[user.meta[META_NAME]]].add(id(obj))
    return by_stage


def _resolve(module: torch.nn.Module, target: str) -> Any:
    obj: Any = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def output_tree(graph: AnnotatedGraph) -> Any:
    """The model's output structure as JSON: `{"port": name}`, `{"tuple": [...]}`, `{"list": [...]}`,
    `{"dict": [[key, tree], ...]}` or `{"const": value}`; a tuple or dict of its own class (a
    namedtuple, a Hugging Face ModelOutput) also names it: `"type": "module:qualname"`.

    Graphs captured by torch.export return a flat list that their pytree spec re-nests; the tree
    follows the spec, so it describes what the *model* returns.
    """
    out = next(n for n in graph.gm.graph.nodes if n.op == "output")
    value = out.args[0]
    info = getattr(graph.gm.graph._codegen, "pytree_info", None)
    if info is not None and info.out_spec is not None:
        leaves = [_Leaf(_tree(v)) for v in (value if isinstance(value, (list, tuple)) else [value])]
        return _tree(pytree.tree_unflatten(leaves, info.out_spec))
    tree = _tree(value)
    if "dict" in tree and out.meta.get(META_OUTPUT_CLASS):
        tree["type"] = out.meta[META_OUTPUT_CLASS]
    return tree


class _Leaf:
    """A finished subtree inside a structure that `pytree.tree_unflatten` rebuilt."""

    def __init__(self, tree: Any) -> None:
        self.tree = tree


def _tree(value: Any) -> Any:
    if isinstance(value, _Leaf):
        return value.tree
    if isinstance(value, fx.Node):
        return {"port": value.name}
    if isinstance(value, (tuple, list)):
        return {"tuple" if isinstance(value, tuple) else "list": [_tree(v) for v in value],
                **_type_of(value)}
    if isinstance(value, dict):
        return {"dict": [[k, _tree(v)] for k, v in value.items()], **_type_of(value)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"const": value}
    raise IRError(f"the model returns a {type(value).__name__} constant; not supported")


def _type_of(value: Any) -> dict[str, str]:
    """`{"type": "module:qualname"}` for a tuple or dict of a class of its own (a namedtuple, a
    Hugging Face ModelOutput), so the runtime returns that class (`runtime.ports.output_class`)."""
    cls = type(value)
    if cls in (tuple, list, dict) or cls.__module__ == fx.immutable_collections.__name__:
        return {}  # NOTE: fx writes the dicts and lists in node arguments as immutable ones
    return {"type": f"{cls.__module__}:{cls.__qualname__}"}


# ----------------------------------------------------------------------------- JSON form
def value_json(value: PortValue, point: dict[Any, int]) -> dict[str, Any]:
    """A port's value as JSON, in the form `pipecc.runtime.dist` reads.

    Tensors: `shape` at the example point (the compile batch size), `shape_expr` with symbolic
    dims as text, `batch_dim` the first dim that grows with the batch symbol B (or null).
    Scalars are `object` ports (sent as JSON by the distributed runtime).
    """
    if isinstance(value, TensorInfo):
        batch = [i for i, d in enumerate(value.shape)
                 if any(str(s) == "B" for s in getattr(d, "free_symbols", ()))]
        return {"kind": "tensor", "dtype": str(value.dtype).removeprefix("torch."),
                "shape": [int(d.subs(point)) if hasattr(d, "subs") else int(d) for d in value.shape],
                "shape_expr": [d if isinstance(d, int) else str(d) for d in value.shape],
                "batch_dim": batch[0] if batch else None, "requires_grad": value.requires_grad}
    if isinstance(value, ScalarInfo):
        v = value.value
        plain = v is None or isinstance(v, (bool, int, float, str))
        return {"kind": "object", "value": v if plain else str(v)}
    if isinstance(value, (tuple, list)):
        return {"kind": "tuple", "items": [value_json(v, point) for v in value]}
    return {"kind": "object", "value": None}


def port_json(port: Port, point: dict[Any, int]) -> dict[str, Any]:
    return {"name": port.name, "producer": port.producer, "stage": port.stage,
            **value_json(port.value, point)}


def ports_json(stage: Stage, num_stages: int) -> dict[str, Any]:
    """What `ports.json` holds and what `pipecc.runtime` reads: this stage's receives and sends in
    positional order plus the model's interface (its forward arguments and output tree)."""
    return {"stage": stage.index, "num_stages": num_stages,
            "receives": [port_json(p, stage.point) for p in stage.receives],
            "sends": [port_json(p, stage.point) for p in stage.sends],
            "tied": list(stage.tied), "nodes": list(stage.nodes),
            "model_inputs": stage.model_inputs, "model_output": stage.model_output}
