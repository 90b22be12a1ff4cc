"""The cost model's stash (`pipecc.cost_saved`) against what autograd really saves.

Each model is analysed and its graph module run node by node under
`torch.autograd.graph.saved_tensors_hooks`: the distinct storages the forward hands to the hooks
(parameters, buffers and the model's inputs left out) are what one micro-batch holds for its
backward. The cost model charges every node's `stash_bytes`; the two must agree.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

from pipecc import cost, driver
from pipecc.ir.graph import META_COST

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def saved_bytes(gm: fx.GraphModule, inputs: tuple) -> int:
    """Bytes of the distinct storages autograd saves in one forward of `gm` (train mode),
    parameters, buffers and the graph's inputs left out."""
    left_out = {t.untyped_storage().data_ptr() for t in [*gm.parameters(), *gm.buffers()]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in left_out:
            saved.setdefault(st.data_ptr(), st.nbytes())
        return t

    class Run(fx.Interpreter):
        def run_node(self, n: fx.Node):
            if n.op == "placeholder":
                out = super().run_node(n)
                left_out.update(t.untyped_storage().data_ptr() for t in (out if isinstance(out, (list, tuple)) else [out])
                                if isinstance(t, torch.Tensor))
                return out
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                return super().run_node(n)
    with torch.enable_grad():
        Run(gm).run(*inputs)
    return sum(saved.values())


def charged_bytes(graph) -> int:
    return sum(n.meta[META_COST].values["stash_bytes"] for n in graph.gm.graph.nodes if META_COST in n.meta)


# the bench's small sizes (bench/bench_fidelity.py MODELS), one micro-batch of 4
CASES = ["mlp", "tiny_cnn", "gpt", "bert", "unet", "mobilenet", "two_input"]


@pytest.mark.parametrize("name", CASES)
def test_charged_stash_equals_what_autograd_saves(name: str) -> None:
    """Exact on the zoo and holdout-style models: the per-op rules and the one-charge-per-storage
    sum reproduce autograd's saved storages byte for byte. GPT is costed with flash attention,
    the kernel torch's CPU attention runs (the math path's scores are not saved there)."""
    from bench_fidelity import MODELS
    spec = MODELS[name]
    mb = max(1, spec["batch"] // 4)
    analysis = driver.analyze(ROOT / spec["path"], model_args=dict(spec["args"]), batch_size=mb)
    graph = analysis.graph
    if name == "gpt":
        cost.recost_attention(graph, True)
    torch.manual_seed(0)
    graph.gm.train()
    measured = saved_bytes(graph.gm, analysis.spec.make_inputs(mb))
    assert measured > 0
    assert charged_bytes(graph) == measured


class _Rules(nn.Module):
    """One op of each rule family, each result kept by a later op or not."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
        self.ln = nn.LayerNorm(16)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)                 # not kept: add and layer_norm keep their own things
        h = self.ln(h + 1.0)            # the add's output is kept (layer_norm's input) + mean/rstd
        a = torch.relu(h)               # relu keeps its output, which fc2 keeps too: one storage
        y = self.fc2(self.drop(a))      # dropout: its mask; fc2 keeps the dropped tensor
        s = torch.softmax(y, -1)        # softmax keeps its output
        return (s * y).sum(-1)          # mul keeps both operands: s (already kept) and y


def test_rules_on_a_small_module_match_autograd_and_name_each_charge() -> None:
    torch.manual_seed(0)
    model = _Rules().train()
    x = torch.randn(4, 8)
    graph = driver.analyze_module(model, (x,))
    by_name = {n.name: n.meta[META_COST].values["stash_bytes"] for n in graph.gm.graph.nodes if META_COST in n.meta}
    f32 = 4
    assert by_name["fc1"] == 0                              # a linear keeps its input, not its output
    assert by_name["add"] == 4 * 16 * f32                   # kept by layer_norm
    assert by_name["ln"] == 2 * 4 * f32                     # mean and rstd per row (its output: nobody)
    assert by_name["relu"] == 4 * 16 * f32                  # kept by relu itself, counted once
    assert by_name["drop"] == 2 * 4 * 16 * f32              # the noise (x * noise on a CPU), the output fc2 keeps
    assert by_name["softmax"] == 4 * 8 * f32 and by_name["fc2"] == 4 * 8 * f32
    graph.gm.train()
    torch.manual_seed(0)
    assert charged_bytes(graph) == saved_bytes(graph.gm, (x,))


def test_unknown_ops_keep_the_conservative_charge() -> None:
    """An op without a rule is charged its output and keeps every activation operand."""
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            h = self.fc(x)
            return torch.special.i0(h)  # no rule in the table

    graph = driver.analyze_module(Odd(), (torch.randn(2, 4),))
    by_name = {n.name: n.meta[META_COST].values["stash_bytes"] for n in graph.gm.graph.nodes if META_COST in n.meta}
    assert by_name["fc"] == 2 * 4 * 4  # kept as i0's operand
    assert by_name["special_i0"] == 2 * 4 * 4  # its own output


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.n, self.b = nn.Linear(64, 128), nn.LayerNorm(128), nn.Linear(128, 32)

    def forward(self, x):
        return self.b(self.n(torch.relu(self.a(x)))) * 2.0


@pytest.mark.parametrize("name", ["block", "gpt"])
def test_under_cpu_autocast_the_charge_equals_what_autograd_saves(name: str) -> None:
    """bf16 on the CPU: autocast's casts of the operands a low-precision op keeps, and of the
    weights, are counted where the backward keeps them (`cost_precision.kept_casts`)."""
    if name == "block":
        model, inputs = _Block(), (torch.randn(8, 64),)
        graph = driver.analyze_module(model, inputs)
    else:
        from bench_fidelity import MODELS
        spec = MODELS[name]
        analysis = driver.analyze(ROOT / spec["path"], model_args=dict(spec["args"]), batch_size=2)
        graph, inputs = analysis.graph, analysis.spec.make_inputs(2)
        cost.recost_attention(graph, True)
    cost.annotate(graph, precision="bf16", autocast_device="cpu")
    graph.gm.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        measured = saved_bytes(graph.gm, inputs)
    assert charged_bytes(graph) == measured
