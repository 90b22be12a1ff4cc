"""A model whose forward raises."""
import torch


class Broken(torch.nn.Module):
    def forward(self, x):
        raise ValueError("this model is broken on purpose")


def build_model(**kwargs):
    return Broken()


def example_inputs(batch_size=1):
    return (torch.randn(batch_size, 4),)
