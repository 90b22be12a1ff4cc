"""Data-dependent control flow: neither torch.fx nor torch.export can capture it."""
import torch


class DataDependent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:
            return y * 2
        return y


def build_model(**kwargs):
    return DataDependent()


def example_inputs(batch_size=1):
    return (torch.randn(batch_size, 4),)
