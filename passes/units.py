"""From the costed graph to the partitioner's numbers: units, their costs and lifetimes.

A *unit* is what the partitioner places: one compute node, or (coarse mode) one block —
the consecutive nodes of a module such as `blocks.3`. Parameter nodes (`get_attr`) are folded
into their first user's unit, wherever the graph lists them; the model's inputs go to the first
unit. Costs are the cost model's sympy expressions evaluated at the micro-batch size
(B = batch / microbatches, the other symbols at their example values), all nodes at once
through one lambdified function.

Precondition: `pipecc.cost.annotate` has run. No structural change to the graph.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import sympy
import torch
import torch.fx as fx

from pipecc.cost_saved import META_KEPT
from pipecc.frontend.loss_memory import LOSS_STASH_META
from pipecc.ir.graph import (META_COST, META_KIND, META_NAME, META_OP, META_VALUE, AnnotatedGraph, TensorInfo,
                             tensors_in)

FIELDS = ("forward_flops", "backward_flops", "forward_flops_matmul", "backward_flops_matmul",
          "output_bytes", "stash_bytes", "bytes_moved",
          # the weight-gradient part of the backward (zero-bubble W; the rest is I)
          "backward_weight_flops", "backward_weight_flops_matmul")


@dataclass
class Units:
    """Per-unit numbers (arrays of length n) and the node names of each unit."""

    names: list[list[str]]          # human names of the nodes in each unit, in graph order
    kinds: list[set[str]]           # op kinds inside each unit
    values: dict[str, np.ndarray]   # FIELDS -> per unit at the micro-batch size
    param_bytes: np.ndarray
    last_use: list[int]             # index of the last unit using the unit's output (n: graph output)
    splittable: list[bool] = field(default_factory=list)
    # [unit] the largest backward working set of its nodes: a node's output gradient plus its
    # activation inputs' gradients (bytes, `UnitBuilder.at`); [unit] bytes of its escaping outputs
    # no backward keeps (a stage holds its sent outputs until its backward: `pipecc.runtime.stage_runner`)
    work_bytes: np.ndarray | None = None
    unkept_out_bytes: np.ndarray | None = None

    @property
    def n(self) -> int:
        return len(self.names)

    def stage_bounds(self, stages: Sequence) -> list[int]:
        """Unit index bounds of `stages` (a plan's `StagePlan`s, whose nodes are whole units, in
        order): ValueError when they are not runs of units covering every unit."""
        unit_of = {name: u for u, names in enumerate(self.names) for name in names}
        bounds = [0]
        for s in stages:
            us = sorted({unit_of[n] for n in s.nodes if n in unit_of})
            if not us or us[0] != bounds[-1] or us[-1] - us[0] + 1 != len(us):
                raise ValueError(f"stage {s.index}'s nodes are not a run of units after unit {bounds[-1]}")
            bounds.append(us[-1] + 1)
        if bounds[-1] != self.n:
            raise ValueError(f"the plan's stages cover {bounds[-1]} of {self.n} units")
        return bounds


# concatenations, whose backward gives each input a view of one gradient (`_w_keeps`)
_JOINS = frozenset({torch.cat, torch.concat, torch.concatenate, torch.stack, torch.ops.aten.cat.default,
                    torch.ops.aten.stack.default})
_ADDS = frozenset({operator.add, operator.iadd, torch.add, torch.ops.aten.add.Tensor})
# {the other symbols' point: {expression: expression at that point}}: `e.subs(point)` is a pure
# function of the two (sympy expressions are immutable and hashed by value)
_SUBSTITUTED: dict[frozenset, dict] = {}
_SUBSTITUTED_MAX = 50_000


def _passes_gradient(node: fx.Node, source: fx.Node) -> bool:
    """True when ``node``'s backward hands ``source`` its own output gradient or a view of it, no
    new tensor: a concatenation (each input's gradient is a slice of the joined one), an addition
    (`a + b`, a residual) whose operand has the sum's shape and dtype (AddBackward passes the
    gradient through; a broadcast operand gets a reduced copy, a scaled one a product)."""
    if node.target in _JOINS:
        return True
    if node.target not in _ADDS or node.kwargs.get("alpha", 1) != 1:
        return False
    out, operand = node.meta.get(META_VALUE), source.meta.get(META_VALUE)
    return isinstance(out, TensorInfo) and isinstance(operand, TensorInfo) and \
        tuple(out.shape) == tuple(operand.shape) and out.dtype == operand.dtype


def _evaluator(graph: AnnotatedGraph, nodes: list[fx.Node]):
    """A function B -> {field: per-node numpy array} (other symbols at their example values)."""
    b_sym = graph.symbols.get("B")
    fixed = {s: v for s, v in graph.point.items() if s != b_sym}
    arg = b_sym if b_sym is not None else sympy.Symbol("B")
    # NOTE: repeated blocks share their cost expressions, so lambdify only the distinct ones
    # (a few dozen for a 20,000-node transformer) and index into them.
    distinct: dict = {}
    # NOTE: subs once per distinct expression, not once per node; and once per process for
    # the same point: the layer-split search builds units for graph after graph that share
    # almost every expression (`_SUBSTITUTED`)
    substituted = _SUBSTITUTED.setdefault(frozenset(fixed.items()), {})
    if len(substituted) > _SUBSTITUTED_MAX:
        substituted.clear()
    index = {f: np.empty(len(nodes), dtype=np.int64) for f in FIELDS}
    for f in FIELDS:
        for i, node in enumerate(nodes):
            e = getattr(node.meta[META_COST], f)
            if isinstance(e, sympy.Expr) and fixed:
                if e not in substituted:
                    substituted[e] = e.subs(fixed)
                e = substituted[e]
            index[f][i] = distinct.setdefault(e, len(distinct))
    exprs = list(distinct)
    fn = sympy.lambdify([arg], exprs, modules="numpy")

    def at(batch: float) -> dict[str, np.ndarray]:
        values = np.array([float(v) for v in fn(batch)]) if exprs else np.zeros(0)
        return {f: values[index[f]] for f in FIELDS}
    return at


def _one_tensor_cuts(graph: AnnotatedGraph, groups: list[list[fx.Node]],
                     unit_of: dict[fx.Node, int]) -> np.ndarray:
    """[boundary 0..n] True where exactly one float32 tensor crosses the cut before unit s
    (what an FPGA stage boundary can carry). A value crossing s is a node of an earlier unit,
    or a model input, with a user at or after unit s (the graph output counts as unit n)."""
    n = len(groups)
    count = np.zeros(n + 2, dtype=np.int64)
    for node in graph.gm.graph.nodes:
        if node.op in ("output", "get_attr") or not node.users:
            continue
        first = unit_of.get(node, 0) + 1   # model inputs (not in a unit) enter at stage 0
        last = max(unit_of.get(u, n) for u in node.users)
        if last < first:
            continue
        value = node.meta.get(META_VALUE)
        ok = isinstance(value, TensorInfo) and value.dtype == torch.float32
        count[first] += 1 if ok else 2   # NOTE: anything else must never pass as "one tensor"
        count[last + 1] -= 1 if ok else 2
    return np.cumsum(count)[: n + 1] == 1


def _block_key(name: str, depth: int) -> str:
    parts = name.split(".")
    # module paths like blocks.3.attn.proj: a block is the first component and its index
    if len(parts) > 1 and parts[1].isdigit():
        return ".".join(parts[:2])
    return parts[0] if depth else name


def _fold_parameters(nodes: list[fx.Node], groups: list[list[fx.Node]]) -> list[list[fx.Node]]:
    """Put every parameter node (`get_attr`) into the unit of its first user, just before it.

    NOTE: where the graph lists a parameter says nothing about where it is used: torch.fx
    writes a `get_attr` right before its first use, but torch.export (`ExportedProgram.module()`)
    and the ONNX import list every parameter at the top of the graph. Folding by position would
    give the first unit (stage 0) every weight of an exported model. A weight read by several
    units (a tied embedding) is charged once, to its first user's unit; the stages cut later
    each reference it (`backends.torch.stages`). A parameter nothing reads joins the next unit.
    """
    unit_of = {n: i for i, g in enumerate(groups) for n in g}
    position = {n: i for i, n in enumerate(nodes)}
    before: dict[fx.Node, list[fx.Node]] = {}   # first user -> the parameters folded before it
    unused: list[fx.Node] = []
    for node in nodes:
        if node.op != "get_attr":
            if unused:
                before.setdefault(node, []).extend(unused)
                unused = []
            continue
        users = [u for u in node.users if u in unit_of]
        if users:
            before.setdefault(min(users, key=position.__getitem__), []).append(node)
        else:
            unused.append(node)
    out = [[p for n in g for p in before.get(n, []) + [n]] for g in groups]
    if unused and out:
        out[-1].extend(unused)
    return out


def _join_in_place(groups: list[list[fx.Node]]) -> list[list[fx.Node]]:
    """Groups with every in-place op (`mul_`, `add_`: its op name ends in "_") in one unit with
    the producer of the tensor it writes, and everything in between: a cut between them would
    send a copy, and the write would miss the tensor (an EMA buffer's `ema.mul_(0.9).add_(..)`
    would update a received copy, not the buffer)."""
    where = {n: i for i, g in enumerate(groups) for n in g}
    start = list(range(len(groups)))  # start[i]: the first group group i must join
    for i, g in enumerate(groups):
        for n in g:
            op = str(n.meta.get(META_OP, ""))
            target = n.args[0] if n.args else None
            if op.endswith("_") and not op.startswith("_") and isinstance(target, fx.Node) \
                    and target in where and where[target] < i:
                start[i] = min(start[i], where[target])
    out: list[list[fx.Node]] = []
    first: list[int] = []  # the first original group of each out group
    for i, g in enumerate(groups):
        out.append(list(g))
        first.append(i)
        while len(out) > 1 and first[-1] > start[i]:  # join back to the written tensor's unit
            tail = out.pop()
            first.pop()
            out[-1].extend(tail)
    return out


class UnitBuilder:
    """Groups nodes into units once; evaluates unit costs at any micro-batch size."""

    def __init__(self, graph: AnnotatedGraph, coarse: bool = False,
                 splittable: Sequence[str] = ()) -> None:
        self.graph = graph
        nodes = [n for n in graph.gm.graph.nodes if n.op not in ("placeholder", "output")]
        groups: list[list[fx.Node]] = []
        for node in nodes:
            if node.op == "get_attr":
                continue
            key = _block_key(node.meta[META_NAME], 1) if coarse else None
            if coarse and groups and _block_key(groups[-1][-1].meta[META_NAME], 1) == key:
                groups[-1].append(node)
            else:
                groups.append([node])
        groups = _fold_parameters(nodes, _join_in_place(groups))
        self.groups = groups
        self.order = [n for g in groups for n in g]
        unit_of = {n: i for i, g in enumerate(groups) for n in g}
        n_units = len(groups)
        last = list(range(n_units))
        for node in graph.gm.graph.nodes:
            for src in node.all_input_nodes:
                # a weight is no message: each stage reading it holds it (a tied weight)
                if src in unit_of and src.op != "get_attr":
                    u = unit_of[src]
                    last[u] = max(last[u], n_units if node.op == "output" else unit_of.get(node, u))
        self.last_use = last
        # bytes crossing a cut are the outputs of nodes used by a later unit; a unit's
        # "output" is the sum of its nodes' outputs that escape it
        self.escaping = [[n for n in g if any(unit_of.get(u, n_units) != i for u in n.users)]
                         for i, g in enumerate(groups)]
        self._unit_of = unit_of
        self._eval = _evaluator(graph, self.order)
        self._index = {n: i for i, n in enumerate(self.order)}
        split_set = set(splittable)
        self.splittable = [any(n.meta[META_NAME] in split_set for n in g) and len(g) <= 3
                           for g in groups]
        self.param_bytes = np.array([sum(n.meta[META_COST].param_bytes for n in g) for g in groups],
                                    dtype=float)

    def weight_output_bytes(self, microbatch: float) -> np.ndarray:
        """[unit] output bytes of its nodes that read a parameter, at ``microbatch`` samples: the
        gradients a zero-bubble I keeps for its W (`pipecc.techniques.zero_bubble.runtime`: W starts where each
        weight's branch joins the input's path, from the gradient of that node's output)."""
        pos, unit, _, _ = self._sums
        keeps = self._w_keeps
        out = self._eval(microbatch)["output_bytes"]
        kept = np.where(keeps >= 0, out[np.maximum(keeps, 0)], 0.0)
        return _unit_sums(kept[pos], unit, len(self.groups))

    @functools.cached_property
    def _w_keeps(self) -> np.ndarray:
        """[node in unit order] the position whose output's gradient a zero-bubble W keeps for the
        node, -1 for none: a weight-bearing node's own output, or, when its only reader is a
        concatenation, the whole joined tensor's (the backward of `cat` and `stack` hands each
        input a view of one gradient, so a W that keeps one view keeps all of it: U-Net's
        up-convolutions), counted once per concatenation."""
        keeps = np.full(len(self.order), -1, dtype=np.int64)
        joined: set[fx.Node] = set()
        for i, node in enumerate(self.order):
            if not self._reads_weight[i]:
                continue
            users = list(node.users)
            if len(users) == 1 and users[0].target in _JOINS and users[0] in self._index:
                if users[0] in joined:
                    continue
                joined.add(users[0])
                keeps[i] = self._index[users[0]]
            else:
                keeps[i] = i
        return keeps

    @functools.cached_property
    def _reads_weight(self) -> np.ndarray:
        """[node in unit order] 1.0 where the node reads a parameter (a weight-bearing layer)."""
        def reads(n: fx.Node) -> bool:
            if n.op == "get_attr":
                return False
            if n.op == "call_module":
                return any(p.requires_grad for p in self.graph.gm.get_submodule(str(n.target)).parameters())
            return any(a.op == "get_attr" and any(t.requires_grad for t in tensors_in(a.meta.get(META_VALUE)))
                       for a in n.all_input_nodes)
        return np.array([1.0 if reads(n) else 0.0 for n in self.order])

    def input_bytes(self, n: int) -> float:
        """The model inputs' bytes for ``n`` samples: what the rank of stage 0 holds for a whole
        step (the runtime moves the step's inputs to its device and splits them into views,
        `runtime.engine._split_inputs`)."""
        b_sym = self.graph.symbols.get("B")
        total = 0.0
        for node in self.graph.gm.graph.nodes:
            cost = node.meta.get(META_COST) if node.op == "placeholder" else None
            e = getattr(cost, "output_bytes", 0)
            if isinstance(e, sympy.Expr):
                e = e.subs({**self.graph.point, **({b_sym: n} if b_sym is not None else {})})
            total += float(e)
        return total

    @functools.cached_property
    def one_tensor_cut(self) -> np.ndarray:
        """[boundary 0..n] True where exactly one float32 tensor crosses (only FPGA plans ask)."""
        return _one_tensor_cuts(self.graph, self.groups, self._unit_of)

    @functools.cached_property
    def _sums(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(node positions in unit order, their units; escaping nodes' positions, their units):
        what `at` sums per unit, in the order the nodes are listed (the same float sums)."""
        pos = np.array([self._index[n] for g in self.groups for n in g], dtype=np.int64)
        unit = np.repeat(np.arange(len(self.groups)), [len(g) for g in self.groups])
        esc = np.array([self._index[n] for e in self.escaping for n in e], dtype=np.int64)
        esc_unit = np.repeat(np.arange(len(self.groups)), [len(e) for e in self.escaping])
        return pos, unit, esc, esc_unit

    @functools.cached_property
    def _memory_index(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(gradient edges: source and destination positions, a node's activation inputs that take a
        gradient; [node] whether it takes one; escaping nodes whose output no backward keeps:
        positions, units), for `at`."""
        src, dst = [], []
        for i, node in enumerate(self.order):
            value = node.meta.get(META_VALUE)
            if not any(t.requires_grad for t in tensors_in(value)):
                continue
            for a in node.all_input_nodes:
                if a in self._index and a.op != "get_attr" and not _passes_gradient(node, a) and \
                        any(t.requires_grad for t in tensors_in(a.meta.get(META_VALUE))):
                    src.append(self._index[a])
                    dst.append(i)
        unkept = [(self._index[n], u) for u, e in enumerate(self.escaping) for n in e if not n.meta.get(META_KEPT)]
        grads = np.array([any(t.requires_grad for t in tensors_in(nd.meta.get(META_VALUE))) for nd in self.order],
                         dtype=bool)
        return (np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64), grads,
                np.array([p for p, _ in unkept], dtype=np.int64), np.array([u for _, u in unkept], dtype=np.int64))

    def _memory(self, out: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        """([unit] work_bytes, [unit] unkept_out_bytes) from the nodes' output bytes (`Units`)."""
        src, dst, grads, esc, esc_unit = self._memory_index
        pos, unit, _, _ = self._sums
        per = np.where(grads, out, 0.0)
        np.add.at(per, dst, out[src])
        work = np.zeros(n)
        np.maximum.at(work, unit, per[pos])
        return work, _unit_sums(out[esc], esc_unit, n)

    @functools.cached_property
    def _labels(self) -> tuple[list[list[str]], list[set[str]]]:
        return ([[n.meta[META_NAME] for n in g] for g in self.groups],
                [{n.meta[META_KIND] for n in g} for g in self.groups])

    def at(self, microbatch: float) -> Units:
        per_node = self._eval(microbatch)
        pos, unit, esc, esc_unit = self._sums
        n = len(self.groups)
        values: dict[str, np.ndarray] = {}
        for f in FIELDS:
            arr = per_node[f]
            if f == "output_bytes":
                values[f] = _unit_sums(arr[esc], esc_unit, n)
            else:
                values[f] = _unit_sums(arr[pos], unit, n)
        loss = float(self.graph.gm.meta.get(LOSS_STASH_META, 0.0)) * microbatch
        if loss and n:  # what the model file's loss keeps, on the last stage (frontend.loss_memory)
            values["stash_bytes"][-1] += loss
        names, kinds = self._labels  # NOTE: shared by every Units of this builder; nothing changes them
        work, unkept = self._memory(per_node["output_bytes"], n)
        return Units(names=list(names), kinds=list(kinds),
                     values=values, param_bytes=self.param_bytes, last_use=self.last_use,
                     splittable=self.splittable, work_bytes=work, unkept_out_bytes=unkept)


def _unit_sums(values: np.ndarray, unit: np.ndarray, n: int) -> np.ndarray:
    """[unit] the sum of `values` (listed unit by unit) per unit, left to right as Python's
    `sum` adds them (np.add.at is unbuffered and in order: the same floats, bit for bit)."""
    out = np.zeros(n)
    np.add.at(out, unit, values)
    return out
