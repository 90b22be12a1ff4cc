"""PP x DP at run time: a compiled folder whose stages run on groups of replicas
(`pipecc.techniques.replicas.runtime`), launched by `pipecc run` with one rank per device.

Launches cost seconds each, so there are few: the tiny MLP as 2 stages x 2 replicas (1F1B,
--verify and --json in one launch), and as plain data parallelism (1 stage x 2 replicas:
--verify, a checkpoint resumed, forward-only --verify). The rest runs in process: the data
slices, the loss weight and the gradient all-reduce's hooks (each of which a wrong runtime
would fail), the compile-time refusals and the launcher's process counts.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers import MLP_TINY, model_args
from helpers import pipecc_here as pipecc  # in this process: only torchrun and its ranks start
from pipecc import cli, driver
from pipecc.errors import PipeccError
from pipecc.techniques.replicas import runtime as rep
from pipecc.runtime.timing import run_document

# NOTE: tests sharing a compiled folder (module fixtures) stay on one worker under xdist.
pytestmark = pytest.mark.xdist_group(name="hybrid_run")

ROOT = Path(__file__).resolve().parents[1]
STEP = re.compile(r"^step (\d+): loss (\S+), (\S+) samples/s$", re.MULTILINE)


def replicated_plan(devices: str, replicas: int, batch: int = 8, microbatches: int = 2):
    """A plan for `devices` turned into one whose every stage runs on `replicas` devices (the
    contract's layout: device entries repeated, stage j on devices j*d .. j*d+d-1)."""
    analysis = driver.analyze(ROOT / "models" / "mlp.py", model_args=dict(MLP_TINY), batch_size=batch)
    plan, graph = driver.plan(analysis, devices, microbatches=microbatches, schedule="1f1b")
    plan.model_path, plan.model_args = str(ROOT / "models" / "mlp.py"), dict(MLP_TINY)
    plan.devices = [dev for dev in plan.devices for _ in range(replicas)]
    plan.replicas = replicas
    for stage in plan.stages:
        stage.device *= replicas
        stage.replica_devices = list(range(stage.device, stage.device + replicas))
    return analysis, plan, graph


def cli_has_replicas() -> bool:
    """Whether `pipecc plan/compile` take `--replicas N` (the planner's half of PP x DP)."""
    import argparse

    from pipecc.cli.args import add_plan_args
    parser = argparse.ArgumentParser()
    add_plan_args(parser)
    return "--replicas" in parser._option_string_actions


def compile_replicated(out: Path, pipeline_devices: int, replicas: int, batch: int = 8, microbatches: int = 2) -> Path:
    """The tiny MLP on `pipeline_devices * replicas` CPUs, every stage on `replicas` of them:
    through `pipecc compile --replicas` when it exists (end to end), else the python API."""
    if not cli_has_replicas():
        analysis, plan, graph = replicated_plan(f"{pipeline_devices}xcpu", replicas, batch, microbatches)
        driver.compile(analysis, plan, graph, out)
        return out
    argv = ["compile", str(ROOT / "models" / "mlp.py"), "--devices", f"{pipeline_devices * replicas}xcpu",
            "--replicas", str(replicas), "-o", str(out), "-b", str(batch), "-m", str(microbatches),
            "--schedule", "1f1b", "--use-all-devices", "-q"]
    for arg in model_args(MLP_TINY):
        argv += ["--model-arg", arg]
    assert cli.main(argv) == 0
    return out


@pytest.fixture(scope="module")
def pp_dp(tmp_path_factory) -> Path:
    """2 stages x 2 replicas: 4 ranks."""
    return compile_replicated(tmp_path_factory.mktemp("hybrid") / "mlp_2x2", 2, 2)


@pytest.fixture(scope="module")
def dp(tmp_path_factory) -> Path:
    """Plain data parallelism: 1 stage x 2 replicas."""
    return compile_replicated(tmp_path_factory.mktemp("hybrid") / "mlp_1x2", 1, 2)


# ---------------------------------------------------------------------------- launches


@pytest.mark.slow  # a torchrun launch of several processes (make test-fast leaves it out)
def test_two_stages_two_replicas_verify_and_json(pp_dp: Path) -> None:
    marker = json.loads((pp_dp / "pipecc.json").read_text())
    assert marker["replicas"] == 2 and len(marker["devices"]) == 4 and marker["num_stages"] == 2
    run = pipecc("run", str(pp_dp), "--steps", "2", "--verify", "--json", "--timeout", "60")
    assert run.returncode == 0, run.stderr[-3000:]
    # 6 parameters per replica set, checked on both replicas, after their all-reduce
    assert "verify: outputs, loss and 12 gradients match the single-process run" in run.stderr
    assert len(STEP.findall(run.stderr)) == 2  # one replica of the last stage prints
    document = json.loads(run.stdout)
    rows = [(row["index"], row["rank"], row["replica"]) for row in document["stages"]]
    assert rows == [(0, 0, 0), (0, 1, 1), (1, 2, 0), (1, 3, 1)]
    assert all(row["forward_samples"] == 2 and row["backward_samples"] == 2 for row in document["stages"])
    assert document["batch_size"] == 8 and document["steps"] == 1


@pytest.mark.slow  # a torchrun launch of several processes (make test-fast leaves it out)
def test_uneven_slices_run_and_verify(tmp_path: Path) -> None:
    """2 stages x 2 replicas, micro-batches of 3 rows: replica 0 takes 2 of each, replica 1 one
    (ports, messages and loss weights per replica); --verify checks outputs, loss and gradients."""
    out = compile_replicated(tmp_path / "mlp_uneven", 2, 2, batch=6, microbatches=2)
    assert json.loads((out / "pipecc.json").read_text())["replicas"] == 2
    run = pipecc("run", str(out), "--steps", "2", "--verify", "--json", "--timeout", "60")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "verify: outputs, loss and 12 gradients match the single-process run" in run.stderr
    assert len(STEP.findall(run.stderr)) == 2
    rows = [(row["index"], row["rank"], row["replica"]) for row in json.loads(run.stdout)["stages"]]
    assert rows == [(0, 0, 0), (0, 1, 1), (1, 2, 0), (1, 3, 1)]


def _replicas_agree(step_dir: Path) -> None:
    """Both replicas' checkpoints hold the same weights and optimizer state (the all-reduce keeps
    them equal), and each its own file set."""
    from safetensors.torch import load_file
    assert sorted(p.name for p in step_dir.iterdir()) == [
        "stage_0.json", "stage_0.safetensors", "stage_0.sha256", "stage_1.json", "stage_1.safetensors",
        "stage_1.sha256"]  # each file set with its checksums (pipecc.runtime.checkpoints)
    a, b = (load_file(step_dir / f"stage_{g}.safetensors") for g in (0, 1))
    keys = [k for k in a if not k.startswith("rng.")]
    assert keys and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in keys)


@pytest.mark.slow  # a torchrun launch of several processes (make test-fast leaves it out)
def test_plain_data_parallel_verify_resume_and_inference(dp: Path, tmp_path: Path) -> None:
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--optimizer", "adam", "--timeout", "60"]
    first = pipecc("run", str(dp), "--steps", "2", "--verify", *ckpt)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "verify: outputs, loss and 12 gradients match the single-process run" in first.stdout
    assert [i for i, _, _ in STEP.findall(first.stdout)] == ["0", "1"]
    _replicas_agree(tmp_path / "ckpt" / "step_2")
    resumed = pipecc("run", str(dp), "--steps", "3", "--resume", *ckpt)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [i for i, _, _ in STEP.findall(resumed.stdout)] == ["2"]
    _replicas_agree(tmp_path / "ckpt" / "step_3")

    forward = pipecc("run", str(dp), "--steps", "1", "--verify", "--schedule", "inference", "--timeout", "60")
    assert forward.returncode == 0, forward.stderr[-3000:]
    assert "verify: outputs match the single-process run (forward only)" in forward.stdout


# ---------------------------------------------------------------------------- in process: launcher, compile


def test_launcher_starts_one_rank_per_device(pp_dp: Path, capsys) -> None:
    assert cli.main(["run", str(pp_dp), "--print-command"]) == 0
    assert "--nproc-per-node 4 --standalone" in capsys.readouterr().out
    argv = ["run", str(pp_dp), "--nnodes", "2", "--rdzv-endpoint", "10.0.0.1:29500", "--print-command"]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out.count("--nproc-per-node 2 --nnodes 2") == 2
    argv = ["run", str(pp_dp), "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1:1234",
            "--nproc-per-node", "1"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "needs 4 processes (2 stages, each on 2 replicas)" in err and len(err.strip().splitlines()) == 1


def test_microbatches_that_do_not_split_over_the_replicas_are_refused(pp_dp: Path, capsys) -> None:
    assert cli.main(["run", str(pp_dp), "--microbatches", "8"]) == 2  # micro-batches of 1 row, 2 replicas
    err = capsys.readouterr().err
    assert err.startswith("pipecc: error: --microbatches 8: 2 replicas leave a replica without rows: a "
                          "micro-batch of 1 splits over at most 1 replica;")
    assert "use --microbatches 1, 2, 4" in err and len(err.strip().splitlines()) == 1


def test_compile_refuses_plans_the_runtime_cannot_run(tmp_path: Path) -> None:
    from pipecc import techniques
    analysis, plan, graph = replicated_plan("2xcpu", 2)
    assert techniques.replicas.requires(plan, techniques.COMPILED) is None
    plan.stages[1].replica_devices = [3, 2]
    assert "stage 1 runs on device 2 with replicas [3, 2]; with 2 replicas per stage and 2 pipeline ranks it " \
           "belongs on rank 1: devices [2, 3]" in techniques.replicas.requires(plan, techniques.COMPILED)
    plan.stages[1].replica_devices = [2, 3]
    plan.microbatches = 8
    with pytest.raises(PipeccError, match=r"a micro-batch of 1 splits over at most 1 replica; plan with "
                                          r"--microbatches 1, 2, 4"):
        driver.compile(analysis, plan, graph, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------- in process: the numerics


def test_replica_slices_partition_every_microbatch() -> None:
    x = torch.arange(24.0).reshape(12, 2)
    m, d = 3, 2
    parts = [rep.replica_slice(x, 0, m, d, r) for r in range(d)]
    assert [p.shape[0] for p in parts] == [6, 6]
    # replica r's micro-batch i (what the runtime's own split of its rows gives) is slice r of micro-batch i
    for i, mb in enumerate(torch.tensor_split(x, m)):
        mine = [torch.tensor_split(p, m)[i] for p in parts]
        assert torch.equal(torch.cat(mine), mb)
    target = (torch.arange(12), torch.arange(12) * 10)
    got = rep.replica_target(target, m, d, 1)
    assert isinstance(got, tuple) and got[0].tolist() == [2, 3, 6, 7, 10, 11] and got[1].tolist() == [20, 30, 60, 70,
                                                                                                         100, 110]
    assert rep.replica_inputs([x, 5], [0, None], m, d, 0)[1] == 5
    ports = {"receives": [{"name": "x", "kind": "tensor", "shape": [12, 2], "batch_dim": 0},
                          {"name": "t", "kind": "tuple", "items": [{"kind": "tensor", "shape": [4, 24],
                                                                    "batch_dim": 1}]}],
             "sends": [{"name": "n", "kind": "object"}]}
    scaled = rep.replica_ports(ports, d)
    assert scaled["receives"][0]["shape"] == [6, 2] and scaled["receives"][1]["items"][0]["shape"] == [4, 12]
    assert ports["receives"][0]["shape"] == [12, 2]  # the spec itself is left alone


def test_uneven_slices_ports_and_shares() -> None:
    """A micro-batch of mb rows over d replicas: torch.tensor_split's slices (the first mb % d one
    row more), replica r's micro-batch i still slice r of micro-batch i, ports sized per replica."""
    x = torch.arange(22.0).reshape(11, 2)[:10]  # batch 10, m = 2: micro-batches of 5 over 3 replicas
    m, d = 2, 3
    assert rep.slice_sizes(5, 3) == [2, 2, 1] and [rep.replica_rows(10, m, d, r) for r in range(d)] == [4, 4, 2]
    parts = [rep.replica_slice(x, 0, m, d, r) for r in range(d)]
    assert [p.shape[0] for p in parts] == [4, 4, 2]
    for i, mb in enumerate(torch.tensor_split(x, m)):
        assert torch.equal(torch.cat([torch.tensor_split(p, m)[i] for p in parts]), mb)
    assert rep.replica_target(torch.arange(10), m, d, 2).tolist() == [4, 9]
    # a batch dim of c * B rows (here 3 per sample) is cut in whole samples
    y = torch.arange(30)
    assert rep.replica_slice(y, 0, m, d, 2, batch=10).tolist() == [12, 13, 14, 27, 28, 29]
    ports = {"receives": [{"name": "x", "kind": "tensor", "shape": [10, 2], "batch_dim": 0},
                          {"name": "t", "kind": "tensor", "shape": [4, 30], "batch_dim": 1}], "sends": []}
    shapes = [[p["shape"] for p in rep.replica_ports(ports, d, r, m, 10)["receives"]] for r in range(d)]
    assert shapes == [[[4, 2], [4, 12]], [[4, 2], [4, 12]], [[2, 2], [4, 6]]]
    # equal slices: as before (1/d of every batch dim, whatever batch is given)
    assert rep.replica_ports(ports, 2, 1, 1, 10)["receives"][1]["shape"] == [4, 15]
    assert [rep.loss_share(5, 3, r) for r in range(3)] == [0.4, 0.4, 0.2] and rep.loss_share(8, 4, 3) == 0.25
    assert rep.Replicas(3, 2).weight == pytest.approx(1 / 3) and rep.Replicas(3, 2, share=0.2).weight == 0.2
    with pytest.raises(PipeccError, match="batch dim of 7 rows is not a multiple of the batch of 10"):
        rep.replica_ports({"receives": [{"name": "z", "shape": [7], "batch_dim": 0}]}, d, 0, m, 10)
    assert rep.replica_problem(32, 1, 3) is None and rep.replica_problem(6, 2, 2) is None  # 3 rows: 2 + 1
    assert rep.replica_problem(6, 4, 2) is not None  # micro-batches of 2, 2, 1, 1 rows: unequal


def _replica_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor, m: int, d: int, share) -> list:
    """Each replica's accumulated gradients, weighted as the runtime weights its micro-batch losses
    (`share(r)`: replica r's weight on top of the micro-batch's share of its rows)."""
    grads = []
    for r in range(d):
        model.zero_grad()
        xr, yr = rep.replica_slice(x, 0, m, d, r), rep.replica_slice(y, 0, m, d, r)
        for xi, yi in zip(torch.tensor_split(xr, m), torch.tensor_split(yr, m)):
            loss = nn.functional.cross_entropy(model(xi), yi) * (xi.shape[0] / xr.shape[0]) * share(r)
            loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    return grads


def test_loss_share_makes_the_replicas_gradients_sum_to_the_full_batch() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    nn.functional.cross_entropy(model(x), y).backward()
    full = [p.grad.clone() for p in model.parameters()]
    m, d = 2, 4
    grads = _replica_grads(model, x, y, m, d, lambda r: rep.loss_share(16 // m, d, r))
    summed = [sum(g[k] for g in grads) for k in range(len(full))]
    for got, want in zip(summed, full):
        torch.testing.assert_close(got, want)
    # what the checks are for: one replica's gradients alone (no all-reduce), or no loss weight, are wrong
    assert not torch.allclose(grads[0][0], full[0], rtol=1e-3, atol=1e-5)
    unweighted = _replica_grads(model, x, y, m, d, lambda r: 1.0)
    assert not torch.allclose(sum(g[0] for g in unweighted), full[0], rtol=1e-3, atol=1e-5)
    # uneven: micro-batches of 8 over 3 replicas (3/3/2 rows): shares 3/8, 3/8, 2/8 give the full
    # batch's gradients, the equal-slice 1/3 does not
    d = 3
    grads = _replica_grads(model, x, y, m, d, lambda r: rep.loss_share(16 // m, d, r))
    for k, want in enumerate(full):
        torch.testing.assert_close(sum(g[k] for g in grads), want)
    equal = _replica_grads(model, x, y, m, d, lambda r: 1.0 / d)
    assert not torch.allclose(sum(g[0] for g in equal), full[0], rtol=1e-3, atol=1e-5)
    assert rep.replica_problem(8, 2, 2) is None and rep.replica_problem(8, 8, 2) is not None
    assert rep.replica_problem(6, 4, 2) is not None  # micro-batches of 2, 2, 1, 1 rows


class _Work:
    def __init__(self, log: list, tensor: torch.Tensor) -> None:
        self.log, self.tensor = log, tensor

    def wait(self, timeout=None) -> bool:
        self.log.append(("wait", self.tensor.data_ptr()))
        self.tensor.mul_(2)  # as if the other replica held the same gradient
        return True


def test_gradient_all_reduce_starts_in_the_last_backward_and_covers_every_parameter(monkeypatch) -> None:
    """Every parameter's final gradient is all-reduced (SUM, the stage's group, asynchronously),
    started by its hook during the backward, and completed by wait()."""
    log: list = []

    def all_reduce(tensor, op=None, group=None, async_op=False):
        assert async_op and group == "group-0" and op == torch.distributed.ReduceOp.SUM
        log.append(("start", tensor.data_ptr(), in_backward[0]))
        return _Work(log, tensor)

    monkeypatch.setattr(rep.dist, "all_reduce", all_reduce)
    torch.manual_seed(0)
    unused = nn.Linear(2, 2)  # no gradient: not reduced (its grad stays None)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    in_backward = [False]

    def mark(_grad):  # a hook on the output: runs first in the backward, so hooks after it are "during"
        in_backward[0] = True

    sync = rep.GradientAllReduce("group-0", 0, 5.0)
    out = model(torch.randn(3, 4)).sum()
    out.register_hook(mark)
    out.backward()  # an earlier micro-batch: no hooks armed, nothing reduced
    assert log == []
    sync.arm([*model.parameters(), *unused.parameters()])
    out = model(torch.randn(3, 4)).sum()
    out.register_hook(mark)
    out.backward()
    in_backward[0] = False  # what disarm() would start now is not overlapped with the backward
    sync.disarm()
    params = list(model.parameters())
    started = [entry for entry in log if entry[0] == "start"]
    assert sorted(e[1] for e in started) == sorted(p.grad.data_ptr() for p in params)
    assert all(during for _, _, during in started)  # launched from the hooks, inside the backward
    before = [p.grad.clone() for p in params]
    sync.wait()
    assert [e[0] for e in log].count("wait") == len(params)
    assert all(torch.equal(p.grad, 2 * b) for p, b in zip(params, before))
    assert unused.weight.grad is None
    out = model(torch.randn(3, 4)).sum()
    out.backward()  # disarmed: a later backward adds no all-reduce
    assert len([e for e in log if e[0] == "start"]) == len(params)


def test_json_rows_carry_the_replica_and_its_device() -> None:
    plan = {"devices": [{"name": "a100"}, {"name": "a100"}, {"name": "v100"}, {"name": "v100"}],
            "stages": [{"index": 0, "device": 0, "replica_devices": [0, 1], "forward_s": 1.0, "backward_s": 2.0},
                       {"index": 1, "device": 2, "replica_devices": [2, 3], "forward_s": 1.0, "backward_s": 2.0}]}
    summaries = [{"rank": g, "replica": g % 2, "stages": [g // 2], "forward": [[0.1]], "backward": [[0.2]],
                  "step_s": [1.0], "recv_wait_s": [0.0], "warmup": 1} for g in (3, 1, 0, 2)]
    document = run_document(summaries, plan, "1f1b", 2, 8)
    assert [(r["index"], r["rank"], r["replica"], r["device"]) for r in document["stages"]] == [
        (0, 0, 0, "a100"), (0, 1, 1, "a100"), (1, 2, 0, "v100"), (1, 3, 1, "v100")]
