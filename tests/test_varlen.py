"""Variable sequence lengths (issue #23 item 3): a folder compiled with `--symbol S=0:1 --length
S=LO..HI` runs batches of every length in the range without compiling again, `--verify` checks
each length against the single-process model, and what is outside the declaration is refused in
one line with nothing written.

The slow rows compile the zoo GPT (models/gpt.py, small) and a Hugging Face GPT-2 (the real
suite's small config, tests/real_zoo.py) once each and run `pipecc run --verify` at three
lengths in one torchrun launch; the other rows are the parsers, the port and message plumbing,
and the refusals, in process.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from helpers import ROOT, pipecc_here, run_cli
from pipecc.errors import PipeccError, UsageError
from pipecc.runtime.lengths import Lengths, mark_dynamic, parse_declaration, parse_run, run_lengths
from pipecc.runtime.ports import Port, StagePorts

GPT = [str(ROOT / "models" / "gpt.py"), "-b", "4", "--model-arg", "n_layer=2", "--model-arg", "n_head=2",
       "--model-arg", "n_embd=32", "--model-arg", "vocab_size=101", "--model-arg", "block_size=64",
       "--model-arg", "seq_len=16"]
PLAN = ["--devices", "2xcpu", "--replicas", "1", "--use-all-devices", "-m", "2"]

HF_GPT2 = '''\
"""A Hugging Face GPT-2 at the real suite's small config (random weights), at any seq_len."""
import torch
import torch.nn.functional as F
import transformers


def build_model():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=32, bos_token_id=0, eos_token_id=0,
        use_cache=False))


def _tokens(batch_size, seq_len):
    return torch.randint(0, 100, (batch_size, seq_len + 1), generator=torch.Generator().manual_seed(0))


def example_inputs(batch_size=1, seq_len=8):
    return (_tokens(batch_size, seq_len)[:, :-1],)


def example_target(batch_size=1, seq_len=8):
    return _tokens(batch_size, seq_len)[:, 1:]


def loss_fn(outputs, target):
    return F.cross_entropy(outputs["logits"].flatten(0, 1), target.flatten())
'''

# a model whose input makers take no seq_len (every other way to vary the length is the model's)
NO_SEQ_LEN = '''\
import torch
from torch import nn


def build_model():
    return nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))


def example_inputs(batch_size=1):
    return (torch.randint(0, 50, (batch_size, 8), generator=torch.Generator().manual_seed(0)),)
'''

# input makers that take seq_len but ignore it
IGNORES_SEQ_LEN = NO_SEQ_LEN.replace("def example_inputs(batch_size=1):", "def example_inputs(batch_size=1, **_):")


# ----------------------------------------------------------------------------- the declarations
def test_declaration_forms():
    span = parse_declaration("S=16..64")
    assert span.span and (span.lo, span.hi) == (16, 64) and span.values == (16, 28, 40, 52, 64)
    assert sum(span.weights) == pytest.approx(1.0) and span.declared() == "S=16..64"
    listed = parse_declaration("S=64,16,32")
    assert listed.values == (16, 32, 64) and listed.weights == pytest.approx((1 / 3,) * 3)
    assert listed.declared() == "S=16,32,64"
    weighted = parse_declaration("S=16:0.5,32:0.3,64:0.2")
    assert weighted.values == (16, 32, 64) and weighted.weights == pytest.approx((0.5, 0.3, 0.2))
    assert Lengths.from_json(json.loads(json.dumps(weighted.to_json()))) == weighted
    assert parse_run("S=32") == ("S", [32]) and parse_run("S=16,64,16") == ("S", [16, 64, 16])


@pytest.mark.parametrize("item, says", [
    ("S", "is not NAME=LENGTHS"), ("S=", "is not NAME=LENGTHS"), ("1S=4", "is not NAME=LENGTHS"),
    ("S=64..16", "the range 64..16 is empty"), ("S=a..8", "'a' is not a whole number"),
    ("S=0..8", "at least 1"), ("S=16:0.5,32", "a weight to every length or to none"),
    ("S=16:-1", "not a positive number"), ("S=16,16", "listed twice"),
])
def test_declaration_malformed(item, says):
    with pytest.raises(UsageError, match=says):
        parse_declaration(item)


def test_run_lengths_against_the_declaration():
    declared = parse_declaration("S=16..64")
    assert run_lengths("S=16,64,40", declared) == [16, 64, 40]
    assert run_lengths(None, declared) == [] and run_lengths(None, None) == []
    with pytest.raises(PipeccError, match=r"S=65 is above the maximum 64 .*--length S=16\.\.64"):
        run_lengths("S=32,65", declared)
    with pytest.raises(PipeccError, match="S=8 is below the minimum 16"):
        run_lengths("S=8", declared)
    with pytest.raises(UsageError, match="length symbol is S, not T"):
        run_lengths("T=16", declared)
    with pytest.raises(UsageError, match="compiled without a declared length"):
        run_lengths("S=16", None)
    with pytest.raises(UsageError, match="not a whole number"):
        run_lengths("S=16,", declared)


# ----------------------------------------------------------------------------- ports and messages
def test_ports_mark_the_dims_of_the_length_symbol():
    spec = {"receives": [{"name": "h", "kind": "tensor", "dtype": "float32", "shape": [8, 64, 32],
                          "shape_expr": ["B", "S", 32], "batch_dim": 0},
                         {"name": "f", "kind": "tensor", "dtype": "float32", "shape": [512, 32],
                          "shape_expr": ["B*S", 32], "batch_dim": 0},
                         {"name": "t", "kind": "tuple", "items": [
                             {"name": "a", "kind": "tensor", "dtype": "float32", "shape": [8, 64],
                              "shape_expr": ["B", "S"], "batch_dim": 0},
                             {"name": "n", "kind": "object"}]},
                         {"name": "m", "kind": "tensor", "dtype": "float32", "shape": [8, 16],
                          "shape_expr": ["B", "SS"], "batch_dim": 0}], "sends": []}
    unmarked = StagePorts.from_json(spec)  # a folder without a declared length: nothing varies
    assert all(p.dynamic == () for p in unmarked.in_leaves)
    marked = StagePorts.from_json(mark_dynamic(spec, "S"))
    assert [p.dynamic for p in marked.in_leaves] == [(1,), (0,), (1,), (), ()]
    h = marked.in_leaves[0]
    assert h.matches((8, 17, 32), (8, 64, 32)) and not h.matches((8, 17, 31), (8, 64, 32))
    assert not h.matches((8, 17), (8, 64, 32))


class _Loopback:
    """A wire that keeps what is sent by tag and hands it to the receive with that tag."""

    def __init__(self):
        self.sent: dict[int, torch.Tensor] = {}

    def send(self, tensor, peer, tag, what, key):
        self.sent[tag] = tensor.clone()

    def recv(self, buffers, peer, tags, what):
        for b, t in zip(buffers, tags):
            got = self.sent.pop(t)
            assert got.shape == b.shape, (got.shape, b.shape)
            b.copy_(got)


def _messages(ports: StagePorts):
    from types import SimpleNamespace

    from pipecc.ir.schedule import one_f_one_b
    from pipecc.runtime.messages import Messages
    from pipecc.runtime.wire import peer_rank
    schedule = one_f_one_b(2, 2)
    runner = SimpleNamespace(ports=ports, grad_sends=lambda: ports.in_leaves, grad_receives=lambda: ports.out_leaves)
    ctx = SimpleNamespace(schedule=schedule, device=torch.device("cpu"), wire=_Loopback(), amp_dtype=None,
                          peer=lambda a: peer_rank(schedule, a), stage_ids=(0, 1), split_of=lambda s: 2)
    return Messages(ctx, lambda s: runner), ctx


@pytest.mark.parametrize("length", [5, 64])
def test_a_message_carries_its_shape(length):
    """A sent tensor of any length arrives whole: its shape travels in the header before it."""
    from pipecc.ir.schedule.actions import Action, ActionKind
    spec = {"receives": [{"name": "h", "kind": "tensor", "dtype": "float32", "shape": [8, 64, 3],
                          "shape_expr": ["B", "S", 3], "batch_dim": 0},
                         {"name": "n", "kind": "tensor", "dtype": "int64", "shape": [8], "shape_expr": ["B"],
                          "batch_dim": 0}], "sends": []}
    ports = StagePorts.from_json(mark_dynamic(spec, "S"))
    messages, rt = _messages(ports)
    h, n = torch.randn(4, length, 3), torch.arange(4)
    messages.send(Action(ActionKind.SEND_F, 0, 1), [h, n], ports.in_leaves)
    assert len(rt.wire.sent) == 3  # the header, then the two tensors
    got = messages.recv(Action(ActionKind.RECV_F, 1, 1), ports.in_leaves)
    torch.testing.assert_close(got[0], h)
    torch.testing.assert_close(got[1], n)


def test_a_fixed_message_sends_no_header():
    from pipecc.ir.schedule.actions import Action, ActionKind
    spec = {"receives": [{"name": "h", "kind": "tensor", "dtype": "float32", "shape": [8, 6, 3],
                          "shape_expr": ["B", "S", 3], "batch_dim": 0}], "sends": []}
    ports = StagePorts.from_json(spec)  # --symbol S without --length: S stays at the example's
    messages, rt = _messages(ports)
    messages.send(Action(ActionKind.SEND_F, 0, 0), [torch.randn(4, 6, 3)], ports.in_leaves)
    assert len(rt.wire.sent) == 1


# ----------------------------------------------------------------------------- refusals at compile
@pytest.mark.parametrize("flags, code, says", [
    (["--length", "S=8..32"], 2, "no --symbol declares S; say which input dim it is"),
    (["--symbol", "S=0:1", "--length", "B=8..32"], 2, "B is the batch size"),
    (["--symbol", "S=0:1", "--length", "S=32..8"], 2, "the range 32..8 is empty"),
    (["--symbol", "S=0:1", "--length", "S=8..32", "--length", "S=4..5"], 2, "--length is given 2 times"),
    (["--symbol", "S=0:1", "--length", "S=8..32", "--bipartition", "auto"], 2, "--bipartition is planned for one"),
    (["--symbol", "S=0:1", "--length", "S=8..32", "--devices", "2xu250"], 2, "FPGA stages are built for one shape"),
])
def test_compile_refuses_a_bad_declaration(flags, code, says, tmp_path, capsys):
    out = tmp_path / "out"
    plan = PLAN if "--devices" not in flags else ["--replicas", "1", "-m", "2"]
    rc, _, err = run_cli(["compile", *GPT, *plan, *flags, "-o", str(out)], capsys)
    assert rc == code and says in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


@pytest.mark.parametrize("options, flag", [
    (dict(microbatch_sizes=[3, 5]), "--microbatch-sizes (unequal micro-batches)"),
    (dict(microbatch_sizes="auto"), "--microbatch-sizes (unequal micro-batches)"),
    (dict(activation_balancing="on"), "--activation-balancing on"),
    (dict(bipartition="auto"), "--bipartition"),
])
def test_each_switch_that_fixes_one_shape_is_refused_with_a_length(options, flag):
    """Each technique names its own switch (its rule's `one_shape`); the defaults pass."""
    from types import SimpleNamespace
    from pipecc import varlen
    from pipecc.passes.plan_options import PlanOptions
    lengths, cluster = parse_declaration("S=8..32"), SimpleNamespace(devices=[])
    varlen.check_options(PlanOptions(), cluster, lengths)
    with pytest.raises(UsageError, match=rf"^--length S=8\.\.32: {re.escape(flag)} is planned for one length"):
        varlen.check_options(PlanOptions(**options), cluster, lengths)


@pytest.mark.parametrize("source, flags, says", [
    ("mlp", ["--symbol", "S=0:1", "--length", "S=32..64"], "dim 1 of input 0 is not dynamic in this model"),
    (NO_SEQ_LEN, ["--symbol", "S=0:1", "--length", "S=4..16"], "takes no seq_len argument"),
    (IGNORES_SEQ_LEN, ["--symbol", "S=0:1", "--length", "S=4..16"], "gives input 0 a dim 1 of 8, not 4"),
    ("gpt", ["--symbol", "S=0:1", "--length", "S=8..80"], "failed at seq_len=80: ValueError: seq_len=80 exceeds "
                                                         "block_size=64"),
])
def test_compile_refuses_what_cannot_vary(source, flags, says, tmp_path, capsys):
    if source == "mlp":
        model = [str(ROOT / "models" / "mlp.py"), "-b", "4"]
    elif source == "gpt":
        model = GPT
    else:
        path = tmp_path / "model.py"
        path.write_text(source)
        model = [str(path), "-b", "4"]
    out = tmp_path / "out"
    rc, _, err = run_cli(["compile", *model, *PLAN, *flags, "-o", str(out)], capsys)
    assert rc == 1 and says in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


# ----------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def gpt_folder(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("varlen") / "gpt"
    done = pipecc_here("compile", *GPT, *PLAN, "--symbol", "S=0:1", "--length", "S=8:0.5,20:0.3,48:0.2",
                       "-o", str(out))
    assert done.returncode == 0, done.stderr
    return out


@pytest.mark.slow
def test_gpt_runs_and_verifies_three_lengths(gpt_folder):
    marker = json.loads((gpt_folder / "pipecc.json").read_text())
    assert marker["lengths"]["max"] == 48 and marker["lengths"]["values"] == [8, 20, 48]
    ports = json.loads((gpt_folder / "stage_1" / "ports.json").read_text())
    assert ports["receives"][0]["shape"][1] == 48  # planned (and sized) at the maximum
    done = pipecc_here("run", str(gpt_folder), "--length", "S=8,48,20", "--verify", "--steps", "4")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert [ln for ln in lines if ln.startswith("verify at")] == ["verify at S=8:", "verify at S=48:",
                                                                  "verify at S=20:"]
    assert sum("verify: outputs, loss and" in ln and "match the single-process run" in ln for ln in lines) == 3
    assert sum(ln.startswith("step ") for ln in lines) == 4


@pytest.mark.slow
def test_gpt_refuses_a_length_outside_the_range(gpt_folder, tmp_path):
    ckpt = tmp_path / "ckpt"
    for length, says in (("S=49", "S=49 is above the maximum 48"), ("S=7", "S=7 is below the minimum 8")):
        done = pipecc_here("run", str(gpt_folder), "--length", length, "--checkpoint-dir", str(ckpt))
        assert done.returncode == 1 and says in done.stderr and len(done.stderr.strip().splitlines()) == 1
        assert not ckpt.exists()  # nothing written


@pytest.mark.slow
def test_inspect_shows_the_stage_times_over_the_lengths(gpt_folder, capsys):
    rc, out, _ = run_cli(["inspect", str(gpt_folder)], capsys)
    assert rc == 0
    text = out[out.index("lengths --length"):]
    assert "planned at S=48 (the maximum" in text and "over the weighted lengths" in text
    rows = [ln.split()[0] for ln in text.splitlines()[3:] if ln.strip()]
    assert rows == ["8", "20", "48"]
    rc, out, _ = run_cli(["inspect", str(gpt_folder), "--format", "json"], capsys)
    data = json.loads(out)["lengths"]
    plan = json.loads((gpt_folder / "plan.json").read_text())
    top = data["table"][-1]
    assert top["length"] == 48 and top["step_s"] == pytest.approx(plan["predicted_iteration_s"])
    for row, planned in zip(top["stages"], plan["stages"]):  # the table at the maximum is the plan's
        assert row == pytest.approx([planned["forward_s"], planned["backward_s"]])
    steps = [r["step_s"] for r in data["table"]]
    # shorter batches are faster; NOTE: not in proportion: at this size the fixed costs (per
    # call, per micro-batch) are most of a stage's time
    assert steps == sorted(steps) and steps[0] < steps[-1]
    assert data["expected_step_s"] == pytest.approx(0.5 * steps[0] + 0.3 * steps[1] + 0.2 * steps[2])


def test_no_declaration_no_lengths(tmp_path, capsys):
    """Without --length the folder is what it was: pipecc.json has no lengths, so no port varies
    and no message carries a header (`test_a_fixed_message_sends_no_header`)."""
    out = tmp_path / "out"
    rc, _, err = run_cli(["compile", *GPT, *PLAN, "--symbol", "S=0:1", "-o", str(out)], capsys)
    assert rc == 0, err
    assert "lengths" not in json.loads((out / "pipecc.json").read_text())
    assert "lengths" not in json.loads((out / "plan.json").read_text())["options"]


@pytest.mark.slow
@pytest.mark.real
def test_hugging_face_gpt2_runs_and_verifies_three_lengths(tmp_path):
    model = tmp_path / "hf_gpt2.py"
    model.write_text(HF_GPT2)
    out = tmp_path / "out"
    done = pipecc_here("compile", str(model), "-b", "4", *PLAN, "--symbol", "S=0:1", "--length", "S=8..32",
                       "-o", str(out))
    assert done.returncode == 0, done.stderr
    done = pipecc_here("run", str(out), "--length", "S=8,32,13", "--verify", "--steps", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert [ln for ln in lines if ln.startswith("verify at")] == ["verify at S=8:", "verify at S=32:",
                                                                  "verify at S=13:"]
    assert sum("match the single-process run" in ln for ln in lines) == 3
