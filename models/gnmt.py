"""GNMT (Wu et al. 2016, "Google's Neural Machine Translation System"), teacher-forced training.

Encoder: embedding, a bidirectional LSTM layer, then unidirectional LSTM layers with residual
connections from the third layer on. Decoder as in the MLPerf GNMT reference
(`seq2seq/models/decoder.py`): the first LSTM layer runs over the whole target sequence, its
outputs attend to the encoder outputs all at once (normalized Bahdanau attention), and every
later layer reads [h; context], with residual connections from the third layer on; a linear
projection gives vocabulary logits. Each layer is one whole-sequence `nn.LSTM` call, so the
model traces with `torch.fx.symbolic_trace` into a small graph. Simplifications: all
sequences have full length (no padding mask), decoder states start at zero, no dropout.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

TINY = dict(vocab_size=53, hidden=16, num_layers=4, src_len=7, tgt_len=5)
SEED = 0


class BahdanauAttention(nn.Module):
    """score(q, k) = g * v/|v| . tanh(W_q q + W_k k + b); context = softmax(score) @ keys."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear_q = nn.Linear(hidden, hidden, bias=False)
        self.linear_k = nn.Linear(hidden, hidden, bias=False)
        self.v = nn.Parameter(torch.empty(hidden).uniform_(-0.1, 0.1))
        self.g = nn.Parameter(torch.full((1,), 1.0 / math.sqrt(hidden)))
        self.b = nn.Parameter(torch.zeros(hidden))

    def forward(self, query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        # [B, T, 1, H] + [B, 1, S, H] -> [B, T, S, H] -> scores [B, T, S]
        summed = self.linear_q(query).unsqueeze(2) + self.linear_k(keys).unsqueeze(1) + self.b
        scores = torch.tanh(summed).matmul(self.g * self.v / self.v.norm())
        return torch.bmm(F.softmax(scores, dim=-1), keys)


class Encoder(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, num_layers: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, hidden)
        self.bidir = nn.LSTM(hidden, hidden, batch_first=True, bidirectional=True)
        self.layers = nn.ModuleList(
            nn.LSTM(2 * hidden if i == 0 else hidden, hidden, batch_first=True)
            for i in range(num_layers - 1))

    def forward(self, src: torch.Tensor) -> torch.Tensor:
        x = self.bidir(self.embedding(src))[0]
        for i, lstm in enumerate(self.layers):
            y = lstm(x)[0]
            x = y if i == 0 else x + y  # residual from the third encoder layer on
        return x


class Decoder(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, num_layers: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, hidden)
        self.att_rnn = nn.LSTM(hidden, hidden, batch_first=True)
        self.attention = BahdanauAttention(hidden)
        self.layers = nn.ModuleList(
            nn.LSTM(2 * hidden, hidden, batch_first=True) for _ in range(num_layers - 1))
        self.classifier = nn.Linear(hidden, vocab_size)

    def forward(self, tgt: torch.Tensor, enc: torch.Tensor) -> torch.Tensor:
        x = self.att_rnn(self.embedding(tgt))[0]
        context = self.attention(x, enc)
        for i, lstm in enumerate(self.layers):
            y = lstm(torch.cat([x, context], dim=2))[0]
            x = y if i == 0 else x + y  # residual from the third decoder layer on
        return self.classifier(x)


class GNMT(nn.Module):
    def __init__(self, vocab_size: int = 32000, hidden: int = 1024, num_layers: int = 8) -> None:
        super().__init__()
        if num_layers < 2:
            raise ValueError(f"num_layers must be >= 2, got {num_layers}")
        self.encoder = Encoder(vocab_size, hidden, num_layers)
        self.decoder = Decoder(vocab_size, hidden, num_layers)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return self.decoder(tgt, self.encoder(src))


def build_model(vocab_size: int = 32000, hidden: int = 1024, num_layers: int = 8, **_) -> GNMT:
    """`num_layers` LSTM layers in the encoder and as many in the decoder (8 in the paper)."""
    return GNMT(vocab_size, hidden, num_layers)


def _tokens(batch_size: int, vocab_size: int, src_len: int, tgt_len: int):
    """Fixed source [B, src_len] and target [B, tgt_len + 1] token ids."""
    g = torch.Generator().manual_seed(SEED)
    src = torch.randint(vocab_size, (batch_size, src_len), generator=g)
    return src, torch.randint(vocab_size, (batch_size, tgt_len + 1), generator=g)


def example_inputs(batch_size: int = 1, vocab_size: int = 32000, src_len: int = 50,
                   tgt_len: int = 50, **_) -> tuple[torch.Tensor, torch.Tensor]:
    """(source ids, decoder input ids): the target sequence without its last token."""
    src, tgt = _tokens(batch_size, vocab_size, src_len, tgt_len)
    return src, tgt[:, :-1]


def example_target(batch_size: int = 1, vocab_size: int = 32000, src_len: int = 50,
                   tgt_len: int = 50, **_) -> torch.Tensor:
    """The target sequence shifted by one: the token each decoder position predicts."""
    return _tokens(batch_size, vocab_size, src_len, tgt_len)[1][:, 1:]


def loss_fn(outputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs.flatten(0, 1), target.flatten())
