"""A folder whose stages run on GPUs and CPUs (`h200@cuda:0,cpu`): under torchrun each rank runs on
its stages' device and every rank speaks gloo, a GPU rank's messages going through host memory
(pipecc.runtime.wire). The GPU half ran on an H100 (bench/RESULTS.md, "GPU check"); here, what
decides the devices, and the wire's host staging with a stand-in for the GPU."""
from __future__ import annotations

import pytest
import torch

from pipecc.errors import PipeccError, UsageError
from pipecc.runtime import rank as run_rank
from pipecc.runtime import wire
from pipecc.runtime.folder import stage_devices

PLAN = {"devices": [{"name": "h200", "kind": "gpu", "placement": "cuda:0"},
                    {"name": "cpu", "kind": "cpu", "placement": None},
                    {"name": "a100", "kind": "gpu", "placement": None},
                    {"name": "u280", "kind": "fpga", "placement": None},
                    {"name": "h200", "kind": "gpu", "placement": "cpu"}],
        "stages": [{"device": 0}, {"device": 1}, {"device": 2}, {"device": 3}, {"device": 4}]}


def test_each_stage_runs_on_its_devices_kind_or_placement():
    assert stage_devices(PLAN) == ["cuda:0", "cpu", None, "cpu", "cpu"]
    assert stage_devices({}) == []
    assert stage_devices({"devices": [], "stages": [{"device": 3}]}) == []


def test_a_folder_mixing_cpu_and_gpu_stages_speaks_gloo_and_refuses_nccl():
    on = stage_devices(PLAN)
    assert run_rank._heterogeneous(on, None) and run_rank._heterogeneous(on, "gloo")
    with pytest.raises(UsageError, match="stage 1 runs on the CPU, which NCCL cannot reach; use --backend gloo"):
        run_rank._heterogeneous(on, "nccl")
    gpus = {"devices": PLAN["devices"][:1], "stages": [{"device": 0}, {"device": 0}]}
    assert not run_rank._heterogeneous(stage_devices(gpus), "nccl")


def test_a_rank_takes_its_stages_device(monkeypatch):
    on = stage_devices(PLAN)
    assert run_rank._rank_device(on, [0], 0) == "cuda:0"
    assert run_rank._rank_device(on, [1, 3], 1) == "cpu"
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert run_rank._rank_device(on, [2], 2) == "cuda:3"
    with pytest.raises(PipeccError, match="rank 0 holds stages \\[0, 1\\] on different devices"):
        run_rank._rank_device(on, [0, 1], 0)


class _Done:
    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


def test_gloo_sends_and_receives_a_gpu_tensor_through_host_memory(monkeypatch):
    """The meta device stands in for the GPU: what reaches dist is on the CPU, and the received
    bytes are copied into the buffer on the rank's device."""
    sent, received = [], []
    monkeypatch.setattr(wire.dist, "isend", lambda t, dst, group=None, tag=0: sent.append(t) or _Done())

    def irecv(t, src, group=None, tag=0):
        received.append(t)
        t.fill_(7.0)
        return _Done()

    monkeypatch.setattr(wire.dist, "irecv", irecv)
    w = wire.Wire(rank=0, timeout_s=5.0)
    w.send(torch.ones(3), 1, 0, "x", key="a")
    assert sent[-1].device.type == "cpu"
    host = torch.zeros(2)
    w.recv([host], 1, [0], "y")
    assert received[-1] is host and torch.equal(host, torch.full((2,), 7.0))  # CPU: no copy
    posted = w.post([torch.empty(2, device="meta")], 1, [0], "z")
    assert received[-1].device.type == "cpu" and posted[0][2] is not None
    w.wait(posted)  # copies the host bytes into the meta buffer (a no-op there, but called)
    nccl = wire.Wire(rank=0, timeout_s=5.0, nccl=True)
    assert nccl.post([torch.empty(2, device="meta")], 1, [0], "z")[0][2] is None  # NCCL receives in place


def test_nccl_on_a_folder_with_cpu_stages_is_one_line(tmp_path):
    """`pipecc run --backend nccl` on a folder whose stage 1 runs on the CPU: one line, exit 1,
    the folder as it was."""
    from helpers import compile_mlp, pipecc_here
    out = compile_mlp(tmp_path / "mixed", devices="h200,cpu")
    before = sorted(p.name for p in out.rglob("*"))
    r = pipecc_here("run", str(out), "--steps", "1", "--backend", "nccl")
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines == [lines[0]] and "stage 1 runs on the CPU, which NCCL cannot reach; use --backend gloo" in lines[0]
    assert "Traceback" not in r.stderr and sorted(p.name for p in out.rglob("*")) == before
