"""A pipecc plan run by torch.distributed.pipelining (PyTorch's own pipeline runtime).

Two routes, both from a plan and the (possibly rewritten) annotated graph `driver.plan` returns:

  1. **Split markers** — `split_spec(plan, graph)` gives `{module path: SplitPoint}` for
     `pipeline(model, mb_args, split_spec=...)`; `split_policy(plan, graph)` gives a function for
     `pipeline(model, mb_args, split_policy=...)` that inserts `pipe_split` nodes into the graph
     torch traced (torch.export: aten ops, its own node names) without touching the model.
     `torch_pipe(model, mb_args, plan, graph)` does the latter and checks the stage count.
     Torch then cuts, traces and builds the stages itself (`Pipe.build_stage`).
  2. **pipecc's stages** — `pipeline_stages(plan, graph, rank, device)` wraps the stage
     modules `cut_stages` builds (fx GraphModules over the model's own parameters) in
     `PipelineStage`, so `ScheduleGPipe`/`Schedule1F1B`/`ScheduleInterleaved1F1B`
     (`torch_schedule`) run exactly pipecc's split, split layers included.

Zero-bubble: pipecc's `zb-h1` is the compute order of torch's `ScheduleInterleavedZeroBubble`
with one stage per rank (torch's ZB1P at v = 1: warm-up p-1-r forwards, then F, I and, after
rank r's first r backwards, the oldest W; the rest of the W's at the end). `torch_schedule`
hands the stages to that class and checks, before it returns, that torch's `pipeline_order`
(F, I, W per rank, bubbles left out) is pipecc's `zb_h1` action for action; a torch whose order
differs is refused (`InteropError`), so a comparison never runs a different schedule. Torch runs
I and W with its own split (`pipelining._backward`), the same one pipecc's runtime uses.

Mapping cuts to markers (route 1). Torch's tracer and pipecc's name nodes differently, but both
record the module each op runs in (`nn_module_stack`). Walking pipecc's tensor-producing nodes in
program order, cut k lies before the first node of stage k+1. It is *on a module boundary* when
that node is the first node of some module M (marker: M, `SplitPoint.BEGINNING`; the outermost
such M, e.g. `blocks.2` rather than `blocks.2.ln_1`) or the previous node is the last node of
some module M (M, `SplitPoint.END`; GPT's residual `add` after `blocks.2.attn` gets
`blocks.2.attn` END). A cut that is neither — between two plain functions, e.g. between
`scaled_dot_product_attention` and the `transpose` after it inside GPT's attention — or a plan
whose stages are not a prefix split of the program order, or a plan that splits a layer
(`plan.split_layers`), cannot be expressed in torch's markers: `cut_points` raises
`InteropError` naming the cut and its nodes. Route 2 runs such plans.

Restrictions of route 2 (PipelineStage passes tensors, positionally, one stage to the next):

  * every value crossing a cut must be a tensor. Python ints, floats and bools (`B = x.size(0)`
    computed before a cut, used after it) are rewritten into the stage graphs to travel as 0-dim
    tensors (`torch.tensor(v)` before sending, `.item()` after receiving); any other Python value
    is refused (pipecc's own runtime sends those as JSON);
  * stage 0 must receive exactly the model's inputs, in order (`schedule.step(*inputs)`);
    model inputs that later stages use are relayed by stage 0 like any other value (pipecc's
    relay convention), which PipelineStage carries as an ordinary activation (no gradient for
    integer tensors);
  * no tied weight across stages on different ranks (PipelineStage does not all-reduce it);
  * equal micro-batches (`plan.batch_size % microbatches == 0`): the stages are built in
    PipelineStage's static mode from pipecc's shapes (see `pipeline_stages`).

Route 1 inherits torch's own restrictions instead: a model input used after the first cut is
not relayed by torch's tracer stages (they fail at the first step), so `cut_points` refuses it;
route 2 relays it through stage 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch.distributed.pipelining import SplitPoint

from pipecc.backends.torch.inplace import ClonesInputs, written_inputs
from pipecc.backends.torch.stages import Stage, _is_metadata, cut_stages, normalise_stage_of
from pipecc.errors import PipeccError
from pipecc.ir.graph import META_NAME, META_VALUE, AnnotatedGraph, ScalarInfo, TensorInfo, tensors_in
from pipecc.ir.plan import Plan

__all__ = ["Cut", "InteropError", "cut_points", "split_spec", "split_policy", "torch_pipe",
           "stage_modules", "pipeline_stages", "torch_schedule"]


class InteropError(PipeccError):
    """A plan (or one of its cuts) that torch.distributed.pipelining cannot run as asked."""


@dataclass(frozen=True)
class Cut:
    """Cut `index` (between stage index and index + 1) as a torch split marker."""

    index: int
    module: str
    point: SplitPoint
    first: str   # pipecc's name of the first node after the cut
    last: str    # and of the last node before it


# ----------------------------------------------------------------------------- route 1

def _clean(path: str) -> str:
    return path.replace("L['self'].", "").replace("L__self___", "").replace("L__self__", "")


def module_stack(node: fx.Node) -> tuple[str, ...]:
    """The module paths a node runs in, outermost first, the root ("") left out.

    Works on pipecc's fx graphs (a `call_module` node's own module included) and on torch's
    exported graphs alike: both write `node.meta["nn_module_stack"]`.
    """
    paths = [_clean(str(v[0])) for v in (node.meta.get("nn_module_stack") or {}).values()]
    if node.op == "call_module" and (not paths or paths[-1] != str(node.target)):
        paths.append(str(node.target))
    return tuple(p for p in paths if p)


def _program(graph: AnnotatedGraph, placed: dict[str, int]) -> list[tuple[fx.Node, int]]:
    """pipecc's nodes that torch's tracer also emits as ops, with their stages, in program order.

    Left out: parameters (`get_attr`), metadata (`x.device`) and Python scalars (`x.size(1)`),
    which torch.export folds into shapes; where pipecc placed those does not move torch's cut.
    """
    out = []
    for node in graph.compute_nodes():
        if node.op == "get_attr" or _is_metadata(node):
            continue
        if not any(True for _ in tensors_in(node.meta.get(META_VALUE))):
            continue
        out.append((node, placed[node.meta[META_NAME]]))
    return out


def cut_points(plan: Plan, graph: AnnotatedGraph) -> list[Cut]:
    """Each cut of `plan` as a module boundary (see the module docstring), or `InteropError`."""
    _plain(plan)
    split = [s for s in plan.split_layers if len(s.shards) > 1]
    if split:
        raise InteropError(f"the plan splits layer {split[0].node!r} into {split[0].parts} parts; torch's "
                           "split markers cut between modules only: use pipeline_stages (route 2) or plan "
                           "with split_layers=False")
    placed = normalise_stage_of(graph, plan.stage_of())
    program = _program(graph, placed)
    names = [n.meta[META_NAME] for n, _ in program]
    for i in range(1, len(program)):
        if program[i][1] < program[i - 1][1]:
            raise InteropError(f"{names[i - 1]!r} (stage {program[i - 1][1]}) runs before {names[i]!r} "
                               f"(stage {program[i][1]}): torch cuts the traced program at one point per "
                               "stage, so this placement has no split markers; use pipeline_stages")
    stacks = [module_stack(n) for n, _ in program]
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, stack in enumerate(stacks):
        for m in stack:
            first.setdefault(m, i)
            last[m] = i
    called = {}
    for n, _ in program:  # a module object called twice would get the marker twice
        if n.op == "call_module":
            called[str(n.target)] = called.get(str(n.target), 0) + 1
    contiguous = {m for m in first if called.get(m, 1) == 1
                  and all(m in stacks[i] for i in range(first[m], last[m] + 1))}
    cuts: list[Cut] = []
    used: set[str] = set()
    num_stages = len(plan.stages)
    for k in range(num_stages - 1):
        i = next((j for j, (_, s) in enumerate(program) if s > k), None)
        if i is None or i == 0 or program[i][1] != k + 1 or program[i - 1][1] != k:
            raise InteropError(f"stage {k if i == 0 else k + 1} holds no tensor computation torch's tracer "
                               f"would see (plan stages: {[len(s.nodes) for s in plan.stages]} nodes); "
                               "torch's split markers cannot make an empty or scalar-only stage")
        options = [(m, SplitPoint.BEGINNING) for m in stacks[i] if first[m] == i] + \
                  [(m, SplitPoint.END) for m in stacks[i - 1] if last[m] == i - 1]
        options = [(m, p) for m, p in options if m in contiguous and m not in used]
        if not options:
            raise InteropError(f"cut {k} falls between {names[i - 1]!r} and {names[i]!r}, inside module "
                               f"{stacks[i][-1] if stacks[i] else '(the root)'!r} and on no module boundary: "
                               "torch's split markers cannot express it; use pipeline_stages")
        module, point = options[0]
        used.add(module)
        cuts.append(Cut(k, module, point, names[i], names[i - 1]))
    stage = {n: s for n, s in program}
    for node in graph.gm.graph.nodes:
        late = [u for u in node.users if stage.get(u, 0) > 0] if node.op == "placeholder" else []
        if late:
            raise InteropError(f"model input {node.target!r} is used on stage {stage[late[0]]} by "
                               f"{late[0].meta[META_NAME]!r}: torch's traced stages take model inputs on stage 0 "
                               "only (PipelineStage fails with 'expected non-root _RecvInfo'); use "
                               "pipeline_stages, whose stage 0 relays it")
    return cuts


def split_spec(plan: Plan, graph: AnnotatedGraph) -> dict[str, SplitPoint]:
    """`{module path: SplitPoint}` for `torch.distributed.pipelining.pipeline(split_spec=...)`.

    NOTE: torch's `pipeline` applies a split_spec by replacing the named modules' `forward` on
    the model itself (it stays wrapped); `split_policy` leaves the model alone.
    """
    return {c.module: c.point for c in cut_points(plan, graph)}


def split_policy(plan: Plan, graph: AnnotatedGraph) -> Callable[[fx.GraphModule], fx.GraphModule]:
    """A `split_policy` for `pipeline(...)`: inserts `pipe_split` nodes at pipecc's cuts in the
    GraphModule torch traced, locating each marker's module by the nodes' `nn_module_stack`."""
    from torch.distributed.pipelining._IR import aten_pipe_split_alias

    cuts = cut_points(plan, graph)

    def policy(gm: fx.GraphModule) -> fx.GraphModule:
        ops = [n for n in gm.graph.nodes if n.op in ("call_function", "call_module", "call_method")]
        for cut in cuts:
            inside = [n for n in ops if cut.module in module_stack(n)]
            if not inside:
                raise InteropError(f"cut {cut.index}: torch's traced graph has no op in module {cut.module!r}")
            if cut.point is SplitPoint.BEGINNING:
                with gm.graph.inserting_before(inside[0]):
                    gm.graph.call_function(aten_pipe_split_alias, ())
            else:
                with gm.graph.inserting_after(inside[-1]):
                    gm.graph.call_function(aten_pipe_split_alias, ())
        gm.graph.lint()
        gm.recompile()
        return gm

    return policy


def torch_pipe(model: torch.nn.Module, mb_args: tuple, plan: Plan, graph: AnnotatedGraph) -> Any:
    """`torch.distributed.pipelining.pipeline` cut at pipecc's split (route 1); a `Pipe`."""
    from torch.distributed.pipelining import pipeline

    pipe = pipeline(model, tuple(mb_args), split_policy=split_policy(plan, graph))
    if pipe.num_stages != len(plan.stages):
        raise InteropError(f"torch made {pipe.num_stages} stages of pipecc's {len(plan.stages)}")
    return pipe


# ----------------------------------------------------------------------------- route 2

def _model_output(stage: Stage) -> None:
    """Make the last stage return what the model returns (not the tuple of its sends), as
    PipelineStage hands the last stage's output to the loss function as is."""
    gm = stage.gm
    output = next(n for n in gm.graph.nodes if n.op == "output")
    by_name = {p.name: v for p, v in zip(stage.sends, output.args[0])}

    def build(tree: dict[str, Any]) -> Any:
        if "port" in tree:
            return by_name[tree["port"]]
        if "tuple" in tree:
            return tuple(build(t) for t in tree["tuple"])
        if "list" in tree:
            return [build(t) for t in tree["list"]]
        if "dict" in tree:
            return {k: build(t) for k, t in tree["dict"]}
        return tree["const"]

    output.args = (build(stage.model_output),)
    gm.graph.lint()
    gm.recompile()


def _scalar_dtype(value: Any) -> torch.dtype | None:
    """The dtype a Python scalar port travels as (a 0-dim tensor), or None if it cannot."""
    v = value.value if isinstance(value, ScalarInfo) else None
    if isinstance(v, bool):
        return torch.bool
    if isinstance(v, int) or getattr(v, "is_integer", False):  # int, or a symbolic size (B)
        return torch.int64
    if isinstance(v, float):
        return torch.float64
    return None


def _wire_ready(stage: Stage, last: bool) -> None:
    """Python int/float/bool ports cross as 0-dim tensors: the sender wraps (`torch.tensor`),
    the receiver unwraps (`.item()`); PipelineStage sends tensors only. Tensor sends are made
    contiguous, as pipecc's own runtime does before sending (a no-op when they are)."""
    g = stage.gm.graph
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    for node, port in zip(placeholders, stage.receives):
        if stage.index > 0 and _scalar_dtype(port.value) is not None:
            with g.inserting_after(placeholders[-1]):
                item = g.call_method("item", (node,))
            node.replace_all_uses_with(item, delete_user_cb=lambda user: user is not item)
    output = next(n for n in g.nodes if n.op == "output")
    if not last:
        values = list(output.args[0])
        for i, port in enumerate(stage.sends):
            dtype = _scalar_dtype(port.value)
            with g.inserting_before(output):
                if dtype is not None:
                    values[i] = g.call_function(torch.tensor, (values[i],), {"dtype": dtype})
                elif isinstance(port.value, TensorInfo):  # the receiver's buffer is contiguous
                    values[i] = g.call_method("contiguous", (values[i],))
        output.args = (tuple(values),)
    g.lint()
    stage.gm.recompile()


def _check_stages(stages: Sequence[Stage], graph: AnnotatedGraph, world: int) -> None:
    inputs = [n.name for n in graph.gm.graph.nodes if n.op == "placeholder"]
    if [p.name for p in stages[0].receives] != inputs:
        raise InteropError(f"stage 0 receives {[p.name for p in stages[0].receives]}, not the model's inputs "
                           f"{inputs}: PipelineStage feeds stage 0 the inputs of schedule.step(*inputs)")
    for stage in stages[1:]:
        for port in stage.receives:
            if not isinstance(port.value, TensorInfo) and _scalar_dtype(port.value) is None:
                raise InteropError(f"stage {stage.index} receives {port.name!r} ({port.producer}), a "
                                   f"{_describe(port.value)}: PipelineStage sends tensors only (ints, floats "
                                   "and bools go as 0-dim tensors); pipecc's own runtime sends it as JSON")
    if world > 1:
        for stage in stages:
            if stage.tied:
                raise InteropError(f"stage {stage.index} shares {stage.tied} with another stage (a tied "
                                   "weight); PipelineStage does not all-reduce its gradient across ranks")


def _describe(value: Any) -> str:
    if isinstance(value, ScalarInfo):
        return f"Python {type(value.value).__name__} ({value.value!r})"
    return f"{type(value).__name__} value"


def _plain(plan: Plan) -> None:
    """torch.distributed.pipelining runs one pipeline: a plan with replica groups (PP x DP) has no
    equivalent there without a DDP/FSDP wrapper per stage, which this module does not build."""
    if getattr(plan, "replicas", 1) > 1:
        raise InteropError(f"the plan runs every stage on {plan.replicas} replicas (PP x DP); torch's "
                           "pipelining schedules run one pipeline: plan with replicas=1 (--replicas 1) "
                           "to compare, or run this plan with `pipecc run`")


def stage_modules(plan: Plan, graph: AnnotatedGraph, world: int) -> list[Stage]:
    """`cut_stages` for the plan, checked for PipelineStage (module docstring), the last stage
    returning the model's output. Needs no process group."""
    _plain(plan)
    stages = cut_stages(graph, plan.stage_of())
    if len(stages) != len(plan.stages):
        raise InteropError(f"the plan lists {len(plan.stages)} stages but the graph cuts into {len(stages)}")
    if len(stages) % world:
        raise InteropError(f"{len(stages)} stages do not divide over {world} ranks")
    _check_stages(stages, graph, world)
    for stage in stages:
        _wire_ready(stage, last=stage is stages[-1])
    _model_output(stages[-1])
    return stages


def _example(value: Any, point: dict[Any, int]) -> torch.Tensor:
    """A tensor with a port's metadata at `point` (its values are never read)."""
    if isinstance(value, TensorInfo):
        shape = [int(d.subs(point)) if hasattr(d, "subs") else int(d) for d in value.shape]
        grad = value.requires_grad and value.dtype.is_floating_point
        return torch.zeros(shape, dtype=value.dtype).requires_grad_(grad)
    return torch.zeros((), dtype=_scalar_dtype(value))


def pipeline_stages(plan: Plan, graph: AnnotatedGraph, rank: int, device: torch.device | str, *,
                    world: int | None = None, group: Any = None, microbatches: int | None = None) -> list[Any]:
    """pipecc's stage modules for `rank`, wrapped in `torch.distributed.pipelining.PipelineStage`.

    Rank r holds stages r, r + world, ... (the plan's `device = index % world`); `world`
    defaults to the process group's size. Each stage's forward takes what the previous stage
    returns, positionally (pipecc's relay convention); the last returns the model's output.
    The modules share the model's parameters (as `cut_stages` builds them). Raises
    `InteropError` for the restrictions in the module docstring.

    Every stage gets its input and output metadata from pipecc's shapes at the micro-batch
    size (`plan.batch_size / microbatches`, default the plan's count; it must divide), so
    PipelineStage runs in its *static* mode. NOTE: its dynamic mode would infer shapes by running
    forward on uninitialised tensors, and a scalar port (`x.size(0)` as a 0-dim tensor) read there
    with `.item()` would make shapes of garbage.
    """
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    if world is None:
        world = dist.get_world_size(group) if dist.is_initialized() else len(plan.devices)
    m = microbatches or plan.microbatches
    if plan.batch_size % m:
        raise InteropError(f"a batch of {plan.batch_size} does not split into {m} equal micro-batches; "
                           "PipelineStage allocates every micro-batch's buffers alike")
    point = dict(graph.point)
    if "B" in graph.symbols:
        point[graph.symbols["B"]] = plan.batch_size // m
    stages = stage_modules(plan, graph, world)
    out = []
    for s in stages:
        if s.index % world != rank:
            continue
        args = tuple(_example(p.value, point) for p in s.receives)
        outs = tuple(_example(p.value, point) for p in s.sends)
        written = written_inputs(s.gm)  # a received tensor it writes in place: a copy, as stage.py does
        module = ClonesInputs(s.gm, written) if written else s.gm
        out.append(PipelineStage(module, s.index, len(stages), torch.device(device), input_args=args,
                                 output_args=outs, group=group))
    return out


def torch_schedule(plan: Plan, stages: Sequence[Any], loss_fn: Callable, *,
                   microbatches: int | None = None, schedule: str | None = None,
                   reduction: Any = None) -> Any:
    """PyTorch's schedule named by the plan (gpipe, 1f1b, interleaved, zb-h1) over this rank's
    stages; zb-h1 is checked against torch's order (module docstring).

    Torch divides every rank's micro-batch gradients by their count (``scale_grads``): right for
    a mean loss only. ``reduction`` (a ``pipecc.runtime.loss_reduction.LossReduction`` or its
    kind, "mean", "sum" or "mixed"; default ``loss_fn.reduction`` where a pipecc loader set it)
    sets it on every rank: a sum is not divided, a loss that mixes samples is refused
    (``InteropError``) when the batch is split. Unknown, the loss is taken for a mean and the
    last stage's rank checks that at its first micro-batch (``analyse``): anything else raises
    ``InteropError`` there, naming the ``reduction`` to pass. A mean its targets weigh
    (cross_entropy's ignore_index, class weights) torch weighs per micro-batch alike: a step
    whose targets make them unequal raises ``InteropError`` at its last micro-batch (pipecc's own
    runtime weighs them exactly: ``loss_reduction.step_factors``)."""
    from torch.distributed import pipelining as pp

    from pipecc.runtime.loss_reduction import MEAN, MIXED, SUM, LossReduction, split_words

    name = schedule or plan.schedule
    m = microbatches or plan.microbatches
    known = reduction if reduction is not None else getattr(loss_fn, "reduction", None)
    if known is not None and not isinstance(known, LossReduction):
        known = LossReduction(str(known), f"reduction={str(known)!r} given")
    if known is not None and known.kind == MIXED and m > 1:
        raise InteropError(known.message(split_words(m), "this loss_fn"))
    checked = loss_fn if m < 2 else _checked(loss_fn, None if known is None else known.kind, m)
    if name == "interleaved":
        torch_sched = pp.ScheduleInterleaved1F1B(list(stages), m, loss_fn=checked)
    elif name == "zb-h1":
        if len(stages) != 1:
            raise InteropError(f"zb-h1 runs one stage per rank; this rank holds {len(stages)}")
        torch_sched = pp.ScheduleInterleavedZeroBubble(list(stages), m, loss_fn=checked)
        _same_order(torch_sched.pipeline_order, stages[0].num_stages, m)
    else:
        classes = {"gpipe": pp.ScheduleGPipe, "1f1b": pp.Schedule1F1B}
        if name not in classes:
            raise InteropError(f"schedule {name!r} has no torch.distributed.pipelining counterpart here")
        if len(stages) != 1:
            raise InteropError(f"{name} runs one stage per rank; this rank holds {len(stages)}")
        torch_sched = classes[name](stages[0], m, loss_fn=checked)
    torch_sched.scale_grads = known is None or known.kind != SUM  # a sum: the micro-batch gradients add up
    return torch_sched


def _checked(loss_fn: Callable, kind: str | None, m: int) -> Callable:
    """``loss_fn`` as torch calls it, micro-batch by micro-batch (on the last stage's rank).
    ``kind`` None: taken for a mean, the first call analyses it on that micro-batch and refuses
    anything else. Every m-th call (the step's last micro-batch) checks that the step's targets
    weigh the micro-batches as torch does (``loss_reduction.step_factors``): a mean whose
    ignored or class-weighted targets are spread unevenly is refused (``InteropError``), its
    gradients would not be the batch's."""
    from pipecc.runtime.loss_reduction import MEAN, SUM, analyse, split_words, step_factors

    seen: list[str] = [kind] if kind is not None else []
    targets: list[Any] = []

    def checked(output: Any, target: Any) -> Any:
        if not seen:
            rows = next((t.shape[0] for t in _tensor_leaves(output) if t.dim()), 1)
            found = analyse(loss_fn, output, target, rows)
            seen.append(found.kind)
            if found.kind == SUM:
                raise InteropError("loss_fn sums over the samples, and torch divides the micro-batch gradients by "
                                   "their count: pass reduction='sum' to torch_schedule on every rank")
            if found.kind != MEAN:
                raise InteropError(found.message(split_words(2), "this loss_fn"))
        targets.append(target)
        if len(targets) == m:
            step, sizes = list(targets), [next((t.shape[0] for t in _tensor_leaves(x) if t.dim()), 0) for x in targets]
            targets.clear()
            if all(sizes) and step_factors(loss_fn, output, m - 1, step, sizes, seen[0]) is not None:
                raise InteropError("this step's targets weigh its micro-batches unequally (loss_fn's mean counts "
                                   "targets: ignore_index entries or class weights spread unevenly), and torch's "
                                   "schedules weigh each micro-batch alike: the gradients would not be the batch's; "
                                   "run the folder with pipecc's runtime (pipecc.distributed), which weighs them")
        return loss_fn(output, target)
    return checked


def _tensor_leaves(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensor_leaves(v)]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensor_leaves(v)]
    return []


def _same_order(pipeline_order: dict[int, list[Any]], num_stages: int, m: int) -> None:
    """Refuse unless torch's compute order (bubbles dropped) is pipecc's zb-h1, rank by rank."""
    from pipecc.ir.schedule.generators import zb_h1_compute

    ours = zb_h1_compute(num_stages, m)
    for rank in range(num_stages):
        want = [f"{a.stage}{a.kind.value}{a.microbatch}" for a in ours.actions[rank]]
        got = [f"{a.stage_index}{a.computation_type.value}{a.microbatch_index}"
               for a in pipeline_order.get(rank, []) if a is not None]
        if got != want:
            raise InteropError(f"torch's ScheduleInterleavedZeroBubble orders rank {rank} as "
                               f"{' '.join(got[:12])}... but pipecc's zb-h1 as {' '.join(want[:12])}...; "
                               "not the same schedule")
