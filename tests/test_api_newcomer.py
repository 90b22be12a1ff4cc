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


def test_export_names_no_internal_stand_in():
    """A node torch.export made outside every module is named by its op alone, not after
    export's `_empty_nn_module_stack_from_metadata_hook` stand-in (the first node of a stage)."""
    from pipecc import driver
    from pipecc.ir.graph import META_NAME

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)

        def forward(self, x):  # the mask built in forward: captured with torch.export
            mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
            return self.layer(x, src_mask=mask, is_causal=True)

    graph = driver.analyze_module(Masked(), (torch.randn(4, 5, 8),))
    assert graph.source == "export"
    names = [str(n.meta.get(META_NAME)) for n in graph.gm.graph.nodes]
    assert not any("_empty_nn_module_stack" in n for n in names), names
