"""Measured memory (`pipecc.runtime.memory`, `pipecc run --json --memory`; issue 31 item 3).

The CPU tracker's arithmetic on tensors of known size (exact byte counts: allocations, views,
in-place ops, frees, a Linear's parameters, gradients and Adam's state), that it changes no
numerics, the CUDA meter's calls (no GPU here: torch.cuda stubbed), the document's fields from
made-up figures, and one 2-rank gloo run whose measured static bytes are exactly its stages'
parameters and gradients. No wall-clock assertions.
"""

from __future__ import annotations

import contextlib
import operator
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

from helpers import pipecc_here, run_cli
from pipecc.runtime.memory import CudaMemory, LiveTensorBytes, held_tensors, memory_meter, static_bytes
from pipecc.runtime.timing import ActionTimer, run_document

ROOT = Path(__file__).resolve().parents[1]
F32 = 4


# ---------------------------------------------------------------------------- the tracker's arithmetic


def test_allocations_views_and_frees_count_exactly() -> None:
    with LiveTensorBytes() as live:
        a = torch.empty(1000)  # 4000 bytes
        assert live.live_bytes == 1000 * F32
        v = a.view(10, 100)[2:5]  # a view: the same storage
        a.add_(1.0)  # in place: no new storage
        assert live.live_bytes == 1000 * F32
        b = torch.zeros(250, dtype=torch.float64)  # 2000 bytes
        assert live.live_bytes == 1000 * F32 + 250 * 8
        del a
        assert live.live_bytes == 1000 * F32 + 250 * 8  # the view still holds the storage
        del v
        assert live.live_bytes == 250 * 8
        c = b * 2  # a new tensor
        assert live.live_bytes == 2 * 250 * 8
        del b, c
        assert live.live_bytes == 0
        assert live.peak_bytes == 1000 * F32 + 250 * 8  # a and b; c came after a went
        live.reset_peak()
        assert live.peak_bytes == 0


def test_tensors_from_before_are_counted_once_when_tracked() -> None:
    x = torch.ones(64, dtype=torch.int32)
    with LiveTensorBytes() as live:
        live.track([x, x[:8], "not a tensor", None])
        assert live.live_bytes == 64 * 4
        y = x + 1
        assert live.live_bytes == 2 * 64 * 4
        del y
    assert live.live_bytes == 64 * 4


def test_linear_with_adam_parameters_gradients_and_state() -> None:
    """Linear(100, 50): 5050 parameters. Parameters + gradients + Adam's two moments = 4 x 20200
    bytes, plus Adam's step counters (a scalar tensor per parameter)."""
    torch.manual_seed(0)
    lin = nn.Linear(100, 50)
    opt = torch.optim.Adam(lin.parameters(), lr=1e-3)
    x = torch.randn(32, 100)
    params = (100 * 50 + 50) * F32
    with LiveTensorBytes() as live:
        live.track(held_tensors([lin], opt))
        assert live.live_bytes == params
        loss = lin(x).relu().sum()
        # forward: the ReLU's output (saved for its backward) and the scalar loss; the Linear's
        # output died once the ReLU had read it; x was never tracked
        assert live.live_bytes == params + 32 * 50 * F32 + F32
        loss.backward()
        del loss  # the graph and its saved output go
        assert live.live_bytes == 2 * params
        opt.step()
        steps = sum(s["step"].numel() * s["step"].element_size() for s in opt.state.values())
        moments = sum(s[k].numel() * s[k].element_size() for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq"))
        assert moments == 2 * params
        assert live.live_bytes == 4 * params + steps
        assert static_bytes(held_tensors([lin], opt)) == 4 * params + steps
        assert live.peak_bytes >= live.live_bytes  # the update's temporaries came and went
        opt.zero_grad()  # set_to_none: the gradients are freed
        assert live.live_bytes == 3 * params + steps


def test_the_tracker_changes_no_numerics() -> None:
    def train(tracked: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 3))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x, y = torch.randn(5, 8), torch.randint(3, (5,))
        with LiveTensorBytes() if tracked else contextlib.nullcontext():
            for _ in range(3):
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
        return [p.detach().clone() for p in model.parameters()], loss.detach()

    plain, tracked = train(False), train(True)
    torch.testing.assert_close(tracked, plain, rtol=0, atol=0)


# ---------------------------------------------------------------------------- the meters


def test_cpu_meter_counts_the_timed_steps_only() -> None:
    lin = nn.Linear(10, 10)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    meter = memory_meter(torch.device("cpu"), [lin])
    meter.optimizer = opt
    timer = ActionTimer(0, torch.device("cpu"), warmup_steps=1)
    timer.memory = meter
    params = 110 * F32
    with meter:
        for step in range(2):
            timer.begin_step()
            if step == 0:
                big = torch.empty(10_000)  # only in the warm-up step
                del big
            opt.zero_grad()
            lin(torch.ones(4, 10)).sum().backward()
            opt.step()
            timer.end_step(0.0)
    got = timer.summary([0])["memory"]
    assert got["source"] == "live-tensors"
    assert got["static_bytes"] == 2 * params  # SGD holds no state
    assert 2 * params <= got["peak_bytes"] < 10_000 * F32
    assert got["peak_at"] == "between actions"  # no schedule ran: zero_grad, forward, step all outside actions


def test_cuda_meter_reads_the_allocator(monkeypatch) -> None:
    """The GPU path: the allocator's peak reset at each timed step and read at its end."""
    calls: list[str] = []
    peaks = iter([5000, 7000])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: next(peaks))
    meter = memory_meter(torch.device("cuda", 0), [])
    assert isinstance(meter, CudaMemory) and meter.source == "cuda-allocator"
    for counting in (False, True, True):
        meter.begin_step(counting)
        meter.end_step()
    assert calls.count("reset") == 2
    assert meter.summary() == {"peak_bytes": 7000, "static_bytes": 0, "peak_at": None,
                               "source": "cuda-allocator"}


def test_static_bytes_counts_shared_storage_once() -> None:
    w = torch.empty(100)
    assert static_bytes([w, w, w[:10], w.view(10, 10)]) == 100 * F32
    assert static_bytes([w], torch.device("cuda")) == 0  # another device's tensors are not this one's


# ---------------------------------------------------------------------------- the document


def test_document_rows_carry_measured_and_predicted_memory() -> None:
    plan = {"devices": [{"name": "cpu"}],
            "stages": [{"index": 0, "device": 0, "peak_memory_bytes": 900},
                       {"index": 1, "device": 0, "peak_memory_bytes": 700}]}
    base = {"forward": [[0.1]], "backward": [[0.1]], "step_s": [1.0], "recv_wait_s": [0.0], "warmup": 1}
    summaries = [{"rank": 0, "stages": [0], **base,
                  "memory": {"peak_bytes": 1000, "static_bytes": 400, "source": "live-tensors"}},
                 {"rank": 1, "stages": [1], **base,
                  "memory": {"peak_bytes": 650, "static_bytes": 300, "source": "live-tensors"}}]
    doc = run_document(summaries, plan, "1f1b", 2, 8)
    assert doc["memory_source"] == "live-tensors"
    assert [(s["peak_memory_bytes"], s["static_memory_bytes"], s["predicted_peak_memory_bytes"])
            for s in doc["stages"]] == [(1000, 400, 900), (650, 300, 700)]
    # one rank holding both stages (interleaved): the plan's figures of its stages add up
    both = [{"rank": 0, "stages": [0, 1], **base, "forward": [[0.1], [0.1]], "backward": [[0.1], [0.1]],
             "memory": {"peak_bytes": 1500, "static_bytes": 700, "peak_at": "0B1", "source": "live-tensors"}}]
    rows = run_document(both, plan, "interleaved", 2, 8)["stages"]
    assert [(s["peak_memory_bytes"], s["peak_memory_at"], s["predicted_peak_memory_bytes"]) for s in rows] == \
        [(1500, "0B1", 1600)] * 2
    for s in summaries:
        s["memory"] = None
    doc = run_document(summaries, {}, "1f1b", 2, 8)
    assert doc["memory_source"] is None
    assert all(s["peak_memory_bytes"] is None and s["predicted_peak_memory_bytes"] is None for s in doc["stages"])


# ---------------------------------------------------------------------------- a run


def test_memory_needs_json(mlp_copy: Path, capsys) -> None:
    out = mlp_copy  # tests/conftest.py: the shared tiny MLP folder, a copy
    code, stdout, err = run_cli(["run", str(out), "--memory", "--steps", "2"], capsys)
    assert code == 2 and stdout == ""
    assert err.startswith("pipecc: error: --memory adds the measured peak memory to --json") and err.count("\n") == 1


@pytest.mark.slow  # a torchrun launch of two processes
def test_two_rank_gloo_run_reports_each_stages_memory(mlp_copy: Path) -> None:
    """SGD keeps no state: each rank's static bytes are exactly its stage's parameters and their
    gradients; the peak is at least that, and the plan's prediction sits beside it."""
    out = mlp_copy
    result = pipecc_here("run", str(out), "--json", "--memory", "--steps", "3", "--timeout", "30")
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads(result.stdout)
    plan = json.loads((out / "plan.json").read_text())
    assert doc["memory_source"] == "live-tensors"
    for row, planned in zip(doc["stages"], plan["stages"]):
        params = _param_bytes(out / f"stage_{row['index']}" / "weights.safetensors")
        assert row["static_memory_bytes"] == 2 * params
        assert row["peak_memory_bytes"] >= row["static_memory_bytes"]
        assert row["predicted_peak_memory_bytes"] == planned["peak_memory_bytes"] > 0
        # sane: the same order of magnitude as the plan's (which assumes Adam's two moments)
        assert row["peak_memory_bytes"] < 4 * planned["peak_memory_bytes"]


def _param_bytes(path: Path) -> int:
    with safe_open(str(path), "pt") as f:
        return sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())


def test_one_process_holding_both_stages_reports_one_figure_for_each(mlp_copy: Path, capsys) -> None:
    """Without torchrun one process runs both stages (interleaved): the rank's peak and static
    bytes in each row (as plan.json gives a rank's peak to each of its stages); the tracker is
    gone from the dispatch stack afterwards."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    from pipecc.runtime import dist
    out = mlp_copy
    assert dist.main([str(out), "--steps", "3", "--schedule", "interleaved", "--json", "--memory"]) == 0
    doc = json.loads(capsys.readouterr().out)
    params = sum(_param_bytes(out / f"stage_{i}" / "weights.safetensors") for i in range(2))
    rows = doc["stages"]
    assert [r["static_memory_bytes"] for r in rows] == [2 * params] * 2
    assert rows[0]["peak_memory_bytes"] == rows[1]["peak_memory_bytes"] >= 2 * params
    assert _get_current_dispatch_mode() is None


# ---------------------------------------------------------------------------- the planner's side


def test_step_memory_rules() -> None:
    """Adam/AdamW (two states): single-tensor on a CPU (2 x the largest parameter), foreach on a
    GPU (1 x all parameters); SGD, momentum and FPGA stages: nothing (passes.step_memory)."""
    from pipecc.passes.step_memory import step_bytes
    assert step_bytes("cpu", 1000, 5000, 2) == 2000
    assert step_bytes("gpu", 1000, 5000, 2) == 5000
    assert step_bytes("cpu", 1000, 5000, 0) == step_bytes("gpu", 1000, 5000, 1) == 0
    assert step_bytes("fpga", 1000, 5000, 2) == 0


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_simulated_peak_is_static_plus_the_larger_of_stash_and_optimizer_step(schedule: str) -> None:
    from pipecc.ir.schedule import schedule_for
    from pipecc.passes.simulate import StageCosts, simulate
    sched = schedule_for(schedule, 2, 4)
    costs = StageCosts.uniform(2, 4, 1.0, 2.0, activation_bytes=10.0, static_bytes=100.0)
    held = [4, 4] if schedule == "gpipe" else [2, 1]  # micro-batches stashed at once per rank
    assert simulate(sched, costs).peak_memory_bytes == [100.0 + 10 * n for n in held]
    costs.step_bytes = [35.0, 5.0]  # rank 0's step needs more than its stash in 1F1B, not in GPipe
    assert simulate(sched, costs).peak_memory_bytes == [100.0 + max(10 * held[0], 35.0), 100.0 + 10 * held[1]]
    costs.step_bytes = [1.0]
    with pytest.raises(ValueError, match="step_bytes must have 2 entries"):
        simulate(sched, costs)


def test_zero_bubble_holds_what_each_i_leaves_for_its_w() -> None:
    """zb-h1 on two ranks, four micro-batches: the last rank runs F0 I0 F1 I1 W0 F2 I2 W1 F3 I3
    W2 W3, so two I's wait for their W at once; each holds the output gradients its W starts
    from (`weight_grad_bytes`, measured 1.39-1.56x before on the bench's zb-h1 last stages)."""
    from pipecc.ir.schedule import schedule_for
    from pipecc.passes.simulate import StageCosts, simulate
    sched = schedule_for("zb-h1", 2, 4)
    costs = StageCosts.uniform(2, 4, 1.0, 2.0, activation_bytes=0.0, static_bytes=100.0)
    assert simulate(sched, costs).peak_memory_bytes == [100.0, 100.0]
    costs.weight_grad_bytes = [0.0, 7.0]  # stage 0's I does nothing (its inputs take no gradient)
    assert simulate(sched, costs).peak_memory_bytes == [100.0, 100.0 + 2 * 7.0]
    costs.activation_bytes = [[10.0] * 4, [10.0] * 4]  # and each stash until its W
    peaks = simulate(sched, costs).peak_memory_bytes
    assert peaks[1] == 100.0 + 2 * (10.0 + 7.0)  # after I1, I2, I3: two stashes and their W's gradients


def test_a_sent_input_gradient_is_held_until_the_runtime_drops_it() -> None:
    """The runtime drops a sent tensor once a later message from its peer proves it arrived
    (`Schedule.send_release`). Under GPipe the last rank receives nothing after its first SEND_B,
    so after its last SEND_B all four gradients are still out until the step ends; under 1F1B
    each RECV_F from the second on releases a SEND_B, so after the last one two are out (B2's
    and B3's). The event sweep (BPipe's) agrees with the row walk."""
    from pipecc.ir.schedule import schedule_for
    from pipecc.passes.simulate import StageCosts, _peak_memory, _peak_memory_timeline, simulate
    for name, pending in (("gpipe", 4), ("1f1b", 2)):
        sched = schedule_for(name, 2, 4)
        costs = StageCosts.uniform(2, 4, 1.0, 2.0, activation_bytes=0.0, static_bytes=100.0)
        costs.input_grad_bytes = [0.0, 10.0]  # stage 1 sends 10 bytes upstream per micro-batch
        result = simulate(sched, costs)
        assert result.peak_memory_bytes == [100.0, 100.0 + 10.0 * pending], name
        assert _peak_memory_timeline(sched, costs, result.events) == result.peak_memory_bytes, name
        assert [_peak_memory(sched, costs, r, True) for r in range(2)] == result.peak_memory_bytes
    release = schedule_for("1f1b", 2, 4).send_release(1)  # what the runtime follows
    assert {str(k): [str(a) for a in v] for k, v in release.items()} == {"1RECV_F2": ["1SEND_B0"],
                                                                        "1RECV_F3": ["1SEND_B1"]}


def test_planned_peak_counts_the_optimizer_step_and_the_received_input() -> None:
    """A wide MLP at batch 2 on two CPUs: activations are tiny, so each stage's planned peak is
    parameters x 4 (weights, gradients, Adam's moments) plus Adam's two temporaries of the
    largest weight (hidden x hidden floats), as measured (bench/RESULTS.md's memory section);
    stage 0's rank also holds the step's inputs (batch x in_features floats)."""
    from pipecc import driver
    hidden = 512
    args = dict(in_features=16, hidden=hidden, depth=4, num_classes=10)
    analysis = driver.analyze(ROOT / "models" / "mlp.py", model_args=args, batch_size=2)
    plan, _ = driver.plan(analysis, "2xcpu", microbatches=2, schedule="1f1b", replicas=1, use_all_devices=True)
    for stage in plan.stages:
        assert stage.param_bytes > hidden * hidden * F32  # each stage holds a hidden x hidden weight
        activations = stage.peak_memory_bytes - 4 * stage.param_bytes - 2 * hidden * hidden * F32
        inputs = 2 * 16 * F32 if stage.index == 0 else 0  # held all step (runtime.engine._split_inputs)
        assert activations == inputs  # the step's temporaries outweigh the stash at batch 2


# ---------------------------------------------------------------------------- inspect --run


def _run_file(tmp_path: Path, **top: object) -> Path:
    doc = {"format": "pipecc-run", "version": 1, "batch_size": 8, "microbatches": 2, "schedule": "1f1b",
           "warmup_steps": 1, "predicted_step_s": 0.5,
           "history": [{"step": 0, "loss": 1.0, "wall_s": 0.5, "samples_per_s": 16.0, "lr": 1e-3}],
           "stages": [{"index": 0, "rank": 0, "peak_memory_bytes": 12_000_000, "peak_memory_at": "between actions",
                       "static_memory_bytes": 10_000_000, "predicted_peak_memory_bytes": 10_000_000},
                      {"index": 1, "rank": 1, "peak_memory_bytes": 900_000, "peak_memory_at": "1B3",
                       "static_memory_bytes": 400_000, "predicted_peak_memory_bytes": 1_000_000}], **top}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(doc))
    return path


def test_inspect_run_shows_measured_against_predicted_memory(tmp_path: Path) -> None:
    from pipecc.report import history
    run = history.load_run(_run_file(tmp_path, memory_source="live-tensors"))
    text = history.history_text(run)
    table = text[text.index("memory per rank (live tensor bytes on the CPU"):].splitlines()
    assert table[1].split() == ["stage", "rank", "measured", "predicted", "measured/predicted", "static", "peak", "at"]
    assert table[3].split() == ["0", "0", "12MB", "10MB", "1.20", "10MB", "between", "actions"]
    assert table[4].split() == ["1", "1", "900kB", "1MB", "0.90", "400kB", "1B3"]
    assert history.history_json(run)["memory"]["stages"][1]["at"] == "1B3"
    plain = history.load_run(_run_file(tmp_path, memory_source=None))  # a run without --memory
    assert "memory per rank" not in history.history_text(plain) and history.history_json(plain)["memory"] is None


def test_inspect_run_refuses_damaged_memory_figures(tmp_path: Path) -> None:
    from pipecc.errors import PipeccError
    from pipecc.report import history
    path = _run_file(tmp_path, memory_source="live-tensors")
    doc = json.loads(path.read_text())
    doc["stages"][1]["peak_memory_bytes"] = "lots"
    path.write_text(json.dumps(doc))
    with pytest.raises(PipeccError, match=r"stages\[1\].*peak_memory_bytes"):
        history.load_run(path)


def test_report_section_has_the_memory_table(tmp_path: Path) -> None:
    from pipecc.report import history
    page = history.history_html(history.load_run(_run_file(tmp_path, memory_source="live-tensors")))
    assert "Peak memory per rank, measured against plan.json" in page
    assert "<td>12MB</td><td>10MB</td><td>1.20</td>" in page and "<td>1B3</td>" in page


def test_interleaved_stages_add_up_to_their_ranks_peak() -> None:
    """Two stages per rank: plan.json gives each its share; a rank's shares add up to its
    parameters x 4 plus Adam's temporaries of its largest weight (batch 2: tiny activations),
    what `run --json --memory` measures for the rank."""
    from pipecc import driver
    hidden = 512
    args = dict(in_features=16, hidden=hidden, depth=6, num_classes=10)
    analysis = driver.analyze(ROOT / "models" / "mlp.py", model_args=args, batch_size=2)
    plan, _ = driver.plan(analysis, "2xcpu", microbatches=2, schedule="interleaved", replicas=1,
                          use_all_devices=True)
    assert len(plan.stages) == 4
    for rank in range(2):
        mine = [s for s in plan.stages if s.index % 2 == rank]
        total = sum(s.peak_memory_bytes for s in mine)
        expected = 4 * sum(s.param_bytes for s in mine) + 2 * hidden * hidden * F32
        expected += 2 * 16 * F32 if rank == 0 else 0  # the step's inputs, on the rank of stage 0
        assert abs(total - expected) <= len(mine)  # each share rounded down to whole bytes


def test_a_tied_weight_counts_on_every_stage_that_reads_it() -> None:
    """GPT with its LM head tied to the token embedding, cut in two: both compiled stages hold
    the (vocab x n_embd) matrix, so the planned peak of the stage that did not get it charged
    (its units' param_bytes) still holds it x 4 (weights, gradients, Adam's moments)."""
    from pipecc import driver
    args = dict(n_layer=2, n_head=2, n_embd=32, vocab_size=4096, block_size=16, seq_len=8)
    vocab = 4096 * 32 * F32  # the tied matrix
    plans = {}
    for tie in (False, True):
        analysis = driver.analyze(ROOT / "models" / "gpt.py", model_args={**args, "tie_weights": tie}, batch_size=4)
        plans[tie], _ = driver.plan(analysis, "2xcpu", microbatches=2, schedule="1f1b", replicas=1,
                                    use_all_devices=True)
    untied, shared = plans[False], plans[True]
    assert [s.nodes for s in untied.stages] == [s.nodes for s in shared.stages]  # the same cut
    head = next(k for k, s in enumerate(shared.stages) if any("lm_head" in n for n in s.nodes))
    assert head == 1 and shared.stages[1].param_bytes == untied.stages[1].param_bytes - vocab  # charged to stage 0
    # the head's stage holds the matrix all the same: as much as untied, where it was its own
    assert shared.stages[1].peak_memory_bytes == untied.stages[1].peak_memory_bytes
    assert shared.stages[0].peak_memory_bytes == untied.stages[0].peak_memory_bytes


def test_fake_tensors_hold_no_bytes() -> None:
    """A trace inside the loop (`runtime.loss_targets` traces loss_fn on fake tensors) makes
    tensors whose storage is on the meta device: no memory, none counted (the bench's GPT last
    stage counted 2 MB of them, kept by the remembered trace)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    mode = LiveTensorBytes()
    with mode:
        with FakeTensorMode():
            fake = torch.empty(1000) * 2
        real = torch.empty(10)
    assert mode.live_bytes == real.numel() * 4 and fake.shape == (1000,)


def test_unflattening_received_leaves_keeps_no_reference_to_them():
    """`ports.unflatten` built tuples with a closure that called itself: a reference cycle that
    held the received leaves until the garbage collector ran (a 1F1B last stage measured one
    extra micro-batch's inputs). Now they die with their last user."""
    import gc
    import weakref

    from pipecc.runtime.ports import Port, unflatten
    ports = [Port("a", "tensor", (2,), torch.float32), Port("t", "tuple", items=(Port("b", "tensor", (2,), torch.float32),))]
    leaves = [torch.ones(2), torch.zeros(2)]
    refs = [weakref.ref(t) for t in leaves]
    was = gc.isenabled()
    gc.disable()
    try:
        built = unflatten(leaves, ports)
        assert built[0] is leaves[0] and built[1][0] is leaves[1]
        del built, leaves
        assert [r() for r in refs] == [None, None]
    finally:
        if was:
            gc.enable()


class _Joins(nn.Module):
    """A residual add of equal shapes and a concatenation, the two backward ops that hand their
    inputs the output's gradient (or slices of it) instead of new tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        r = h + x * 2.0
        return self.b(torch.cat([r, h], dim=1))


def test_a_backward_working_set_counts_no_gradient_autograd_passes_through() -> None:
    """The add's and the cat's units charge one gradient, the output's, not one per input as a
    Linear's does (`units._passes_gradient`), because autograd's AddBackward and CatBackward hand
    the inputs that tensor or slices of it: checked here on the real backward's storages."""
    from pipecc import driver
    from pipecc.passes.units import UnitBuilder
    torch.manual_seed(0)
    model, x = _Joins(), torch.randn(8, 16, requires_grad=True)
    grads: dict[str, torch.Tensor] = {}
    h = torch.relu(model.a(x))
    z = x * 2.0  # read by the add only
    r = h + z
    joined = torch.cat([r, h], dim=1)
    for name, t in (("r", r), ("z", z), ("joined", joined)):
        t.register_hook(lambda g, name=name: grads.__setitem__(name, g))
    model.b(joined).sum().backward()
    ptr = grads["joined"].untyped_storage().data_ptr()
    assert grads["r"].untyped_storage().data_ptr() == ptr  # r's gradient: a slice of the cat's
    assert grads["z"].untyped_storage().data_ptr() == ptr  # z's: the add passed r's through

    graph = driver.analyze_module(model, (torch.randn(8, 16),))
    builder = UnitBuilder(graph)
    units = builder.at(8)
    unit_of = {n.name: i for i, g in enumerate(builder.groups) for n in g}
    add = next(n for n in graph.gm.graph.nodes if n.target in (operator.add, torch.ops.aten.add.Tensor))
    cat = next(n for n in graph.gm.graph.nodes if n.target in (torch.cat, torch.ops.aten.cat.default))
    assert unit_of[add.name] != unit_of[cat.name]
    assert units.work_bytes[unit_of[add.name]] == 8 * 16 * F32  # was 2x: its output's and z's gradient
    assert units.work_bytes[unit_of[cat.name]] == 8 * 32 * F32  # was 2x: its output's and its inputs'


class _UpCat(nn.Module):
    """A weight-bearing layer read only by a concatenation (U-Net's up-convolution and skip)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.out = nn.Linear(16, 8), nn.Linear(24, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.cat([self.up(x), x], dim=1))


def test_zero_bubble_w_keeps_a_concatenations_whole_gradient() -> None:
    """What a zero-bubble I leaves for W (`UnitBuilder.weight_output_bytes`): a Linear's output
    gradient, except where a `cat` alone reads the output: W's view keeps the cat's whole
    gradient (measured: U-Net's zb-h1 stage 1 1.23x before, 1.06x after)."""
    from pipecc import driver
    from pipecc.passes.units import UnitBuilder
    torch.manual_seed(0)
    graph = driver.analyze_module(_UpCat(), (torch.randn(8, 16),))
    builder = UnitBuilder(graph)
    kept = builder.weight_output_bytes(8)
    unit_of = {n.name: i for i, g in enumerate(builder.groups) for n in g}
    up = next(n.name for n in graph.gm.graph.nodes if n.name.startswith("up"))
    out = next(n.name for n in graph.gm.graph.nodes if n.name.startswith("out"))
    assert kept[unit_of[up]] == 8 * 24 * F32  # the cat's gradient, not the 8 x 8 slice of it
    assert kept[unit_of[out]] == 8 * 4 * F32
    assert kept.sum() == 8 * 24 * F32 + 8 * 4 * F32
