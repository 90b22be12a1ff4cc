"""Activation recomputation (`--recompute none|full|auto`, pipecc/techniques/recompute/search.py) end to end:
the memory and time model (partitioner, simulator), the planner's choice and its reasons, the
plan's fields, the generated stage.py and the drop-in module (gradients equal the model's, the
forward really runs twice), the refusals, and one `pipecc run --verify` launch.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import pipecc
from helpers import MLP_TINY, model_args
from helpers import run_pipecc as pipecc_cmd
from pipecc import cli, driver
from pipecc.backends.torch.codegen import generate_stage
from pipecc.backends.torch.stages import cut_stages
from pipecc.errors import PipeccError, UsageError
from pipecc.ir.plan import Plan
from pipecc.ir.schedule import by_name
from pipecc.passes.partition import PartitionProblem, brute_force, evaluate, partition
from pipecc.passes.simulate import StageCosts, simulate

ROOT = Path(__file__).resolve().parents[1]
MLP = str(ROOT / "models" / "mlp.py")
# an activation-heavy MLP: at batch 4096 its stashed activations (8 x 4096 x 256 floats) outweigh
# its weights and optimizer state, so memory caps between the two make recomputation decide
BIG_MLP = dict(hidden=256, depth=8, in_features=256)


def small_cluster(tmp_path: Path, memory_bytes: float, n: int = 2) -> str:
    path = tmp_path / "cluster.toml"
    names = ", ".join(['"small"'] * n)
    path.write_text(f'devices = [{names}]\n[device.small]\nbase = "cpu"\n'
                    f'memory_bytes = {memory_bytes}\nsource = "user: a small test device"\n')
    return f"@{path}"


@pytest.fixture(scope="module")
def big_mlp() -> driver.Analysis:
    return driver.analyze(MLP, model_args=BIG_MLP, batch_size=4096)


def plan_big(analysis, devices: str, mode: str) -> Plan:
    return driver.plan(analysis, devices, microbatches=8, schedule="gpipe", recompute=mode,
                       split_layers=False)[0]


# ---------------------------------------------------------------------------- memory model
def _problem(rng: random.Random, n: int, p: int, recompute) -> PartitionProblem:
    return PartitionProblem(
        fwd=[[rng.uniform(0.1, 1) for _ in range(n)] for _ in range(p)],
        bwd=[[rng.uniform(0.1, 2) for _ in range(n)] for _ in range(p)],
        out_bytes=[rng.randint(1, 50) for _ in range(n)], last_use=[min(i + 1, n) for i in range(n)],
        static_mem=[rng.randint(0, 30) for _ in range(n)],
        act_mem=[rng.randint(10, 60) for _ in range(n)], mem_cap=[rng.randint(150, 400)] * p,
        inflight=[rng.randint(1, 4) for _ in range(p)], link_time=lambda k, b: 1e-3 * b,
        recompute=recompute)


def test_recomputed_stage_memory_is_inputs_in_flight_plus_one_working_set() -> None:
    prob = PartitionProblem(fwd=[[1.0] * 4] * 2, bwd=[[2.0] * 4] * 2, out_bytes=[10, 20, 30, 40],
                            last_use=[1, 2, 3, 4], static_mem=[1, 2, 3, 4],
                            act_mem=[100, 200, 300, 400], mem_cap=[1e9, 1e9], inflight=[4, 3],
                            link_time=lambda k, b: 0.0)
    bounds = (0, 2, 4)
    plain = evaluate(prob, bounds).stage_memory
    # M = static + inflight * (act + received): received = 20 bytes (node 1's output) at stage 1
    assert plain == (3 + 4 * 300, 7 + 3 * (700 + 20))
    both = evaluate(dataclasses.replace(prob, recompute=(True, True)), bounds).stage_memory
    assert both == (3 + 300, 7 + 700 + 3 * 20)
    one = evaluate(dataclasses.replace(prob, recompute=(False, True)), bounds).stage_memory
    assert one == (plain[0], both[1])
    with pytest.raises(ValueError, match="one flag per stage"):
        evaluate(dataclasses.replace(prob, recompute=(True,)), bounds)


@pytest.mark.parametrize("seed", range(12))
def test_partition_is_exact_under_recompute(seed: int) -> None:
    """The exact partitioner's memory test agrees with brute force when stages recompute."""
    rng = random.Random(seed)
    n, p = rng.randint(4, 9), rng.randint(2, 3)
    prob = _problem(rng, n, p, tuple(rng.random() < 0.5 for _ in range(p)))
    try:
        want = brute_force(prob)
    except ValueError:  # InfeasibleError: partition must agree
        with pytest.raises(ValueError):
            partition(prob)
        return
    got = partition(prob)
    assert got.fits and got.bottleneck == pytest.approx(want.bottleneck, rel=1e-9)


def test_simulator_peak_counts_inputs_and_one_recomputed_working_set() -> None:
    # one stage, GPipe, 3 micro-batches: F F F B B B; stash 10 per micro-batch, 100 re-created
    # during each B, 5 static: peak = 5 + 3*10 + 100 (during the first B)
    sched = by_name("gpipe", 1, 3)
    costs = StageCosts.per_stage(3, [1.0], [2.0], activation_bytes=[10.0], static_bytes=[5.0],
                                 recompute_bytes=[100.0])
    assert simulate(sched, costs).peak_memory_bytes == [5 + 30 + 100]
    plain = StageCosts.per_stage(3, [1.0], [2.0], activation_bytes=[110.0], static_bytes=[5.0])
    assert simulate(sched, plain).peak_memory_bytes == [5 + 330]
    with pytest.raises(ValueError, match="recompute_bytes"):
        simulate(sched, dataclasses.replace(costs, recompute_bytes=[1.0, 2.0]))


def test_recomputed_backward_pays_one_more_forward(big_mlp) -> None:
    from pipecc.passes.plan_options import PlanOptions
    from pipecc.passes.plan_search import Planner
    from pipecc.targets.devices import parse_devices
    bal = Planner(big_mlp.graph, parse_devices("2xcpu"), PlanOptions(batch_size=4096))
    units = bal.tables.builder.at(512)
    plain = bal.evaluator.problem(units, 512, "gpipe", 8, (0, 1))
    redo = bal.evaluator.problem(units, 512, "gpipe", 8, (0, 1), recompute=[False, True])
    np.testing.assert_allclose(np.asarray(redo.fwd), np.asarray(plain.fwd))
    np.testing.assert_allclose(np.asarray(redo.bwd)[0], np.asarray(plain.bwd)[0])
    np.testing.assert_allclose(np.asarray(redo.bwd)[1], np.asarray(plain.bwd)[1] + np.asarray(plain.fwd)[1])


def test_an_fpga_stage_never_recomputes() -> None:
    from pipecc.passes.plan_options import PlanOptions
    from pipecc.passes.plan_search import Planner
    from pipecc.targets.devices import parse_devices
    graph = driver.analyze(MLP, model_args=MLP_TINY, batch_size=2).graph
    for order in ((0, 1), (1, 0)):  # --choose-order may put the card at either end
        bal = Planner(graph, parse_devices("cpu,u250"), PlanOptions(batch_size=2, recompute="auto"))
        units = bal.tables.builder.at(1)
        prob = bal.evaluator.problem(units, 1, "gpipe", 2, order, recompute=[True, True])
        assert prob.recompute == tuple(bal.cluster.devices[d].kind != "fpga" for d in order)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_partitioner_memory_equals_simulated_peak_for_recomputed_stages(big_mlp, schedule) -> None:
    """Two models of one memory: M_k (inputs of every micro-batch in flight + one working set)
    and the simulator's walk over the schedule's rows agree exactly on what both count; the
    simulator adds what M_k leaves out (docs/memory.md): the outputs a recomputing stage keeps
    until its backward (its outgoing cut, per micro-batch in flight) and the running action's
    working set (`Evaluator.working_sets`)."""
    import dataclasses

    from pipecc.passes.partition import evaluate
    from pipecc.passes.plan_options import PlanOptions
    from pipecc.passes.plan_search import Planner
    from pipecc.targets.devices import parse_devices
    bal = Planner(big_mlp.graph, parse_devices("3xcpu"), PlanOptions(batch_size=4096))
    cand = bal.evaluator.evaluate(schedule, 8, recompute=[True, True, True])
    assert cand.recompute == (True, True, True)
    prob = cand.problem
    bare = dataclasses.replace(prob, work_mem=None, held_out_mem=None)
    same = bal.evaluator.simulate(cand.part, bare, schedule, 8, 1)
    assert list(evaluate(bare, cand.part.bounds).stage_memory) == pytest.approx(same.peak_memory_bytes, rel=1e-12)
    # M_k plus the cap's margin (plan_problem._with_working_sets) bounds the simulated peak
    margin = float(np.max(prob.work_mem)) + max(cand.part.cut_bytes)
    sent, _, _ = bal.evaluator.working_sets(cand.part, prob)
    assert sent == [float(x) for x in cand.part.cut_bytes] + [0.0]  # a recomputing stage keeps its outputs
    held = [8 if schedule == "gpipe" else 3 - k for k in range(3)]  # micro-batches in flight
    for k, (peak, m_k) in enumerate(zip(cand.timeline.peak_memory_bytes, cand.part.stage_memory)):
        # NOTE: not in M_k: the outputs a recomputing stage keeps per micro-batch (docs/memory.md)
        assert m_k <= peak <= m_k + margin + held[k] * sent[k]


# ---------------------------------------------------------------------------- planner
def test_auto_fits_where_none_cannot_and_says_why(big_mlp, tmp_path) -> None:
    devices = small_cluster(tmp_path, 17e6)  # 15.3 MB usable: the best split needs 21 MB without
    with pytest.raises(PipeccError, match=r"no split fits memory.*--recompute auto"):
        plan_big(big_mlp, devices, "none")
    plan = plan_big(big_mlp, devices, "auto")
    assert [s.recompute for s in plan.stages] == [True, True]
    assert plan.options["recompute"] == "auto"
    assert all(s.peak_memory_bytes <= 17e6 * 0.9 for s in plan.stages)
    why = [d for d in plan.decisions if "recomputes its activations" in d]  # the cap less the working-set margin
    assert len(why) == 2 and re.fullmatch(r"stage 1 recomputes its activations: [\d.]+ GB > 0.0137 GB "
                                          r"without", why[1]), why
    assert "without recomputation no placement fits memory (--recompute auto)" in plan.decisions


def test_auto_recomputes_only_the_stage_over_its_cap(big_mlp, tmp_path) -> None:
    # 23.4 MB usable: only the second stage overflows (the first also holds the step's 4.2 MB of inputs)
    devices = small_cluster(tmp_path, 26e6)
    auto, full = plan_big(big_mlp, devices, "auto"), plan_big(big_mlp, devices, "full")
    assert [s.recompute for s in auto.stages] == [False, True]
    assert [s.recompute for s in full.stages] == [True, True]
    assert auto.predicted_iteration_s < full.predicted_iteration_s  # one re-run forward less
    assert any(d.startswith("stage 1 recomputes its activations") for d in auto.decisions)
    assert "every stage recomputes its activations (--recompute full)" in full.decisions


def test_auto_leaves_a_plan_that_fits_alone_and_none_is_todays(big_mlp) -> None:
    auto, none = plan_big(big_mlp, "2xcpu", "auto"), plan_big(big_mlp, "2xcpu", "none")
    assert not any(s.recompute for s in auto.stages) and not any(s.recompute for s in none.stages)
    assert auto.predicted_iteration_s == none.predicted_iteration_s
    assert none.options["recompute"] == "none"
    assert not any("recomput" in d for d in none.decisions)


def test_full_plan_costs_and_memory(big_mlp) -> None:
    none, full = plan_big(big_mlp, "2xcpu", "none"), plan_big(big_mlp, "2xcpu", "full")
    assert all(s.recompute for s in full.stages)
    assert full.predicted_iteration_s > none.predicted_iteration_s
    assert max(s.peak_memory_bytes for s in full.stages) < max(s.peak_memory_bytes for s in none.stages)
    for s in full.stages:  # backward = backward + one more forward, per stage
        assert s.backward_s > 2 * s.forward_s


def test_old_plans_load_and_the_field_round_trips(big_mlp) -> None:
    plan = plan_big(big_mlp, "2xcpu", "full")
    data = json.loads(plan.dumps())
    assert [s["recompute"] for s in data["stages"]] == [True, True]
    assert Plan.from_json(data).stages[1].recompute is True
    for s in data["stages"]:
        del s["recompute"]
    assert Plan.from_json(data).stages[0].recompute is False


# ---------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("argv, message", [
    (["--devices", "cpu,u250", "--recompute", "full"],
     "--recompute full: activation recomputation: stage 1 (fpga u250) cannot recompute activations"),
    (["--devices", "2xcpu", "--recompute", "full", "--inference"],
     "--recompute full: activation recomputation in a forward-only plan"),
    (["--devices", "2xcpu", "--recompute", "auto", "--inference"],
     "--recompute auto: activation recomputation in a forward-only plan"),
    (["--devices", "2xcpu", "--recompute", "bogus"], "argument --recompute: invalid choice: 'bogus'"),
])
def test_bad_recompute_is_one_usage_line(argv, message, capsys) -> None:
    assert cli.main(["plan", MLP, *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pipecc: error: ") and message in err, err


def test_full_refuses_batchnorm_and_auto_keeps_it_off(capsys, tmp_path) -> None:
    cnn = str(ROOT / "models" / "tiny_cnn.py")
    assert cli.main(["plan", cnn, "--devices", "2xcpu", "--recompute", "full"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "BatchNorm bn2 in training mode" in err and \
        "--recompute auto" in err, err
    # BatchNorm first, then activation-heavy layers: auto recomputes the second stage only
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.BatchNorm1d(256)]
    for _ in range(8):
        layers += [nn.Linear(256, 256), nn.ReLU()]
    graph = driver.analyze_module(nn.Sequential(*layers), (torch.randn(4096, 256),))
    devices = small_cluster(tmp_path, 20e6)
    with pytest.raises(PipeccError, match="no split fits memory"):
        driver.plan(graph, devices, microbatches=8, schedule="gpipe", split_layers=False)
    plan = driver.plan(graph, devices, microbatches=8, schedule="gpipe", recompute="auto",
                       split_layers=False)[0]
    assert [s.recompute for s in plan.stages] == [False, True]
    assert "0" in plan.stages[0].nodes  # the BatchNorm


def test_compile_refuses_an_edited_plan_it_cannot_run() -> None:
    model = pipecc_model_cnn()
    graph = driver.analyze_module(model, (torch.randn(2, 3, 16, 16),))
    plan, graph = driver.plan(graph, "2xcpu", split_layers=False)
    bn_stage = next(s for s in plan.stages if "bn2" in s.nodes)
    bn_stage.recompute = True
    with pytest.raises(PipeccError, match=rf"stage {bn_stage.index} recomputes activations but holds "
                                          r"BatchNorm bn2 in training mode"):
        driver.compile_module(model, graph, plan, (torch.randn(2, 3, 16, 16),))


def pipecc_model_cnn() -> nn.Module:
    import importlib.util
    spec = importlib.util.spec_from_file_location("tiny_cnn_rc", ROOT / "models" / "tiny_cnn.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    torch.manual_seed(0)
    return mod.build_model()


# ---------------------------------------------------------------------------- code and numerics
class DropMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 5)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop(torch.relu(self.a(x)))
        x = self.drop(torch.relu(self.b(x)))
        return self.c(x)


def test_dropin_matches_the_model_and_really_recomputes() -> None:
    """Gradients equal the model's with dropout on (checkpoint replays the RNG state), and
    each stage's forward runs twice per step (once more in backward)."""
    torch.manual_seed(0)
    model, x = DropMLP(), torch.randn(8, 16)
    ref = copy.deepcopy(model)
    pm = pipecc.compile(model, (x,), "2xcpu", recompute="full", microbatches=1, split_layers=False)
    assert [s.recompute for s in pm.plan.stages] == [True, True]
    calls = []
    for k, stage in enumerate(pm._pipecc_stages):
        stage.inner.register_forward_pre_hook(lambda *_, k=k: calls.append(k))
    torch.manual_seed(1)
    out = pm(x)
    out.square().mean().backward()
    torch.manual_seed(1)
    want = ref(x)
    want.square().mean().backward()
    torch.testing.assert_close(out, want)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert sorted(calls) == [0, 0, 1, 1]


def test_generated_stage_checkpoints_and_is_unchanged_without() -> None:
    graph = driver.analyze(MLP, model_args=MLP_TINY, batch_size=2).graph
    plan, graph = driver.plan(graph, "2xcpu", split_layers=False)
    stages = cut_stages(graph, plan.stage_of())
    plain = generate_stage(stages[0], "mlp", 0, "cpu", 2)
    assert "checkpoint" not in plain.source and plain.source == \
        generate_stage(stages[0], "mlp", 0, "cpu", 2, recompute=False).source
    gen = generate_stage(stages[0], "mlp", 0, "cpu", 2, recompute=True)
    assert "import torch.utils.checkpoint\n" in gen.source
    assert re.search(r"return torch\.utils\.checkpoint\.checkpoint\(self\.stage_forward, \w+, "
                     r"use_reentrant=False\)", gen.source), gen.source
    assert "# Activation recomputation (pipecc --recompute)" in gen.source
    # the body is the plain forward's, renamed
    body = plain.source.split("    def forward(", 1)[1]
    assert gen.source.endswith("    def stage_forward(" + body)
    namespace: dict = {}
    exec(compile(gen.source, "stage.py", "exec"), namespace)  # noqa: S102
    module = namespace["Stage0"]()
    module.load_state_dict({k: t.detach().clone() for k, t in gen.tensors.items()}, strict=False)
    calls = []
    module.stage_forward = (lambda f: lambda *a: calls.append(1) or f(*a))(module.stage_forward)
    x = torch.randn(2, MLP_TINY["in_features"])
    (out,) = module(x)
    out.sum().backward()
    assert len(calls) == 2  # once forward, once more in backward
    ref = namespace["Stage0"]()
    ref.load_state_dict(module.state_dict())
    (want,) = ref.stage_forward(x)
    want.sum().backward()
    torch.testing.assert_close(out, want)
    for (n, p), (_, q) in zip(module.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)


def compile_recomputing_mlp(out) -> list[str]:
    """`pipecc compile` of the tiny MLP over 2 CPUs, every stage recomputing; its argv."""
    argv = ["compile", MLP, "--devices", "2xcpu", "--replicas", "1", "--use-all-devices", "-b", "8", "-m", "2", "--recompute", "full",
            "-o", str(out), "-q"]
    for arg in model_args(MLP_TINY):
        argv += ["--model-arg", arg]
    assert cli.main(argv) == 0
    return argv


def test_plan_text_and_inspect_show_recomputing_stages(tmp_path, capsys) -> None:
    out = tmp_path / "out"
    argv = compile_recomputing_mlp(out)
    capsys.readouterr()
    plan_argv = ["plan" if a == "compile" else a for a in argv if a not in ("-o", str(out), "-q")]
    assert cli.main(plan_argv + ["-v"]) == 0
    shown = capsys.readouterr()
    assert "recompute       every stage (activations re-created in backward" in shown.out, shown.out
    assert "every stage recomputes its activations (--recompute full)" in shown.out + shown.err
    assert cli.main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "recompute       every stage (activations re-created in backward" in text, text
    assert cli.main(["inspect", str(out), "--format", "json"]) == 0
    assert [s["recompute"] for s in json.loads(capsys.readouterr().out)["stages"]] == [True, True]
    assert cli.main(["inspect", str(out), "--stage", "1"]) == 0
    assert "recomputes its activations in backward" in capsys.readouterr().out
    assert "torch.utils.checkpoint.checkpoint(self.stage_forward" in \
        (out / "stage_1" / "stage.py").read_text()


@pytest.mark.slow  # a torchrun launch of several processes (make test-fast leaves it out)
@pytest.mark.xdist_group(name="run_cmd")
def test_run_verify_with_recompute(tmp_path) -> None:
    """One torchrun launch: the checkpointed stage.py files train like the model, under the
    zero-bubble schedule (the re-run forward inside the split backward's I; plain backwards of
    checkpointed stages are the drop-in tests')."""
    out = tmp_path / "out"
    argv = compile_recomputing_mlp(out)
    run = pipecc_cmd("run", str(out), "--steps", "2", "--verify", "--schedule", "zb-h1", "--timeout", "60")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert re.search(r"^verify: outputs, loss and \d+ gradients match the single-process run$",
                     run.stdout, re.MULTILINE), run.stdout


@pytest.mark.parametrize("name", ["gpt", "gnmt"])
def test_dropin_zoo_models_with_recompute(name: str) -> None:
    """Tied weights and several outputs (GPT), whole LSTM modules (GNMT): every stage
    checkpointed, outputs and gradients still the model's."""
    from test_torch_stages import tiny
    _, model, inputs = tiny(name)
    ref = copy.deepcopy(model)
    pm = pipecc.compile(model, inputs, "3xcpu", recompute="full", microbatches=1, split_layers=False)
    assert all(s.recompute for s in pm.plan.stages)
    first = lambda out: out[0] if isinstance(out, (tuple, list)) else out  # noqa: E731
    out, want = first(pm(*inputs)), first(ref(*inputs))
    out.square().mean().backward()
    want.square().mean().backward()
    torch.testing.assert_close(out, want)
    for (key, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, msg=key)
