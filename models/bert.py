"""BERT encoder with a sequence-classification head (Devlin et al. 2018), BERT-base by default.

Laid out as Hugging Face's `BertForSequenceClassification`: token + position + token-type
embeddings and LayerNorm; post-LayerNorm blocks with self-attention written out as q/k/v
Linear + matmul + softmax (GPT in this zoo uses fused SDPA, so the zoo covers both), a GELU
feed-forward; a tanh pooler on the [CLS] token and a linear classifier. At the defaults it has
109,483,778 parameters (109,482,240 for BERT-base plus the 2-label classifier). The model takes
`input_ids` only; token types are all zero and there is no padding mask. Dropout is left out
so the forward pass is deterministic.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

TINY = dict(n_layer=2, n_head=2, n_embd=32, ff_dim=64, vocab_size=101, max_position=16,
            seq_len=8, num_labels=3)
SEED = 0


class SelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} is not divisible by n_head={n_head}")
        self.n_head, self.head_dim = n_head, n_embd // n_head
        self.query = nn.Linear(n_embd, n_embd)
        self.key = nn.Linear(n_embd, n_embd)
        self.value = nn.Linear(n_embd, n_embd)
        self.out = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T = x.size(0), x.size(1)
        heads = (B, T, self.n_head, self.head_dim)
        q = self.query(x).view(heads).transpose(1, 2)
        k = self.key(x).view(heads).transpose(1, 2)
        v = self.value(x).view(heads).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        y = torch.matmul(F.softmax(scores, dim=-1), v)
        return self.out(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))


class Layer(nn.Module):
    def __init__(self, n_embd: int, n_head: int, ff_dim: int, eps: float) -> None:
        super().__init__()
        self.attn = SelfAttention(n_embd, n_head)
        self.ln_attn = nn.LayerNorm(n_embd, eps=eps)
        self.ff_in = nn.Linear(n_embd, ff_dim)
        self.ff_out = nn.Linear(ff_dim, n_embd)
        self.ln_ff = nn.LayerNorm(n_embd, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_attn(x + self.attn(x))
        return self.ln_ff(x + self.ff_out(F.gelu(self.ff_in(x))))


class Bert(nn.Module):
    def __init__(self, n_layer: int, n_head: int, n_embd: int, ff_dim: int, vocab_size: int,
                 max_position: int, type_vocab_size: int, num_labels: int,
                 eps: float = 1e-12) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, n_embd)
        self.position_embeddings = nn.Embedding(max_position, n_embd)
        self.token_type_embeddings = nn.Embedding(type_vocab_size, n_embd)
        self.ln_embed = nn.LayerNorm(n_embd, eps=eps)
        self.layers = nn.Sequential(*(Layer(n_embd, n_head, ff_dim, eps) for _ in range(n_layer)))
        self.pooler = nn.Linear(n_embd, n_embd)
        self.classifier = nn.Linear(n_embd, num_labels)
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        """BERT's init: weight matrices and embeddings N(0, 0.02), biases zero."""
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
            elif name.endswith("bias"):
                p.zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.size(1), device=input_ids.device)
        x = (self.word_embeddings(input_ids) + self.position_embeddings(pos)
             + self.token_type_embeddings(torch.zeros_like(input_ids)))
        x = self.layers(self.ln_embed(x))
        pooled = torch.tanh(self.pooler(x[:, 0]))
        return self.classifier(pooled)


def build_model(n_layer: int = 12, n_head: int = 12, n_embd: int = 768, ff_dim: int = 3072,
                vocab_size: int = 30522, max_position: int = 512, type_vocab_size: int = 2,
                num_labels: int = 2, **_) -> Bert:
    return Bert(n_layer, n_head, n_embd, ff_dim, vocab_size, max_position, type_vocab_size,
                num_labels)


def example_inputs(batch_size: int = 1, seq_len: int = 128, vocab_size: int = 30522,
                   max_position: int = 512, **_) -> tuple[torch.Tensor]:
    if seq_len > max_position:
        raise ValueError(f"seq_len={seq_len} exceeds max_position={max_position}")
    g = torch.Generator().manual_seed(SEED)
    return (torch.randint(vocab_size, (batch_size, seq_len), generator=g),)


def example_target(batch_size: int = 1, num_labels: int = 2, **_) -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED + 1)
    return torch.randint(num_labels, (batch_size,), generator=g)


def loss_fn(outputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs, target)
