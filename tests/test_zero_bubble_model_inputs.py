"""Zero-bubble W when a weight's branch meets the received input's path twice (issue #19 item 6).

An encoder-decoder's later stage embeds a model input of its own (the decoder's tokens), and
that embedding meets the received encoder output in every cross-attention; T5 adds one
relative position bias in every decoder layer. torch's split makes such a weight one group
whose W runs through the input's path from the later meeting point to the earlier one, over
nodes an earlier group's W had freed ("Trying to backward through the graph a second time").
Checked three ways: the split itself, the engine running zb-h1's I/W on both stages in one
process (against the original model's loss and gradients), and one `pipecc run --verify`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from helpers import pipecc_here
from pipecc import driver
from pipecc.backends.torch.stages import cut_stages, ports_json
from pipecc.runtime.engine import PipelineRuntime, RunConfig
from pipecc.targets.spec import parse_devices

VOCAB, D = 20, 32
MODEL_FILE = '''
import torch
from torch import nn

VOCAB, D = 20, 32


class EncDec(nn.Module):
    """The decoder embeds `tgt`, a model input that only the last stage reads."""

    def __init__(self):
        super().__init__()
        # NOTE: five encoder layers: at this size every op's time is its fixed cost, and the
        # decoder's nine ops need more than three encoder layers before them for the planner to
        # cut inside the encoder (with three it cut after the embedding)
        self.enc1, self.enc2, self.enc3 = nn.Linear(8, D), nn.Linear(D, D), nn.Linear(D, D)
        self.enc4, self.enc5 = nn.Linear(D, D), nn.Linear(D, D)
        self.emb = nn.Embedding(VOCAB, D)
        self.q, self.mix, self.head = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, VOCAB)

    def forward(self, src, tgt):
        mem = torch.tanh(self.enc3(torch.tanh(self.enc2(torch.tanh(self.enc1(src))))))
        mem = torch.tanh(self.enc5(torch.tanh(self.enc4(mem))))
        mem = mem[:, None, :]
        e = self.emb(tgt)
        h = torch.tanh(self.mix(e * mem))  # the embedding meets the encoder output ...
        h = h * e + self.q(e) * mem        # ... and again, after the path through mix
        return self.head(h)


def build_model():
    torch.manual_seed(0)
    return EncDec()


def example_inputs(batch_size=4):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(batch_size, 8, generator=g),
            torch.randint(0, VOCAB, (batch_size, 5), generator=g))
'''
# F of both micro-batches, then zb-h1's split backward on two stages held by one rank
SPLIT_SCHEDULE = "rank 0: 0F0 1F0 0F1 1F1 1I0 0I0 1I1 0I1 1W0 0W0 1W1 0W1"


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def encdec(tmp_path: Path) -> tuple[Path, Any]:
    path = tmp_path / "encdec.py"
    path.write_text(MODEL_FILE)
    from pipecc.frontend.modelfile import import_model_file
    return path, import_model_file(path)


def test_split_backward_of_a_weight_meeting_the_input_twice() -> None:
    """input_backward + weight_backward give one plain backward's gradients."""
    from pipecc.techniques.zero_bubble.runtime import input_backward, weight_backward

    torch.manual_seed(0)
    mix, emb, head = nn.Linear(D, D), nn.Embedding(VOCAB, D), nn.Linear(D, 3)
    params = [*mix.parameters(), *emb.parameters(), *head.parameters()]
    mem, tgt = torch.randn(4, 1, D), torch.randint(0, VOCAB, (4, 5))

    def stage(mem: torch.Tensor) -> torch.Tensor:
        e = emb(tgt)
        h = torch.tanh(mix(e * mem))
        return head(h * e).square().mean()

    stage(mem.requires_grad_()).backward()
    want_mem, want = mem.grad.clone(), [q.grad.clone() for q in params]
    for q in params:
        q.grad = None
    received = mem.detach().requires_grad_()
    loss = stage(received)
    got, groups, walk = input_backward([loss], None, [received], params)
    assert not walk and any(len(g["intermediates"]) > 1 for g in groups)  # the case at issue
    weight_backward(params, groups)
    torch.testing.assert_close(got[0], want_mem)
    for q, w in zip(params, want):
        torch.testing.assert_close(q.grad, w)


def squares(out: Any, _target: Any = None) -> torch.Tensor:
    """Smoke loss over every tensor of an output (a tensor, the last stage's sends, a dict)."""
    values = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else [out]
    return sum(v.float().square().mean() for v in values if isinstance(v, torch.Tensor))


def engine_against_model(model: nn.Module, inputs: tuple, reads_model_input: bool) -> None:
    """Plan for 2 CPUs under zb-h1, cut, and run one step of I/W in this process: the loss and
    every gradient equal the model's (the stages share the model's parameters)."""
    graph = driver.analyze_module(model, inputs)
    plan, graph = driver.plan(graph, parse_devices("2xcpu"), schedule="zb-h1", microbatches=2,
                              replicas=1)
    stages = cut_stages(graph, plan.stage_of())
    assert len(stages) == 2
    later = {str(p.name) for p in stages[1].receives}
    placeholders = {n.name for n in graph.gm.graph.nodes if n.op == "placeholder"}
    assert bool(later & placeholders) == reads_model_input
    params = dict(model.named_parameters())
    for q in params.values():
        q.grad = None
    runtime = PipelineRuntime([s.gm for s in stages], [ports_json(s, 2) for s in stages], 0, 1,
                              RunConfig(SPLIT_SCHEDULE, 2, device="cpu"), squares)
    loss = runtime.step(list(inputs), None)
    got = {n: q.grad.clone() for n, q in params.items() if q.grad is not None}
    for q in params.values():
        q.grad = None
    want_loss = squares(model(*inputs))
    want_loss.backward()
    assert loss == pytest.approx(want_loss.item(), rel=1e-5)
    assert got.keys() == {n for n, q in params.items() if q.grad is not None}
    for name, grad in got.items():
        torch.testing.assert_close(grad, params[name].grad, rtol=1e-4, atol=1e-6, msg=name)


def test_engine_zb_h1_where_the_last_stage_reads_a_model_input(tmp_path: Path) -> None:
    _, module = encdec(tmp_path)
    engine_against_model(module.build_model(), module.example_inputs(4), reads_model_input=True)


def test_engine_zb_h1_on_t5() -> None:
    """T5ForConditionalGeneration, tiny, dropout 0 (another change owns dropout's flag): its
    decoder adds one relative position bias in every layer."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.T5Config(d_model=32, d_ff=64, num_layers=2, num_heads=2, vocab_size=100,
                                   d_kv=16, dropout_rate=0.0, use_cache=False,
                                   decoder_start_token_id=0, pad_token_id=0)
    model = transformers.T5ForConditionalGeneration(config)
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randint(1, 100, (4, 8), generator=g), torch.ones(4, 8, dtype=torch.long),
              torch.randint(1, 100, (4, 6), generator=g))
    engine_against_model(model, inputs, reads_model_input=False)


def test_pipecc_run_verifies_zb_h1_of_an_encoder_decoder(tmp_path: Path) -> None:
    """End to end: two torchrun ranks, zb-h1, outputs and gradients against one process."""
    path, _ = encdec(tmp_path)
    out = tmp_path / "out"
    compiled = pipecc_here("compile", str(path), "-b", "4", "--devices", "2xcpu", "--replicas", "1", "--use-all-devices",
                           "--schedule", "zb-h1", "-m", "2", "-o", str(out), "-q")
    assert compiled.returncode == 0, compiled.stderr
    later = json.loads((out / "stage_1" / "ports.json").read_text())["receives"]
    assert "tgt" in {p["name"] for p in later}
    done = pipecc_here("run", str(out), "--steps", "1", "--verify", "--timeout", "60")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "gradients match the single-process run" in done.stdout, done.stdout
