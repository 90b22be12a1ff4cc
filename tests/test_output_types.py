"""The pipelined model returns the class the model returns (issue #19 item 7).

A Hugging Face model returns a ModelOutput (`out.logits`); the drop-in returned a plain dict.
Now the output tree names the class (`"type": "module:qualname"`) and the runtime rebuilds it:
ModelOutputs through torch.export (its pytree spec) and torch.fx (the class forward returned),
namedtuples, with one micro-batch or several (merged), and a plain dict stays a plain dict.
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
import torch.nn as nn

import pipecc
from pipecc import driver
from pipecc.runtime.ports import build_output

Pair = collections.namedtuple("Pair", "logits hidden")


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class Net(nn.Module):
    """Returns `wrap(logits, hidden)`; `shape_test` makes torch.fx fail (torch.export captures)."""

    def __init__(self, wrap: Any, shape_test: bool = False) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 3)
        self.wrap, self.shape_test = wrap, shape_test

    def forward(self, x: torch.Tensor) -> Any:
        h = torch.relu(self.b(torch.tanh(self.a(x))))
        if self.shape_test and x.shape[0] > 1:
            h = h * 0.5
        return self.wrap(self.c(h), h)


def causal_lm(logits: torch.Tensor, hidden: torch.Tensor) -> Any:
    from transformers.modeling_outputs import CausalLMOutput
    return CausalLMOutput(logits=logits, hidden_states=(hidden,))


def plain(logits: torch.Tensor, hidden: torch.Tensor) -> dict:
    return {"logits": logits, "hidden": hidden}


def logits(out: Any) -> torch.Tensor:
    return out["logits"] if isinstance(out, dict) else out[0]


CASES = {"namedtuple": (Pair, False, "fx"), "dict": (plain, False, "fx"),
         "model_output_fx": (causal_lm, False, "fx"), "model_output_export": (causal_lm, True, "export")}


@pytest.mark.parametrize("microbatches", [1, 2])
@pytest.mark.parametrize("case", CASES)
def test_drop_in_returns_the_models_class(case: str, microbatches: int) -> None:
    wrap, shape_test, source = CASES[case]
    if wrap is causal_lm:
        pytest.importorskip("transformers")
    torch.manual_seed(0)
    model, x = Net(wrap, shape_test), torch.randn(4, 8)
    assert driver.analyze_module(model, (x,)).source == source
    pm = pipecc.compile(model, (x,), "cpu,cpu", microbatches=microbatches, split_layers=False)
    assert len(pm.plan.stages) == 2
    got, want = pm(x), model(x)
    assert type(got) is type(want)
    if isinstance(want, dict):
        assert list(got.keys()) == list(want.keys())
    values = lambda out: list(out.values()) if isinstance(out, dict) else list(out)  # noqa: E731
    torch.testing.assert_close(values(got), values(want))
    logits(got).square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    logits(model(x)).square().mean().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, msg=n)


def test_gpt2_drop_in_has_logits() -> None:
    """The model the issue names: `out.logits` of a tiny GPT2LMHeadModel (eval, no dropout)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                     use_cache=False, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    pm = pipecc.compile(model, (ids,), "cpu,cpu", microbatches=2, split_layers=False)
    out = pm(ids)
    assert type(out) is transformers.modeling_outputs.CausalLMOutputWithCrossAttentions
    torch.testing.assert_close(out.logits, model(ids).logits, rtol=1e-5, atol=1e-5)


def test_a_class_that_cannot_be_found_gives_the_plain_structure() -> None:
    """`pipecc run` in another process: a class of a model file it imported under another
    name, or one that will not take the items, leaves the plain dict or tuple."""
    t = torch.ones(2)
    env = {"a": t}
    gone = {"dict": [["logits", {"port": "a"}]], "type": "no_such_module_pipecc:Out"}
    assert type(build_output(gone, env)) is dict
    odd = {"tuple": [{"port": "a"}], "type": "collections:OrderedDict"}  # not a tuple class
    assert type(build_output(odd, env)) is tuple
    named = {"tuple": [{"port": "a"}, {"const": 3}], "type": f"{__name__}:Pair"}
    assert build_output(named, env) == Pair(t, 3)
