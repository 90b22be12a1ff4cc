"""A per-channel scale, kept as one node by `torch.fx.wrap` (like torchvision's stochastic_depth)."""
import torch
import torch.fx
from torch import nn


def scale(x: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """x * gamma over the last dim; a Python branch on a shape, fine outside a trace."""
    if x.shape[-1] != gamma.shape[0]:
        raise ValueError("gamma does not fit x")
    return x * gamma


torch.fx.wrap("scale")


class LayerScale(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.rand(dim) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scale(x, self.gamma)
