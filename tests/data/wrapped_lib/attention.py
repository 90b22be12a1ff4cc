"""Multi-head self-attention as one function marked with `torch.fx.wrap` (like Swin's
`shifted_window_attention`): its matmuls are invisible to a trace, which sees one call."""
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn


def window_attention(x: torch.Tensor, qkv_weight: torch.Tensor, proj_weight: torch.Tensor,
                     proj_bias: torch.Tensor, num_heads: int) -> torch.Tensor:
    b, n, c = x.shape
    qkv = F.linear(x, qkv_weight).reshape(b, n, 3, num_heads, c // num_heads).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    attn = (q * (c // num_heads) ** -0.5) @ k.transpose(-2, -1)
    out = (attn.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, n, c)
    return F.linear(out, proj_weight, proj_bias)


torch.fx.wrap("window_attention")


class WindowAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv_weight = nn.Parameter(torch.randn(3 * dim, dim) / dim ** 0.5)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return window_attention(x, self.qkv_weight, self.proj.weight, self.proj.bias, self.num_heads)
