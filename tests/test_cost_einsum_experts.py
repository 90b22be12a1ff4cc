"""einsum and grouped expert matmuls are matmul-class work (issue 30): einsum's FLOPs equal
FlopCounterMode's (torch runs it as bmm calls it counts); a mixture of experts' grouped matmul
(transformers' `grouped_mm_fallback`, a custom op FlopCounterMode cannot see into) is costed by
its formula, 2·S·K·N for S rows of K features through (E, K, N) expert weights, forward and
twice that backward (input and weight gradients)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import reference_flops
from pipecc import cost, driver


class Einsums(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 6))
        self.r = nn.Parameter(torch.randn(5, 5))

    def forward(self, x):  # (B, T, 8)
        h = torch.einsum("btd,de->bte", x, self.w)               # a projection
        s = torch.einsum("bqe,bke->bqk", h, h)                    # attention scores
        o = torch.einsum("bqk,bke->bqe", s.softmax(-1), h)
        m = torch.einsum("...ij,jk->...ik", o.transpose(1, 2)[..., :5], self.r)  # ellipsis
        return torch.einsum("bij->bji", m).sum(-1) + o.sum((1, 2)).unsqueeze(-1)


def test_einsum_flops_equal_flop_counter():
    torch.manual_seed(0)
    model = Einsums()
    x = torch.randn(2, 5, 8, requires_grad=False)
    graph = driver.analyze_module(model, (x,), debug=True)
    totals = cost.totals(graph)
    fwd, bwd = reference_flops(model, (x,))
    assert totals["forward_flops_matmul"] == fwd
    assert totals["backward_flops_matmul"] == bwd


@pytest.mark.real
def test_mixtral_expert_matmuls_costed_by_formula():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MixtralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=32, use_cache=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg)
    b, t = 2, 8
    graph = driver.analyze_module(model, (torch.randint(0, 100, (b, t)),))
    from pipecc.ir.graph import META_COST, META_OP
    experts = [n for n in graph.gm.graph.nodes if str(n.meta.get(META_OP)) == "grouped_mm_fallback"]
    assert len(experts) == 2  # gate_up and down
    rows = b * t * cfg.num_experts_per_tok
    want = [2 * rows * 64 * 2 * 128, 2 * rows * 128 * 64]  # (S, 64) @ (E, 64, 256); (S, 128) @ (E, 128, 64)
    for node, fwd in zip(experts, want):
        c = node.meta[META_COST]
        point = graph.point
        assert int(sympy_value(c.forward_flops_matmul, point)) == fwd
        assert int(sympy_value(c.backward_flops_matmul, point)) == 2 * fwd
        assert int(sympy_value(c.backward_weight_flops_matmul, point)) == fwd


def sympy_value(expr, point):
    return expr.subs(point) if hasattr(expr, "subs") else expr
