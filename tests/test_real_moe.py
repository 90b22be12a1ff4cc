"""Mixtures of experts pipeline with micro-batches (issue 30): a transformers MoE layer sorts the
tokens of the whole batch by expert, runs a grouped matmul per expert over the sorted rows and
puts the rows back in token order; each token's result depends on its own row and expert only,
so the batch analysis (`passes.batchdim`, `routed`) follows the routing instead of refusing the
sort. A sort over the batch used any other way is still refused."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import pipecc
from pipecc.errors import PipeccError


def _mixtral():
    import transformers
    cfg = transformers.MixtralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=32, use_cache=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(cfg)


@pytest.mark.real
def test_mixtral_two_microbatches_equal_the_model(one_thread):
    model = _mixtral()
    ref = copy.deepcopy(model)
    x = torch.randint(0, 100, (8, 8), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = pipecc.compile(model, (x,), "2xcpu", microbatches=2)
    assert pm.plan.microbatches == 2 and len(pm.plan.stages) >= 2
    got, want = pm(x).logits, ref(x).logits
    torch.testing.assert_close(got, want)
    got.pow(2).mean().backward()
    want.pow(2).mean().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, n=name: f"gradient of {n}: {m}")


class SortedTokens(nn.Module):
    """Sorts the flattened tokens of the whole batch and keeps that order (mixes samples)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 1), nn.Linear(1, 4)

    def forward(self, x):  # (B, T, 4)
        score = self.a(x).reshape(-1)
        ranked, _ = score.sort()
        return self.b(ranked.view(x.shape[0], -1, 1))


def test_a_sort_over_the_batch_kept_in_sorted_order_is_refused(one_thread):
    x = torch.randn(6, 5, 4, generator=torch.Generator().manual_seed(1))
    with pytest.raises(PipeccError) as info:
        pipecc.compile(SortedTokens(), (x,), "2xcpu", microbatches=2)
    line = str(info.value)
    assert "\n" not in line and "uses the order of a sort over the batch" in line, line
    pipecc.compile(SortedTokens(), (x,), "2xcpu", microbatches=1)
