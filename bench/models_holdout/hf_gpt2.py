"""Hugging Face GPT-2 with random weights from a small `GPT2Config` (no download), returning
the logits tensor (holdout style: how Hugging Face models reach pipecc)."""
from __future__ import annotations

import torch
from torch import nn


class GPT2Logits(nn.Module):
    def __init__(self, **config) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel
        torch.manual_seed(0)
        self.model = GPT2LMHeadModel(GPT2Config(**config))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def build_model(n_layer: int = 4, n_head: int = 4, n_embd: int = 256, vocab_size: int = 2048,
                n_positions: int = 128, **_) -> GPT2Logits:
    return GPT2Logits(n_layer=n_layer, n_head=n_head, n_embd=n_embd, vocab_size=vocab_size,
                      n_positions=n_positions, attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)


def example_inputs(batch_size: int = 1, seq_len: int = 64, vocab_size: int = 2048, **_) -> tuple[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, vocab_size, (batch_size, seq_len), generator=g),)
