"""A model calling library functions marked with `torch.fx.wrap` (tests/data/wrapped_lib, on
PYTHONPATH) and one such function of its own (`centre`, wrapped here in the model file)."""
import torch
import torch.fx
from torch import nn

from wrapped_lib import LayerScale, WindowAttention


def centre(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Subtract the mean and divide by the spread over the last dim (the model file's own)."""
    x = x - x.mean(dim=-1, keepdim=True)
    return x / (x.pow(2).mean(dim=-1, keepdim=True) + eps).sqrt()


torch.fx.wrap("centre")


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attn = WindowAttention(dim, heads)
        self.scale = LayerScale(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.scale(self.attn(centre(x, 1e-5)))
        return x + torch.tanh(self.fc(x))


class Model(nn.Module):
    def __init__(self, dim: int = 16, heads: int = 2, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(8, dim)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(depth)])
        self.head = nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x))).mean(dim=1)


def build_model(dim: int = 16, heads: int = 2, depth: int = 2) -> nn.Module:
    torch.manual_seed(0)
    return Model(dim, heads, depth)


def example_inputs(batch_size: int = 4) -> tuple:
    return (torch.randn(batch_size, 6, 8),)


def example_target(batch_size: int = 4) -> torch.Tensor:
    return torch.randn(batch_size, 4)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, target)
