"""Hugging Face BERT (sequence classification) with random weights from a small `BertConfig`
(no download), returning the logits tensor (holdout style)."""
from __future__ import annotations

import torch
from torch import nn


class BertLogits(nn.Module):
    def __init__(self, **config) -> None:
        super().__init__()
        from transformers import BertConfig, BertForSequenceClassification
        torch.manual_seed(0)
        self.model = BertForSequenceClassification(BertConfig(**config))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits


def build_model(num_hidden_layers: int = 4, num_attention_heads: int = 4, hidden_size: int = 256,
                intermediate_size: int = 1024, vocab_size: int = 2048, max_position_embeddings: int = 128,
                **_) -> BertLogits:
    return BertLogits(num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                      hidden_size=hidden_size, intermediate_size=intermediate_size, vocab_size=vocab_size,
                      max_position_embeddings=max_position_embeddings, num_labels=2,
                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def example_inputs(batch_size: int = 1, seq_len: int = 64, vocab_size: int = 2048, **_) -> tuple[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, vocab_size, (batch_size, seq_len), generator=g),)
