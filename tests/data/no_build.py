"""A file that forgot the contract's names."""
import torch


def make():
    return torch.nn.Linear(2, 2)
