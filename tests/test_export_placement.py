"""Parameters of torch.export graphs are placed where they are used (issue #19 item 2).

`ExportedProgram.module()` lists every parameter (`get_attr`) at the top of the graph; the
units used to fold each into the next compute node, so stage 0 was charged every weight. Now a
weight is charged to its first user's unit: the plan's per-stage parameter bytes are what each
stage holds, a tied weight once (with its first user), a weight is no message between stages,
and the pipelined model's outputs and gradients (the tied weight's summed) are the model's.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import pytest
import sympy
import torch
import torch.nn as nn

import pipecc
from pipecc import driver
from pipecc.backends.torch.stages import Stage, cut_stages
from pipecc.ir.graph import AnnotatedGraph, tensors_in
from pipecc.passes.units import UnitBuilder


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class Deep(nn.Module):
    """Six equal layers; a shape test torch.fx cannot trace, so torch.export captures it."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x * 2 if x.shape[0] > 1 else x


class TiedLM(nn.Module):
    """Token embedding tied to the output head (GPT-2's wte / lm_head), captured by export."""

    def __init__(self, vocab: int = 50, d: int = 16) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(4))
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.wte(ids)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        if ids.shape[1] > 1:
            h = h * 0.5
        return self.lm_head(h)


def held_bytes(stage: Stage, charged: set[int]) -> int:
    """Bytes of the parameters a stage references; a tied one only where first charged."""
    total = 0
    for p in stage.gm.parameters():
        if id(p) not in charged:
            charged.add(id(p))
            total += p.numel() * p.element_size()
    return total


def plan_and_stages(model: nn.Module, inputs: tuple, devices: str, **options: Any):
    graph = driver.analyze_module(model, inputs)
    plan, graph = driver.plan(graph, devices, replicas=1, split_layers=False, **options)
    return graph, plan, cut_stages(graph, plan.stage_of())


def check_param_bytes(plan: Any, stages: list[Stage], model: nn.Module) -> None:
    """Each stage's planned parameter bytes are what it holds; their sum is the model's."""
    charged: set[int] = set()
    assert [s.param_bytes for s in plan.stages] == [held_bytes(s, charged) for s in stages]
    assert sum(s.param_bytes for s in plan.stages) == sum(p.numel() * 4 for p in model.parameters())


def test_export_weights_go_to_the_stage_that_uses_them() -> None:
    torch.manual_seed(0)
    model = Deep()
    graph, plan, stages = plan_and_stages(model, (torch.randn(8, 32),), "2xa100")
    assert graph.source == "export"
    check_param_bytes(plan, stages, model)
    assert all(s.param_bytes > 0 for s in plan.stages)  # not every weight in stage 0


def test_every_parameter_node_joins_its_first_users_unit() -> None:
    torch.manual_seed(0)
    graph = driver.analyze_module(Deep(), (torch.randn(8, 32),))
    builder = UnitBuilder(graph)
    unit_of = {n: i for i, g in enumerate(builder.groups) for n in g}
    params = [n for n in graph.gm.graph.nodes if n.op == "get_attr"]
    assert params and all(unit_of[p] == min(unit_of[u] for u in p.users) for p in params)
    order = [n for g in builder.groups for n in g]  # still a topological order
    assert all(order.index(p) < order.index(u) for p in params for u in p.users)


def test_a_tied_weight_is_charged_once_and_sends_nothing() -> None:
    torch.manual_seed(0)
    model = TiedLM()
    ids = torch.randint(0, 50, (4, 6))
    graph, plan, stages = plan_and_stages(model, (ids,), "2xa100", microbatches=2)
    assert graph.source == "export"
    # the alias export leaves for the weight's other name reads nothing: gone
    assert all(n.users for n in graph.gm.graph.nodes if n.op == "get_attr")
    assert stages[0].tied == stages[1].tied == ["wte.weight"]
    check_param_bytes(plan, stages, model)
    # the cut carries what stage 1 receives, not the embedding's output kept for lm_head's weight
    b = graph.symbols["B"]
    received = sum(sympy.sympify(t.nbytes).subs(b, 2) for p in stages[1].receives
                   for t in tensors_in(p.value))
    assert plan.stages[0].send_bytes == int(received)


def test_tied_export_model_pipelined_matches_with_summed_gradients() -> None:
    torch.manual_seed(0)
    model = TiedLM()
    ids = torch.randint(0, 50, (4, 6))
    pm = pipecc.compile(model, (ids,), "cpu,cpu", microbatches=2, split_layers=False)
    assert len(pm.plan.stages) == 2
    loss = lambda out: out.square().mean()  # noqa: E731
    out = pm(ids)
    loss(out).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    want = model(ids)
    loss(want).backward()
    torch.testing.assert_close(out, want)
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, msg=n)


@lru_cache(maxsize=None)
def gpt2() -> tuple[nn.Module, tuple, AnnotatedGraph]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=2, vocab_size=256, n_positions=64,
                                     use_cache=False, bos_token_id=0, eos_token_id=0,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
    return model, (ids,), driver.analyze_module(model, (ids,))


def test_gpt2_plans_its_weights_where_they_are_used() -> None:
    """Tiny GPT2LMHeadModel on 4xa100, the plain pipeline: no stage is all weights."""
    model, _, graph = gpt2()
    assert graph.source == "export"
    plan, graph = driver.plan(graph, "4xa100", replicas=1, split_layers=False)
    stages = cut_stages(graph, plan.stage_of())
    check_param_bytes(plan, stages, model)
    total = sum(s.param_bytes for s in plan.stages)
    assert max(s.param_bytes for s in plan.stages) < total
    first = next(s for s in plan.stages if "transformer.wte.embedding" in s.nodes)
    wte = model.transformer.wte.weight
    assert first.param_bytes >= wte.numel() * 4  # the tied weight, with its first user


def test_gpt2_pipelined_matches_the_model() -> None:
    """Four stages on CPU, tied wte/lm_head across them: logits and every gradient."""
    model, (ids,), _ = gpt2()
    pm = pipecc.compile(model, (ids,), "4xcpu", microbatches=2, split_layers=False)
    assert len(pm.plan.stages) == 4
    out = pm(ids).logits
    out.square().mean().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    want = model(ids).logits
    want.square().mean().backward()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)
