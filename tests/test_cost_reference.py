"""Matmul-class totals agree with torch.utils.flop_counter.FlopCounterMode (CONTRACT §5)."""
from __future__ import annotations

import pytest
import torch

from helpers import ZOO, reference_flops, zoo_module
from pipecc import cost, driver


@pytest.mark.parametrize("name", ZOO)
def test_zoo_matmul_flops_equal_flop_counter(name: str) -> None:
    zoo = zoo_module(name)
    torch.manual_seed(0)
    model = zoo.build_model(**zoo.TINY)
    inputs = zoo.example_inputs(2, **zoo.TINY)
    graph = driver.analyze_module(model, inputs, debug=True)
    totals = cost.totals(graph)
    ref_fwd, ref_bwd = reference_flops(model, inputs, zoo.loss_fn, zoo.example_target(2, **zoo.TINY))
    assert totals["forward_flops_matmul"] == ref_fwd
    assert totals["backward_flops_matmul"] == ref_bwd
    # all the work, not only matmuls, is counted
    assert totals["forward_flops"] > totals["forward_flops_matmul"]


def _hf_models():
    transformers = pytest.importorskip("transformers")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=32,
        bos_token_id=0, eos_token_id=0))
    bert = transformers.BertModel(transformers.BertConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
        vocab_size=100, max_position_embeddings=32))
    return {"gpt2": gpt2, "bert": bert}


class _Logits(torch.nn.Module):
    """Hugging Face models return output objects; the graph takes ids and returns a tensor."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=ids)
        return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("which", ["gpt2", "bert"])
def test_hugging_face_models_fall_back_to_export_and_agree(which: str) -> None:
    torch.manual_seed(0)
    model = _Logits(_hf_models()[which]).eval()
    ids = torch.randint(0, 100, (2, 8))
    graph = driver.analyze_module(model, (ids,), debug=True)
    assert graph.source == "export"
    assert any("captured with torch.export" in w for w in graph.warnings)
    totals = cost.totals(graph)
    ref_fwd, ref_bwd = reference_flops(model, (ids,))
    assert totals["forward_flops_matmul"] == ref_fwd
    assert totals["backward_flops_matmul"] == ref_bwd
    # the batch stays symbolic through export
    sym = cost.totals(graph, symbolic=True)
    assert str(sym["forward_flops_matmul"]).endswith("*B")
