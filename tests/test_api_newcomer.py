"""The newcomer's list (issue 30) items of `pipecc.compile`'s arguments: the model file's
`example_inputs` function passed as is, and `split_layers="off"` (the command line's word),
which was read as on."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import pipecc
from pipecc.errors import UsageError


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 4096), nn.ReLU(), nn.Linear(4096, 4))


def test_a_function_as_example_inputs_is_refused_in_one_line():
    def example_inputs(batch_size=1):
        return (torch.randn(batch_size, 256),)

    with pytest.raises(UsageError) as info:
        pipecc.compile(_model(), example_inputs, "2xcpu")
    line = str(info.value)
    assert "\n" not in line and "example_inputs is a function" in line and "tuple of inputs" in line


@pytest.mark.parametrize("word,split", [("off", False), ("on", True)])
def test_split_layers_words(word, split, one_thread):
    pm = pipecc.compile(_model(), (torch.randn(8, 256),), "2xcpu", split_layers=word)
    shards = any("shard" in n for s in pm.plan.stages for n in s.nodes)
    assert shards == split  # the heavy first layer is split only when asked
    with pytest.raises(UsageError, match="split_layers='of'"):
        pipecc.compile(_model(), (torch.randn(8, 256),), "2xcpu", split_layers="of")
