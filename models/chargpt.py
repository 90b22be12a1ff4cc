"""A character-level GPT trained on the English text of Python's own documentation topics.

The data is `pydoc_data.topics.topics` (the text `help("if")` prints, shipped in every CPython
install): its values joined in sorted key order, about 465,000 characters on CPython 3.11 (the
text differs a little between Python versions). Nobody generated it and nothing is downloaded.

Vocabulary: fixed, 128 codes, the same on every Python. A character's code is its ASCII code;
every character outside ASCII (about 0.1% of the text: typographic quotes, dashes, "°") is code
127 (DEL, which the text never holds). `decode` turns codes back into text, 127 as "?".

Split: the first 90% of the characters train, the last 10% validate. Each split is cut into
consecutive, non-overlapping windows of `seq_len` characters: a window is the inputs, the same
window shifted on by one character the target (the next character at every position), so one
epoch reads the training text once. `train_data` shuffles the windows with a torch.Generator
seeded by `seed` (every process that iterates it gets the same order); `val_data` keeps them
in order. Both drop the last partial batch, so every batch has exactly `batch_size` rows.
Iterating the same loader again gives the next epoch, in another order that `seed` also fixes;
a new `train_data(...)` starts again from the first epoch's order.

The model is the zoo's GPT (`gpt.py`: learned positions, pre-LayerNorm blocks, causal
attention, tanh-GELU MLP, untied head, GPT-2's init) at a small size, with residual and
embedding dropout (`dropout`, default 0.0 so runs are deterministic). The defaults (2 layers,
4 heads, 64 wide, 64 characters: 120k parameters) train on two CPU processes in a minute or
two; loss is the mean cross-entropy over every position, ln(128) = 4.85 for a uniform guess.

Model arguments: n_layer, n_head, n_embd, seq_len, dropout, seed (the data order only; the
weights come from torch's global RNG as in every zoo model).

Measured (one process, CPython 3.11.7, torch 2.13 CPU, torch.manual_seed(0), AdamW lr 3e-3, the
defaults): validation loss 2.13 after one epoch at batch 32 (204 steps), 1.63 after three (612
steps; 56% of next characters right), 1.57 after 612 steps at batch 64.
"""
from __future__ import annotations

import functools
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from pipecc.models.gpt import MLP, CausalSelfAttention

VOCAB_SIZE = 128  # ASCII; every other character is 127
OTHER = VOCAB_SIZE - 1
TRAIN_FRACTION = 0.9
TINY = dict(n_layer=2, n_head=2, n_embd=32, seq_len=16)


# ----------------------------------------------------------------------------- data
@functools.lru_cache(maxsize=1)
def corpus() -> torch.Tensor:
    """The whole text as int64 codes (module docstring: vocabulary); read once per process."""
    from pydoc_data.topics import topics
    text = "".join(topics[k] for k in sorted(topics))
    # NOTE: one code point per 4 bytes in this machine's byte order (< 0x110000: fits int32);
    # torch alone, so the file runs where only torch and pipecc are installed
    raw = text.encode("utf-32-le" if sys.byteorder == "little" else "utf-32-be")
    return torch.frombuffer(bytearray(raw), dtype=torch.int32).clamp(max=OTHER).to(torch.int64)


def decode(codes: torch.Tensor) -> str:
    """Codes back to text (127, any character outside ASCII, as "?")."""
    return "".join("?" if c == OTHER else chr(c) for c in codes.tolist())


def split(name: str) -> torch.Tensor:
    """"train" (the first 90% of the text) or "val" (the last 10%) as codes."""
    codes = corpus()
    cut = int(len(codes) * TRAIN_FRACTION)
    return {"train": codes[:cut], "val": codes[cut:]}[name]


def windows(name: str, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split `name` as non-overlapping windows: inputs [N, seq_len] and targets, shifted by one."""
    codes = split(name)
    n = (len(codes) - 1) // seq_len
    return codes[:n * seq_len].view(n, seq_len), codes[1:n * seq_len + 1].view(n, seq_len)


def _batch(rows: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, target) of one batch (the default collate would make a list)."""
    return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])


def _loader(name: str, batch_size: int, seq_len: int, seed: int | None) -> DataLoader:
    x, y = windows(name, seq_len)
    if not 1 <= batch_size <= len(x):
        raise ValueError(f"batch_size={batch_size}: the {name} split has {len(x)} windows of "
                         f"seq_len={seq_len} characters; give 1..{len(x)}")
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=seed is not None,
                      drop_last=True, generator=g, collate_fn=_batch)


def train_data(batch_size: int, seq_len: int = 64, seed: int = 0, **_) -> DataLoader:
    """The training windows in batches of exactly `batch_size`, shuffled by `seed`."""
    return _loader("train", batch_size, seq_len, seed)


def val_data(batch_size: int, seq_len: int = 64, **_) -> DataLoader:
    """The validation windows in order, in batches of exactly `batch_size`."""
    return _loader("val", batch_size, seq_len, None)


def example_inputs(batch_size: int = 1, seq_len: int = 64, seed: int = 0, **_) -> tuple[torch.Tensor]:
    """The first training batch's inputs."""
    return (next(iter(train_data(batch_size, seq_len=seq_len, seed=seed)))[0],)


def example_target(batch_size: int = 1, seq_len: int = 64, seed: int = 0, **_) -> torch.Tensor:
    """The first training batch's target."""
    return next(iter(train_data(batch_size, seq_len=seq_len, seed=seed)))[1]


def loss_fn(outputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs.flatten(0, 1), target.flatten())


# ----------------------------------------------------------------------------- model
class Block(nn.Module):
    """gpt.py's block with dropout on each residual branch (nanoGPT's resid_dropout)."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln_1(x)))
        return x + self.drop(self.mlp(self.ln_2(x)))


class CharGPT(nn.Module):
    def __init__(self, n_layer: int, n_head: int, n_embd: int, seq_len: int, dropout: float) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} is not divisible by n_head={n_head}")
        self.wte = nn.Embedding(VOCAB_SIZE, n_embd)
        self.wpe = nn.Embedding(seq_len, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*(Block(n_embd, n_head, dropout) for _ in range(n_layer)))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, VOCAB_SIZE, bias=False)
        with torch.no_grad():  # GPT-2's init, as gpt.GPT: N(0, 0.02), residual projections scaled
            for name, p in self.named_parameters():
                if name.endswith("bias"):
                    p.zero_()
                elif p.dim() >= 2:
                    p.normal_(0.0, 0.02 / math.sqrt(2 * n_layer) if name.endswith("proj.weight") else 0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        return self.lm_head(self.ln_f(self.blocks(x)))


def build_model(n_layer: int = 2, n_head: int = 4, n_embd: int = 64, seq_len: int = 64,
                dropout: float = 0.0, init_seed: int | None = None, **_) -> CharGPT:
    """``init_seed``: draw the weights from this seed (the global RNG left as it was); None: from
    torch's global RNG."""
    if init_seed is None:
        return CharGPT(n_layer, n_head, n_embd, seq_len, dropout)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(init_seed))
        return CharGPT(n_layer, n_head, n_embd, seq_len, dropout)
