"""Bi-Partition at run time ("ship" mode): the compiled folder (cores + segments per worker),
`pipecc run --verify` against one process, planted bugs that --verify or training must catch,
the replica refresh over several steps, `pipecc.load`, and the compile-time refusals.

One hand-written plan over a residual MLP (`RESMLP`, two skip connections), 3 workers:
forward cuts a = (0, 4, 6, 11), backward cuts c = (0, 2, 8, 11), so boundary 0 has a segment
[a1, relu_1] running forward on worker 0 and backward on worker 1 (a > c; the skip x crosses
it) and boundary 1 a segment [b1, tanh] running forward on worker 2 and backward on worker 1
(c > a; the skip crosses it too). Multi-rank costs: one torchrun launch (3 gloo ranks); the
rest runs every worker in this process (`--schedule interleaved`, same numerics).
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import torch

from helpers import pipecc_here, run_cli, zoo_path
from pipecc import driver
from pipecc.techniques.bipartition.codegen import payload_notes
from pipecc import techniques
from pipecc.techniques.bipartition.plan import graph_requires
from pipecc.errors import PipeccError
from pipecc.runtime import dist
from pipecc.runtime.engine import PipelineRuntime
from pipecc.techniques.bipartition.runtime_segments import SegmentRunner
from pipecc.runtime.stagefile import load_stage

pytestmark = pytest.mark.xdist_group(name="bipartition_run")

RESMLP = '''
import torch
import torch.nn.functional as F
from torch import nn


class ResMLP(nn.Module):
    def __init__(self, d=16, h=32, c=5, bn=False, inplace=False):
        super().__init__()
        self.inplace = inplace
        self.inp = nn.Linear(d, h)
        self.a1, self.a2 = nn.Linear(h, h), nn.Linear(h, h)
        self.b1, self.b2 = nn.Linear(h, h), nn.Linear(h, h)
        self.norm = nn.BatchNorm1d(h) if bn else None
        self.out = nn.Linear(h, c)

    def forward(self, x):
        x = self.inp(x).relu_() if self.inplace else torch.relu(self.inp(x))
        x = x + self.a2(torch.relu(self.a1(x)))
        h = self.b1(x)
        x = x + self.b2(torch.tanh(self.norm(h) if self.norm is not None else h))
        return self.out(x)


def build_model(bn=False, inplace=False, **_):
    torch.manual_seed(0)
    return ResMLP(bn=bn == "1" or bn is True, inplace=inplace == "1" or inplace is True)


def example_inputs(batch_size=1, **_):
    return (torch.randn(batch_size, 16, generator=torch.Generator().manual_seed(1)),)


def example_target(batch_size=1, **_):
    return torch.randint(5, (batch_size,), generator=torch.Generator().manual_seed(2))


def loss_fn(outputs, target):
    return F.cross_entropy(outputs, target)
'''
A, C = (0, 4, 6, 11), (0, 2, 8, 11)  # forward and backward cuts over the 11 nodes
# the zoo MLP on which the planner keeps a cut pair (docs/bipartition.md)
MLP_PAIR_FLAGS = ["--model-arg", "in_features=256", "--model-arg", "hidden=1024", "--model-arg", "depth=3",
            "--model-arg", "num_classes=256"]


def _analysis(folder: Path, bn: bool = False, inplace: bool = False):
    path = folder / "resmlp.py"
    path.write_text(RESMLP)
    args = {**({"bn": "1"} if bn else {}), **({"inplace": "1"} if inplace else {})}
    analysis = driver.analyze(path, batch_size=6, model_args=args or None)
    plan, graph = driver.plan(analysis, "cpu,cpu,cpu", microbatches=3, schedule="1f1b", replicas=1,
                              split_layers=False)
    plan.model_path = str(path)
    plan.model_args = args
    return analysis, plan, graph


def _bipartition(plan, a=A, c=C, mode: str = "ship"):
    plan = copy.deepcopy(plan)
    order = [n for s in plan.stages for n in s.nodes]
    for j, s in enumerate(plan.stages):
        s.nodes, s.backward_nodes = order[a[j]:a[j + 1]], order[c[j]:c[j + 1]]
    plan.bipartition_mode = mode
    return plan


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    return _analysis(tmp_path_factory.mktemp("bip_model"))


@pytest.fixture(scope="module")
def bip_out(tmp_path_factory, planned) -> Path:
    analysis, plan, graph = planned
    out = tmp_path_factory.mktemp("bip") / "out"
    driver.compile(analysis, _bipartition(plan), graph, out)
    return out


def test_packed_message_round_trip() -> None:
    """A message with saved tensors travels as one payload (``wire.pack_tensors``): odd byte
    counts, several dtypes and a non-contiguous value come back equal, as aligned views."""
    from pipecc.runtime.wire import ALIGN, pack_tensors, packed_layout, packed_views

    values = [torch.randn(3, 5).t(), torch.arange(3, dtype=torch.uint8), torch.tensor([7, -1], dtype=torch.int64),
              torch.zeros(0, 4), torch.tensor([True, False, True])]
    payload = pack_tensors(values, torch.device("cpu"))
    specs = [(tuple(v.shape), v.dtype) for v in values]
    offsets, total = packed_layout(specs)
    assert payload.numel() == total and all(o % ALIGN == 0 for o in offsets)
    back = packed_views(payload.clone(), specs)
    for v, b in zip(values, back):
        assert b.dtype == v.dtype and torch.equal(b, v)


def test_folder_holds_cores_and_segments_with_owner_and_replica(bip_out: Path) -> None:
    marker = json.loads((bip_out / "pipecc.json").read_text())
    assert marker["bipartition"] == "ship"
    specs = [json.loads((bip_out / f"stage_{j}" / "ports.json").read_text()) for j in range(3)]
    segs = {j: {s["boundary"]: (s["fp_worker"], s["bp_worker"]) for s in spec["bipartition"]["segments"]}
            for j, spec in enumerate(specs)}
    assert segs == {0: {0: (0, 1)}, 1: {0: (0, 1), 1: (2, 1)}, 2: {1: (2, 1)}}
    # the same generated segment code in both workers' folders
    for b, (j, k) in {0: (0, 1), 1: (1, 2)}.items():
        assert (bip_out / f"stage_{j}" / f"segment_{b}.py").read_text() == \
            (bip_out / f"stage_{k}" / f"segment_{b}.py").read_text()
    # forward ports are the forward ranges' (a_j); gradients cross at c_j
    assert [p["producer"] for p in specs[0]["sends"]] == ["relu", "relu_1"]
    assert [p["producer"] for p in specs[1]["bipartition"]["grad_sends"]] == ["relu"]
    assert [p["producer"] for p in specs[1]["bipartition"]["grad_receives"]] == ["add", "tanh"]
    # owners register the segment's parameters (optimizer, checkpoints, --verify); replicas do not
    worker0, worker1 = load_stage(bip_out / "stage_0")[0], load_stage(bip_out / "stage_1")[0]
    assert sorted(type(worker0).PARAM_NAMES.values()) == ["inp.bias", "inp.weight"]
    assert sorted(type(worker1).PARAM_NAMES.values()) == ["a1.bias", "a1.weight", "a2.bias", "a2.weight",
                                                          "b1.bias", "b1.weight"]
    assert len(list(worker0.parameters())) == 2 and len(list(worker1.parameters())) == 6


@pytest.mark.slow  # a torchrun launch of several processes (make test-fast leaves it out)
def test_torchrun_verify_matches_one_process(bip_out: Path, planned, tmp_path) -> None:
    # 4 micro-batches of 6 samples (2, 2, 1, 1): the segments' graphs are traced per shape
    steps, lr = 3, 0.5
    result = pipecc_here("run", str(bip_out), "--verify", "--steps", str(steps), "--microbatches", "4", "--lr", str(lr),
                         "--checkpoint-dir", str(tmp_path / "ckpt"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "verify: outputs, loss and 12 gradients match the single-process run" in result.stdout
    assert sum(line.startswith("step ") for line in result.stdout.splitlines()) == steps
    # the trained weights: steps 2 and 3 ran their segments' forwards on replicas refreshed over
    # the wire (posted during the step, received into the replicas' parameters)
    want = _reference(Path(planned[1].model_path), steps, lr)
    got = _trained(bip_out, tmp_path / "ckpt", steps)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, rtol=1e-4, atol=1e-5, msg=name)


def _run_here(out: Path, *flags: str) -> int:
    """Every worker in this process (no torchrun): the interleaved schedule over 3 stages."""
    return dist.main([str(out), "--schedule", "interleaved", *flags])


def test_one_process_verify_passes_and_a_dropped_saved_tensor_fails(bip_out: Path, monkeypatch, capsys) -> None:
    assert _run_here(bip_out, "--verify", "--steps", "0") == 0
    assert "12 gradients match" in capsys.readouterr().out
    forward = SegmentRunner.forward

    def drop_first(self, env, training):  # a planted bug: one saved tensor never arrives
        saved = forward(self, env, training)
        return [torch.zeros_like(saved[0]), *saved[1:]] if saved else saved

    monkeypatch.setattr(SegmentRunner, "forward", drop_first)
    assert _run_here(bip_out, "--verify", "--steps", "0") == 1
    assert "gradient of" in capsys.readouterr().err


def _trained(out: Path, ckpt: Path, steps: int) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the model's names (owners only: each name once)."""
    from safetensors.torch import load_file

    got: dict[str, torch.Tensor] = {}
    tensors = {}  # one file per rank (torchrun), or stage_0 holding every stage (one process)
    for file in sorted((ckpt / f"step_{steps}").glob("stage_*.safetensors")):
        tensors.update(load_file(str(file)))
    for j in range(3):
        names = type(load_stage(out / f"stage_{j}")[0]).PARAM_NAMES
        for key, t in tensors.items():
            if key.startswith(f"model.{j}."):
                name = names[key[len(f"model.{j}."):]]
                assert name not in got, f"{name} saved twice (a replica in a checkpoint)"
                got[name] = t
    return got


def _reference(model_file: Path, steps: int, lr: float) -> dict[str, torch.Tensor]:
    import importlib.util

    spec = importlib.util.spec_from_file_location("resmlp_ref", model_file)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model = mod.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    x, = mod.example_inputs(6)
    t = mod.example_target(6)
    for _ in range(steps):
        opt.zero_grad()
        mod.loss_fn(model(x), t).backward()
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def test_training_refreshes_replicas_and_a_skipped_refresh_is_caught(bip_out: Path, planned, tmp_path,
                                                                     monkeypatch) -> None:
    steps, lr = 3, 0.5
    want = _reference(Path(planned[1].model_path), steps, lr)
    assert _run_here(bip_out, "--steps", str(steps), "--lr", str(lr), "--checkpoint-dir", str(tmp_path / "a")) == 0
    got = _trained(bip_out, tmp_path / "a", steps)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, rtol=1e-4, atol=1e-5, msg=name)
    # a planted bug: the replicas keep their first weights
    monkeypatch.setattr(PipelineRuntime, "after_optimizer_step", lambda self: None)
    assert _run_here(bip_out, "--steps", str(steps), "--lr", str(lr), "--checkpoint-dir", str(tmp_path / "b")) == 0
    stale = _trained(bip_out, tmp_path / "b", steps)
    assert any(not torch.allclose(stale[n], want[n], rtol=1e-4, atol=1e-5) for n in want)


def test_load_gives_the_models_gradients(bip_out: Path, planned) -> None:
    import pipecc

    pm = pipecc.load(bip_out)
    model = _reference(Path(planned[1].model_path), 0, 0.1)  # the initial weights
    assert sorted(dict(pm.named_parameters())) == sorted(model)
    x = torch.randn(6, 16)
    pm(x).square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in pm.parameters())


@pytest.mark.parametrize("change, message", [
    (lambda p: setattr(p, "bipartition_mode", "recompute"), "'recompute' is (costed only|only costed)"),
    (lambda p: setattr(p, "schedule", "zb-h1"), "zb-h1"),
    (lambda p: setattr(p, "schedule", "interleaved"), "interleaved"),
    (lambda p: setattr(p, "bipartition_mode", ""), "mode"),
    (lambda p: setattr(p.stages[1], "recompute", True), "recompute"),
])
def test_compile_refuses_what_the_runtime_cannot_run(planned, tmp_path, change, message) -> None:
    analysis, plan, graph = planned
    plan = _bipartition(plan)
    change(plan)
    out = tmp_path / "out"
    with pytest.raises(PipeccError, match=message) as info:
        driver.compile(analysis, plan, graph, out)
    assert "\n" not in str(info.value) and not out.exists()
    assert re.search(message, techniques.requires(plan, techniques.COMPILED))  # the one rule compile asked


def test_compile_refuses_an_empty_core(planned, tmp_path) -> None:
    analysis, plan, graph = planned
    out = tmp_path / "out"
    with pytest.raises(PipeccError, match="no node whose forward and backward"):  # worker 1: (4, 4]
        driver.compile(analysis, _bipartition(plan, (0, 2, 4, 11), (0, 4, 6, 11)), graph, out)
    assert not out.exists()


def test_compile_refuses_batchnorm_in_a_segment(tmp_path) -> None:
    analysis, plan, graph = _analysis(tmp_path, bn=True)
    order = [n for s in plan.stages for n in s.nodes]
    assert order[7] == "norm"  # b1's BatchNorm: inside boundary 1's segment
    out = tmp_path / "out"
    bad = _bipartition(plan, (0, 4, 6, 12), (0, 2, 9, 12))
    with pytest.raises(PipeccError, match="BatchNorm"):
        driver.compile(analysis, bad, graph, out)
    assert not out.exists()
    assert "BatchNorm" in graph_requires(graph, bad)  # the graph's part of the rule


def _segments(out: Path, j: int) -> list[dict]:
    return json.loads((out / f"stage_{j}" / "ports.json").read_text())["bipartition"]["segments"]


def test_compile_traces_segments_without_touching_the_model_and_notes_a_payload_off_the_plan(
        planned, tmp_path) -> None:
    """Compile traced both segments: each one's saved-tensor bytes per micro-batch (2 samples)
    are in both workers' ports.json. Boundary 0's segment [a1, relu_1] sends its input x and
    relu_1's output (2 x 32 floats each; a1's transposed weight is recomputed by the owner),
    boundary 1's [b1, tanh] its input x and tanh's output: 512 B each. The hand-written plan
    costs 0 B (its figures are the single cut's), so the compile notes it; the model's weights
    and the random state are as before."""
    analysis, plan, graph = planned
    weights = {k: v.clone() for k, v in graph.gm.state_dict().items()}
    rng = torch.get_rng_state()
    done = driver.compile(analysis, _bipartition(plan), graph, tmp_path / "out")
    assert torch.equal(torch.get_rng_state(), rng)
    after = graph.gm.state_dict()
    assert sorted(after) == sorted(weights) and all(torch.equal(after[k], v) for k, v in weights.items())
    saved = {j: {s["boundary"]: s["saved_bytes"] for s in _segments(tmp_path / "out", j)} for j in range(3)}
    assert saved == {0: {0: 512}, 1: {0: 512, 1: 512}, 2: {1: 512}}
    notes = [n for n in done.notes if "Bi-Partition" in n]
    assert len(notes) == 2 and "stage 0 sends 512 B" in notes[0] and "stage 2 sends 512 B" in notes[1]


def test_payload_note_only_beyond_the_tolerance(bip_out: Path, planned) -> None:
    plan = _bipartition(planned[1])
    plan.stages[0].extra_send_bytes, plan.stages[2].extra_send_bytes = 512, 512
    assert payload_notes(plan, bip_out) == []
    plan.stages[0].extra_send_bytes = 640  # 512 is 20 % below: within 25 %
    assert payload_notes(plan, bip_out) == []
    plan.stages[2].extra_send_bytes = 1024  # the forward worker of boundary 1 sends half the plan's
    notes = payload_notes(plan, bip_out)
    assert len(notes) == 1 and "stage 2 sends 512 B" in notes[0] and "1024 B" in notes[0]


def test_a_segment_that_writes_its_input_in_place_compiles_and_verifies(tmp_path, capsys) -> None:
    """`self.inp(x).relu_()` with the cut pair putting relu_ first in a segment writes the
    segment's input in place. The generated segment clones that input first (as every stage
    does, backends/torch/inplace.py), so AOTAutograd splits it and the workers give the model's
    gradients; before the clone, compile's trace refused it."""
    analysis, plan, graph = _analysis(tmp_path, inplace=True)
    order = [n for s in plan.stages for n in s.nodes]
    assert order[1] == "relu_"
    out = tmp_path / "out"
    driver.compile(analysis, _bipartition(plan, (0, 3, 6, 11), (0, 1, 8, 11)), graph, out)
    segment = next((out / "stage_0").glob("segment_*.py")).read_text()
    assert ".clone()  # mutated in place below" in segment
    assert _run_here(out, "--verify", "--steps", "0") == 0
    assert "gradients match" in capsys.readouterr().out


def test_cli_compile_refuses_when_the_trace_fails(tmp_path, capsys, monkeypatch) -> None:
    """Whatever AOTAutograd raises (here planted): exit 1, one line naming the segment, no OUT."""
    from pipecc.techniques.bipartition import runtime_segments as segments

    def fail(*_args, **_kwargs):
        raise RuntimeError("planted: cannot partition\nsecond line")

    monkeypatch.setattr(segments, "trace_segment", fail)
    out = tmp_path / "out"
    code, stdout, err = run_cli(["compile", str(zoo_path("mlp")), "-b", "32", "-m", "8", "--devices", "2xcpu",
                                 "--replicas", "1", "--use-all-devices", "--schedule", "1f1b", "--no-split-layers", "--bipartition",
                                 "auto", *MLP_PAIR_FLAGS, "-o", str(out)], capsys)
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith("pipecc: error: the segment at boundary 0 (nodes ")
    assert "(RuntimeError: planted: cannot partition); re-plan with --bipartition off" in err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_run_refuses_a_schedule_the_workers_cannot_run(bip_out: Path, capsys) -> None:
    code, _, err = run_cli(["run", str(bip_out), "--schedule", "zb-h1"], capsys)
    assert code == 2 and err.count("\n") == 1 and "1f1b or gpipe" in err


def test_planner_made_plan_compiles_and_verifies(tmp_path, capsys) -> None:
    """`pipecc compile --bipartition auto` (a plan the planner keeps: FP cut [4], BP cut [2] on
    an MLP whose first layers are wide), then every worker in this process with --verify; the
    saved tensors that travel are the plan's extra_send_bytes (the transposed weight does not)."""
    out = tmp_path / "out"
    code, stdout, err = run_cli(["compile", str(zoo_path("mlp")), "-b", "32", "-m", "8", "--devices", "2xcpu",
                                 "--replicas", "1", "--use-all-devices", "--schedule", "1f1b", "--no-split-layers",
                                 "--bipartition", "auto", *MLP_PAIR_FLAGS, "-o", str(out)], capsys)
    assert code == 0, err
    assert "Bi-Partition (ship): 1 segment(s)" in stdout
    assert "note: Bi-Partition" not in stdout  # the traced payload is the plan's (below)
    plan = json.loads((out / "plan.json").read_text())
    assert plan["bipartition_mode"] == "ship" and plan["stages"][1]["backward_nodes"]
    assert _run_here(out, "--verify", "--steps", "0") == 0
    assert "gradients match" in capsys.readouterr().out
    worker = load_stage(out / "stage_0")[0]
    runner = next(r for r in worker.runners if r.role == "fp")
    graphs = runner.graphs([(4, *p.shape[1:]) for p in runner.ports.receives])
    sent = sum(torch.Size(graphs.saved[i][0]).numel() * 4 for i in graphs.sent)
    assert sent == plan["stages"][0]["extra_send_bytes"]
    assert [s["saved_bytes"] for s in _segments(out, 0)] == [sent]  # what compile traced


def test_mirrored_cuts_verify(planned, tmp_path, capsys) -> None:
    """The other way round: worker 1 runs both segments' forwards (boundary 0: c > a, boundary 1:
    a > c) and workers 0 and 2 their backwards."""
    analysis, plan, graph = planned
    out = tmp_path / "out"
    driver.compile(analysis, _bipartition(plan, C, A), graph, out)
    assert _run_here(out, "--verify", "--steps", "0") == 0
    assert "12 gradients match" in capsys.readouterr().out


def test_a_saved_tensor_and_its_detach_travel_once() -> None:
    """AOTAutograd saves a ReLU's output for the ReLU's backward and, as a detach of it, for
    the next layer's weight gradient: one storage, sent once (the planner charges it once); the
    backward worker uses the sent tensor for both and gets eager autograd's gradients."""
    from pipecc.techniques.bipartition.runtime_segments import trace_segment
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(8, 6))
    g = trace_segment(module, [((4, 8), torch.float32, True)], [0], torch.device("cpu"))
    assert g.aliases and len(g.sent) == 1  # the ReLU's output; the detach refers to it
    x = torch.randn(4, 8)
    static = [p.detach() for p in module.parameters()]
    with torch.no_grad():
        res = g.fw(*static, x)
    sent = [res[g.n_out + i] for i in g.sent]
    saved: list = [None] * len(g.saved)
    for i, t in zip(g.sent, sent):
        saved[i] = t
    for i, j in g.aliases.items():
        saved[i] = saved[j]
    for i, t in zip(g.static_index, g.static_graph(*static) if g.static_graph is not None else ()):
        saved[i] = t
    tangent = torch.randn(4, 6)
    with torch.no_grad():
        grads = list(g.bw(*saved, tangent))
    xe = x.clone().requires_grad_(True)
    module(xe).backward(tangent)
    torch.testing.assert_close(grads[0], module[1].weight.grad)
    torch.testing.assert_close(grads[1], module[1].bias.grad)
    torch.testing.assert_close(grads[2], xe.grad)
