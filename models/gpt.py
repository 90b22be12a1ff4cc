"""GPT decoder-only transformer (Radford et al. 2018, 2019), laid out as GPT-2 / nanoGPT.

Token + learned position embeddings, pre-LayerNorm blocks (causal self-attention through
`F.scaled_dot_product_attention(..., is_causal=True)`, then a 4x MLP with tanh-GELU as in
GPT-2), a final LayerNorm and a bias-free LM head. Dropout is left out so the forward pass
is deterministic.

Presets (`preset=`; explicit keyword arguments override their values):
  "gpt2"     GPT-2 small: 12 layers, 768 wide, 12 heads, 50257 tokens, 1024 positions.
  "gpt1-14"  the 14-layer, 768-wide GPT-1 variant UMPIPE benchmarks (GPT-1's 40478-token
             BPE vocabulary and 512 positions).
  "gpt2-xl"  GPT-2 XL: 48 layers, 1600 wide, 25 heads.
The LM head is untied by default (`tie_weights=False`) so no parameter is shared between
pipeline stages; GPT-2 small then has 163,037,184 parameters rather than the published
124,439,808 (the head adds 50257 * 768 = 38,597,376).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

PRESETS: dict[str, dict[str, int]] = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, block_size=1024),
    "gpt1-14": dict(n_layer=14, n_head=12, n_embd=768, vocab_size=40478, block_size=512),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600, vocab_size=50257, block_size=1024),
}
TINY = dict(n_layer=2, n_head=2, n_embd=32, vocab_size=101, block_size=16, seq_len=8)
SEED = 0


def config(preset: str = "gpt2", **kwargs) -> dict:
    """The preset's sizes with `kwargs` applied; `seq_len` defaults to min(128, block_size)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    cfg: dict = dict(PRESETS[preset], tie_weights=False)
    cfg.update((k, v) for k, v in kwargs.items() if k in cfg)
    cfg["seq_len"] = kwargs.get("seq_len", min(128, cfg["block_size"]))
    if cfg["n_embd"] % cfg["n_head"]:
        raise ValueError(f"n_embd={cfg['n_embd']} is not divisible by n_head={cfg['n_head']}")
    if cfg["seq_len"] > cfg["block_size"]:
        raise ValueError(f"seq_len={cfg['seq_len']} exceeds block_size={cfg['block_size']}")
    return cfg


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_embd, self.n_head = n_embd, n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T = x.size(0), x.size(1)
        heads = (B, T, self.n_head, self.n_embd // self.n_head)
        # NOTE: index the split, not unpack it: torch.fx cannot iterate a Proxy.
        qkv = self.qkv(x).split(self.n_embd, dim=2)
        q, k, v = (qkv[i].view(heads).transpose(1, 2) for i in range(3))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, self.n_embd))


class MLP(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, n_layer: int, n_head: int, n_embd: int, vocab_size: int,
                 block_size: int, tie_weights: bool = False) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.Sequential(*(Block(n_embd, n_head) for _ in range(n_layer)))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        if tie_weights:
            self.lm_head.weight = self.wte.weight
        self._init_weights(n_layer)

    @torch.no_grad()
    def _init_weights(self, n_layer: int) -> None:
        """GPT-2's init: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layer)."""
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() >= 2:
                residual = name.endswith("proj.weight")
                p.normal_(0.0, 0.02 / math.sqrt(2 * n_layer) if residual else 0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        return self.lm_head(self.ln_f(self.blocks(x)))


def build_model(preset: str = "gpt2", **kwargs) -> GPT:
    c = config(preset, **kwargs)
    return GPT(c["n_layer"], c["n_head"], c["n_embd"], c["vocab_size"], c["block_size"],
               c["tie_weights"])


def _tokens(batch_size: int, **kwargs) -> torch.Tensor:
    """A fixed [B, seq_len + 1] token sequence: inputs are [:, :-1], targets [:, 1:]."""
    c = config(**kwargs)
    g = torch.Generator().manual_seed(SEED)
    return torch.randint(c["vocab_size"], (batch_size, c["seq_len"] + 1), generator=g)


def example_inputs(batch_size: int = 1, **kwargs) -> tuple[torch.Tensor]:
    return (_tokens(batch_size, **kwargs)[:, :-1],)


def example_target(batch_size: int = 1, **kwargs) -> torch.Tensor:
    return _tokens(batch_size, **kwargs)[:, 1:]


def loss_fn(outputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs.flatten(0, 1), target.flatten())
