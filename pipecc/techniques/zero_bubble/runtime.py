"""The zero-bubble split of a stage's backward, as the engine runs I and W actions.

I computes the gradient of the stage's received inputs only, so SEND_B can go upstream at once;
W accumulates the parameters' gradients into ``.grad``, after which the engine lets the graph
go. Both go through torch's own split (``torch.distributed.pipelining._backward``): I saves,
by autograd pre-hooks, the gradient reaching every graph node where a weight's branch joins
the input's path, and W starts there. Parameters that split cannot reach (all of them on
stage 0, whose inputs take no gradient, where W is then one plain backward; a weight whose
branch never meets the input's path, e.g. feeding an output of its own) get theirs in W by a
walk from the outputs, ``torch.autograd.backward(outputs, grads, inputs=params)``, which
recomputes the input-gradient chain down to the first use of those parameters.

NOTE (what the split costs): measured on this CPU (one thread; a middle stage of
4 x Linear(512)+ReLU at batch 64, and of 8 x Linear(1024)+ReLU at batch 32; best of 30):
torch's split I 0.60-0.62 B, W 0.54-0.67 B, I + W 1.14-1.29 B (its graph analysis and hooks run
in Python for every micro-batch); the walk for every parameter would give I + W 1.41-1.62 B.
The planner, the report and `run --json` price I + W at `pipecc.ir.schedule.SPLIT_BACKWARD_COST`
(1.2) times B from these figures, not at the paper's 1.0.

``input_backward`` is I, ``weight_backward`` the W of what torch's split saved; ``ZeroBubble``,
the executor's handler of I and W actions, runs them on a stage runner and keeps, from each I to
its W, what W needs (the roots, their gradients, torch's groups, the parameters left to the walk),
which it runs itself (``torch.autograd.backward(..., inputs=walk)``) before ``weight_backward``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch

from pipecc.ir.schedule.actions import Action, ActionKind
from pipecc.runtime.handlers import Handler, RankParts

if TYPE_CHECKING:  # NOTE: typing only; the handler is given its runners
    from pipecc.runtime.stage_runner import StageRunner

__all__ = ["ZeroBubble", "handler", "input_backward", "weight_backward"]


def input_backward(roots: list, grads: list | None, inputs: list,
                   params: list) -> tuple[Sequence[Any], list, list]:
    """Zero-bubble I through torch's split (module docstring): (gradients of `inputs`, torch's
    param groups for W, the parameters W must reach by walking from `roots` instead).

    NOTE: torch detaches the outputs it is given (to free the graph W no longer needs); it gets
    clones, so `roots` keep their graph for the walk, when there is one.
    """
    try:
        from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc, stage_backward_input
    except ImportError:  # a torch without the split: the walk does every parameter
        got = torch.autograd.grad(roots, inputs, grads, retain_graph=True, allow_unused=True)
        return got, [], params
    accumulators = {_get_grad_fn_or_grad_acc(q): q for q in params}
    got, groups = stage_backward_input([r.clone() for r in roots], grads, inputs, iter(params))
    covered = {node for g in groups for node in g["params"]}
    walk = [q for node, q in accumulators.items() if node not in covered]
    return got, groups, walk


def weight_backward(params: list, groups: list) -> None:
    """W from torch's saved gradients: accumulates into the parameters' ``.grad``; the graph
    goes when the engine lets go of ``groups`` (as ``input_backward`` returned them).

    NOTE: the graph is retained across torch's groups. A weight whose branch meets the input's
    path at two points, one downstream of the other (T5's relative position bias, added in
    every decoder layer; an encoder-decoder's later stage embedding a model input of its own,
    whose branch joins the received encoder output in every cross-attention), is one group
    whose backward runs from the later point through the input's path to the earlier one
    (torch clamps the gradient there, so nothing counts twice). Without ``retain_graph`` an
    earlier group has already freed those nodes: "Trying to backward through the graph a
    second time". The saved tensors live as long as they did before W started."""
    from torch.distributed.pipelining._backward import stage_backward_weight

    stage_backward_weight(params, groups, retain_graph=True)


class ZeroBubble(Handler):
    """The executor's I and W handler (``zb-h1``, ``zb-v``); ``runner_of(stage)`` gives the stage's
    ``StageRunner``. Per step (``reset``): ``roots[(stage, mb)]``, what W needs after I."""

    def __init__(self, runner_of: Any) -> None:
        self.runner_of = runner_of
        self.reset(None, (), False)

    kinds = (ActionKind.I, ActionKind.W)

    def run(self, a: Action, training: bool) -> None:
        (self.input if a.kind is ActionKind.I else self.weight)(a, training)

    def reset(self, schedule: Any, row: Sequence[Action], training: bool) -> None:
        # after I, for W: (outputs, their grads, torch's param groups, parameters left to a walk)
        self.roots: dict[tuple[int, int], tuple[list, list | None, list, list]] = {}

    @property
    def leftover(self) -> list[tuple[int, int]]:
        return sorted(self.roots)

    def input(self, a: Action, training: bool) -> None:
        """I: the gradient of the stage's inputs, handed to stage s - 1; what W needs is kept."""
        runner: StageRunner = self.runner_of(a.stage)
        s, mb = a.stage, a.microbatch
        in_leaves, outs = runner.stash[mb]
        roots, grads = runner.output_grads(mb, outs)
        params = [q for q in runner.module.parameters() if q.requires_grad]
        wanted = [x for x, p in zip(in_leaves, runner.ports.in_leaves) if p.carries_grad] if s > 0 else []
        need = [x for x in wanted if isinstance(x, torch.Tensor) and x.requires_grad]
        got: Sequence[Any] = ()
        groups: list = []
        walk = params  # stage 0, or nothing to differentiate: W walks for every parameter
        if roots and need:
            got, groups, walk = input_backward(roots, grads, need, params)
        if walk:
            self.roots[(s, mb)] = (roots, grads, groups, walk)
        else:  # NOTE: W starts from torch's saved gradients: let go of the rest of the graph
            self.roots[(s, mb)] = ([], None, groups, walk)
            runner.stash[mb] = ([], None)
        if s == 0:
            return  # no input gradient to send
        found = {id(x): g for x, g in zip(need, got)}
        runner.hand_down(mb, [found[id(x)] if found.get(id(x)) is not None else torch.zeros_like(x) for x in wanted])

    def weight(self, a: Action, training: bool) -> None:
        """W: the parameters' gradients, accumulated into ``.grad``; frees the graph and the stash."""
        runner: StageRunner = self.runner_of(a.stage)
        runner.stash.pop(a.microbatch)
        roots, grads, groups, walk = self.roots.pop((a.stage, a.microbatch))
        if roots and walk:
            torch.autograd.backward(roots, grads, inputs=walk, retain_graph=bool(groups))
        if groups:
            weight_backward([q for q in runner.module.parameters() if q.requires_grad], groups)


def handler(parts: RankParts) -> ZeroBubble:
    """Zero-bubble's share of the rank (`pipecc.runtime.handlers`): I and W."""
    return ZeroBubble(parts.runner)
