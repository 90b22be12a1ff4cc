"""Hugging Face models as the library builds them, at a tiny size with random weights (no
download): `kind=gpt2` (GPT2LMHeadModel) or `kind=bert` (BertForSequenceClassification).

torch.fx cannot trace them, so pipecc captures them with torch.export, whose graphs hold the
train/eval flag as constants (dropout, attention dropout): the case tests/test_train_eval.py
checks. The pipeline's outputs reach `loss_fn` as a dict and the model's as a ModelOutput;
both are indexed by key.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

VOCAB, SEQ = 100, 16


def build_model(kind: str = "gpt2", layers: int = 2, **_) -> torch.nn.Module:
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=layers, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64,
                                         use_cache=False, bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(config)
    if kind == "bert":
        config = transformers.BertConfig(num_hidden_layers=layers, hidden_size=32, num_attention_heads=2,
                                         intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64)
        return transformers.BertForSequenceClassification(config)
    raise ValueError(f"kind must be gpt2 or bert, got {kind!r}")


def example_inputs(batch_size: int = 1, **_) -> tuple[torch.Tensor]:
    return (torch.randint(VOCAB, (batch_size, SEQ), generator=torch.Generator().manual_seed(0)),)


def example_target(batch_size: int = 1, kind: str = "gpt2", **_) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(VOCAB, (batch_size, SEQ), generator=g) if kind == "gpt2" else torch.randint(2, (batch_size,), generator=g)


def loss_fn(outputs, target: torch.Tensor) -> torch.Tensor:
    logits = outputs["logits"]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
