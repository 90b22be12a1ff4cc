"""BPipe, the runtime half: the saved-tensor store (``pipecc.techniques.bpipe.runtime_stash``) in one process and
between two gloo processes, and a compiled BPipe folder (a 4-block GPT) run by ``pipecc run --verify`` on 4 ranks
(the stash actions executed, a planted bug caught), with the compile-time refusals."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from pipecc.errors import PipeccError
from pipecc.runtime.wire import Wire
from pipecc.techniques.bpipe.runtime_stash import (ALIGN, Prefetch, SavedTensors, header_sizes, module_storages,
                                                   pack_stash, recv_packed, send_stash, storage_key, unpack_stash)

pytestmark = pytest.mark.xdist_group(name="bpipe_run")

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------- the store, one process


class _Block(nn.Module):
    """Saves its input twice (two linears on x), a view of a weight (x @ w.t()), an int64 index
    tensor (gather) and a non-contiguous view (a transpose) of an activation."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(6, 8)
        self.w = nn.Parameter(torch.randn(8, 8))
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x)) * self.b(x) * self.scale
        t = h.t()  # [8, n], strided view
        g = torch.gather(h, 1, torch.argsort(h.detach(), dim=1))
        return (t.t() @ self.w.t()).sin() + g.exp()


def _grads(module: nn.Module, x: torch.Tensor, store: SavedTensors | None = None,
           move: bool = False) -> tuple[list[torch.Tensor], torch.Tensor, SavedTensors | None]:
    module.zero_grad()
    x = x.detach().requires_grad_(True)
    if store is None:
        y = module(x)
    else:
        with store.capture():
            y = module(x)
        if move:
            away = store.evict()
            assert store.nbytes == 0
            back = [b.clone() for b in away]  # the partner's copy; the originals go
            del away
            store.restore(back)
    y.square().sum().backward()
    return [p.grad.clone() for p in module.parameters()], x.grad.clone(), store


def test_store_skips_weights_and_deduplicates_storages() -> None:
    torch.manual_seed(0)
    block = _Block()
    store = SavedTensors(module_storages([block]), "stage 0 mb 0")
    with store.capture():
        block(torch.randn(5, 6, requires_grad=True))
    weights = module_storages([block])
    assert not set(store.keys) & weights  # no parameter, buffer or view of one is in the store
    assert len(store.keys) == len(set(store.keys)) < len(store.views)  # x saved twice: one storage
    assert store.sizes == [store.storages[i].numel() for i in range(len(store.keys))]
    assert any(v.dtype == torch.int64 for v in store.views)


def test_evicted_and_restored_store_gives_the_same_gradients() -> None:
    torch.manual_seed(0)
    block, x = _Block(), torch.randn(5, 6)
    want, want_x, _ = _grads(block, x)
    got, got_x, store = _grads(block, x, SavedTensors(module_storages([block]), "stage 0 mb 0"), move=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(got_x, want_x, rtol=0, atol=0)
    assert store.moves == 1


def _uses(storages: list) -> list[int]:
    """How many tensors (and storage objects) hold each storage now."""
    return [torch._C._storage_Use_Count(st._cdata) for st in storages]


def test_eviction_leaves_no_reference_behind() -> None:
    """Once the evicted buffers are dropped (the wire releases them when the send completed),
    nothing on the evictor holds the activations: the graph keeps handles, not tensors."""
    torch.manual_seed(0)
    block, x = _Block(), torch.randn(5, 6, requires_grad=True)
    store = SavedTensors(module_storages([block]), "stage 0 mb 0")
    with store.capture():
        y = block(x)
    resident = frozenset({storage_key(x)})  # the stage's input, which the engine keeps anyway
    probes = [t.untyped_storage() for t, key in zip(store.storages, store.keys) if key not in resident]
    assert probes and min(_uses(probes)) > 1
    away = store.evict(resident)
    del away
    assert _uses(probes) == [1] * len(probes)  # only the probes themselves
    assert y.requires_grad  # the graph is intact: only its saved activations left


def test_store_under_activation_checkpointing() -> None:
    """--recompute's stages run under torch.utils.checkpoint (non-reentrant): its saved inputs
    go through the store and the recomputation finds them after a round trip."""
    torch.manual_seed(0)
    block, x = _Block(), torch.randn(5, 6)
    want, want_x, _ = _grads(block, x)

    class Recomputed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = block

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)

    wrapped = Recomputed()
    got, got_x, store = _grads(wrapped, x, SavedTensors(module_storages([wrapped]), "stage 0 mb 0"), move=True)
    assert store.views  # the checkpoint's inputs
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(got_x, want_x, rtol=0, atol=0)


def test_store_errors() -> None:
    torch.manual_seed(0)
    block, x = _Block(), torch.randn(5, 6, requires_grad=True)
    store = SavedTensors(module_storages([block]), "stage 0 mb 3")
    with store.capture():
        y = block(x)
    resident = frozenset({storage_key(x)})
    away = store.evict(resident)
    assert storage_key(x) in [store.keys[i] for i in range(len(store.keys)) if store.storages[i] is not None]
    with pytest.raises(PipeccError, match="evicted twice"):
        store.evict()
    with pytest.raises(PipeccError, match="stage 0 mb 3: its saved activations are still on the partner stage"):
        y.sum().backward()
    with pytest.raises(PipeccError, match="the partner returned storages of"):
        store.restore(away[:-1])


def test_packed_stash_round_trip_rebuilds_every_view() -> None:
    """One payload per transfer (``pack_stash``): storages of odd byte counts and of several
    dtypes come back as aligned views of it, and the store's views rebuilt on them give the
    gradients bit for bit (an int64 index after a 5-byte storage must still be 8-aligned)."""
    odd = torch.arange(5, dtype=torch.uint8)
    payload = pack_stash([odd, torch.arange(24, dtype=torch.uint8)], torch.device("cpu"))
    assert header_sizes(payload) == [5, 24] and payload.numel() % ALIGN == 0
    views = unpack_stash(payload, [5, 24])
    assert [v.storage_offset() % ALIGN for v in views] == [0, 0]
    assert torch.equal(views[0], odd) and views[1].untyped_storage().data_ptr() == payload.untyped_storage().data_ptr()
    assert header_sizes(payload[:-ALIGN]) is None  # truncated: malformed, not misread

    torch.manual_seed(0)
    block, x = _Block(), torch.randn(5, 6)
    want, want_x, _ = _grads(block, x)
    block.zero_grad()
    store = SavedTensors(module_storages([block]), "stage 0 mb 0")
    xr = x.detach().requires_grad_(True)
    with store.capture():
        y = block(xr)
    sent = store.evict()
    assert len(sent) > 1 and {v.dtype for v in store.views} >= {torch.float32, torch.int64}
    packed = pack_stash(sent, torch.device("cpu")).clone()  # the bytes that come back
    del sent
    store.restore(unpack_stash(packed, store.away_sizes))
    y.square().sum().backward()
    for p, w in zip(block.parameters(), want):
        torch.testing.assert_close(p.grad, w, rtol=0, atol=0)
    torch.testing.assert_close(xr.grad, want_x, rtol=0, atol=0)


# ---------------------------------------------------------------------------- transport, two processes


def _transport_worker(rank: int, init: str, result: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    wire = Wire(rank, timeout_s=30)
    device = torch.device("cpu")
    tag = lambda i: 1000 + 2 * i  # noqa: E731
    if rank == 0:  # the evictor: send out, receive back, backward
        torch.manual_seed(0)
        block, x = _Block(), torch.randn(5, 6)
        want, _, _ = _grads(block, x)
        block.zero_grad()
        store = SavedTensors(module_storages([block]), "stage 0 mb 0")
        with store.capture():
            y = block(x.requires_grad_(True))
        sent = store.evict()
        sizes = store.away_sizes
        send_stash(wire, sent, 1, tag, "SEND_S mb 0", key="S", device=device)
        del sent
        wire.release(["S"])  # the send completed: the evictor holds none of it now
        assert not wire.inflight and store.nbytes == 0
        back = Prefetch(wire, 1, lambda i: 5000 + 2 * i, "RECV_R mb 0", device, sizes).wait()  # as the engine
        assert [b.numel() for b in back] == sizes
        store.restore(back)
        y.square().sum().backward()
        ok = all(torch.equal(p.grad, w) for p, w in zip(block.parameters(), want))
        Path(result).write_text("ok" if ok else "gradients differ")
    else:  # the acceptor: receive and keep, send back
        kept = recv_packed(wire, 0, tag, "RECV_S mb 0", device)  # kept whole, returned as it came
        send_stash(wire, kept, 0, lambda i: 5000 + 2 * i, "SEND_R mb 0", key="R", device=device, counted=False)
        wire.flush()
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow  # a torchrun launch of several processes (make test-fast leaves it out)
def test_stash_travels_between_two_gloo_processes(tmp_path: Path) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    init = f"file://{tempfile.mkdtemp(dir=tmp_path)}/store"
    result = tmp_path / "result.txt"
    mp.spawn(_transport_worker, args=(init, str(result)), nprocs=2, join=True)
    assert result.read_text() == "ok"


# ---------------------------------------------------------------------------- schedules from pairs

PAIRS = [{"evictor": 0, "acceptor": 3, "threshold": 2, "policy": "jit"},
         {"evictor": 1, "acceptor": 2, "threshold": 2, "policy": "jit"}]


def test_schedule_from_the_folders_pairs() -> None:
    from pipecc.ir.schedule import ActionKind
    from pipecc.runtime.engine import build_schedule
    from pipecc.runtime.wire import check_fifo, peer_rank

    s = build_schedule("1f1b", 4, 8, balancing=PAIRS)
    assert s.partner == (3, 2, 1, 0)
    check_fifo(s)  # NCCL's in-order matching holds with the stash messages
    sends = [a for a in s.actions[0] if a.kind is ActionKind.SEND_S]
    assert sends and all(peer_rank(s, a) == 3 for a in sends)
    assert all(peer_rank(s, a) == 0 for a in s.actions[3] if a.kind is ActionKind.SEND_R)
    eager = build_schedule("1f1b", 4, 8, balancing=[dict(p, policy="eager") for p in PAIRS])
    assert eager.partner == (3, 2, 1, 0) and eager != s
    # p = 2: the partner is the neighbour, stash and boundary messages share each direction
    two = build_schedule("1f1b", 2, 4, balancing=[{"evictor": 0, "acceptor": 1, "threshold": 1}])
    check_fifo(two)
    assert any(a.kind is ActionKind.SEND_S for a in two.actions[0])


@pytest.mark.parametrize("kind, pairs, error", [
    ("gpipe", PAIRS, "runs under the 1f1b schedule with one stage per rank, not schedule 'gpipe'"),
    ("1f1b", [dict(PAIRS[0], acceptor=2)], "odd pairing (0, 2), pairs are (s, p-1-s) with s < p//2 (p = 4)"),
    ("1f1b", [dict(PAIRS[1], evictor=2, acceptor=2)], "odd pairing (2, 2)"),
    ("1f1b", [PAIRS[0], PAIRS[0]], "stage 0 appears in two pairs"),
    ("1f1b", [dict(PAIRS[0], threshold=0)], "threshold 0 of stage 0 is out of range 1..4"),
    ("1f1b", [PAIRS[0], dict(PAIRS[1], policy="eager")], "mix return policies"),
])
def test_schedule_refuses_bad_pairs(kind: str, pairs: list[dict], error: str) -> None:
    from pipecc.runtime.engine import build_schedule
    with pytest.raises(PipeccError, match=error.replace("(", r"\(").replace(")", r"\)")):
        build_schedule(kind, 4, 8, balancing=pairs)


# ---------------------------------------------------------------------------- a compiled folder, 4 ranks

GPT = {"n_layer": 4, "n_head": 4, "n_embd": 128, "vocab_size": 256, "block_size": 32, "seq_len": 16}


@pytest.fixture(scope="module")
def gpt_plan():
    """models/gpt.py (one transformer block per stage, tied embedding) on 4xcpu, -b 8 -m 8, 1f1b,
    replicas 1: (analysis, plan, graph)."""
    import dataclasses

    from pipecc import driver
    model = str(ROOT / "models" / "gpt.py")
    analysis = driver.analyze(model, model_args=GPT, batch_size=8)
    plan, graph = driver.plan(analysis, "4xcpu", batch_size=8, microbatches=8, schedule="1f1b", replicas=1)
    plan = dataclasses.replace(plan, model_path=model, model_args=dict(GPT))
    assert len(plan.stages) == 4 and all(any("blocks" in n for n in s.nodes) for s in plan.stages)
    return analysis, plan, graph


@pytest.fixture(scope="module")
def bpipe_out(gpt_plan, tmp_path_factory) -> Path:
    """The folder with stages 0 and 1 keeping 2 stashes each (1F1B holds 4 and 3): both evict."""
    import dataclasses

    from pipecc import driver
    analysis, plan, graph = gpt_plan
    out = tmp_path_factory.mktemp("bpipe") / "gpt"
    driver.compile(analysis, dataclasses.replace(plan, activation_balancing=PAIRS), graph, out)
    return out


def test_compiled_folder_records_the_pairs(bpipe_out: Path) -> None:
    import json
    marker = json.loads((bpipe_out / "pipecc.json").read_text())
    assert marker["activation_balancing"] == PAIRS and marker["schedule"] == "1f1b"


@pytest.mark.slow  # a torchrun launch of several processes (make test-fast leaves it out)
def test_torchrun_bpipe_folder_verifies_and_evicts(bpipe_out: Path) -> None:
    import json

    from helpers import pipecc_here
    result = pipecc_here("run", str(bpipe_out), "--verify", "--steps", "2", "--json")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "verify: outputs, loss and" in result.stderr and "gradients match the single-process run" in result.stderr
    rows = {row["index"]: row for row in json.loads(result.stdout)["stages"]}
    # 1F1B stashes 4 and 3 micro-batches on stages 0 and 1; with K = 2 the jit policy evicts
    # after every F that overflows (the counts are the schedule's SEND_S actions per step)
    from pipecc.ir.schedule import ActionKind
    from pipecc.runtime.engine import build_schedule
    s = build_schedule("1f1b", 4, 8, balancing=PAIRS)
    planned = [sum(a.kind is ActionKind.SEND_S for a in row) for row in s.actions]
    assert planned[0] > 0 and planned[1] > 0 and planned[2:] == [0, 0]
    assert [rows[i]["stash_evictions"] for i in range(4)] == planned
    assert rows[0]["stash_evicted_bytes"] > 0 and rows[1]["stash_evicted_bytes"] > 0


LAUNCHER = '''
import os
import sys

import torch

from pipecc.runtime import engine
from pipecc.runtime.wire import Wire, check_fifo, directed_groups
from pipecc.techniques.bpipe import runtime_stash as stash

if os.environ.get("PLANT") == "restore":  # the planted bug: one returned storage comes back as zeros
    restore = stash.SavedTensors.restore

    def wrong(self, buffers):
        buffers = list(buffers)
        buffers[0] = torch.zeros_like(buffers[0])
        restore(self, buffers)

    stash.SavedTensors.restore = wrong
if os.environ.get("NCCL_LIKE"):  # NCCL's wire on gloo: a group per direction, messages matched in order
    init = engine.PipelineRuntime.__init__

    def nccl_like(self, *args, **kwargs):
        init(self, *args, **kwargs)
        check_fifo(self.schedule)
        self._wire = Wire(self.global_rank, self._config.timeout_s, groups=directed_groups(self.schedule),
                          by_order=True)

    engine.PipelineRuntime.__init__ = nccl_like
from pipecc.runtime.dist import main
sys.exit(main())
'''


def _launch(out: Path, tmp_path: Path, **env: str):
    import subprocess
    import sys
    script = tmp_path / "launch.py"
    script.write_text(LAUNCHER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--standalone",
                           str(script), str(out), "--verify", "--steps", "1"],
                          capture_output=True, text=True, env=env, timeout=180)


@pytest.mark.slow  # a torchrun launch of several processes (make test-fast leaves it out)
def test_planted_restore_bug_fails_verify(bpipe_out: Path, tmp_path: Path) -> None:
    result = _launch(bpipe_out, tmp_path, PLANT="restore")
    assert result.returncode != 0
    assert "verify: rank 0 stage 0 gradient of" in result.stderr and "differs" in result.stderr, result.stderr[-3000:]


@pytest.mark.slow  # a torchrun launch of several processes (make test-fast leaves it out)
def test_nccl_like_wire_verifies(bpipe_out: Path, tmp_path: Path) -> None:
    """The stash messages (a header, then a message per storage) keep NCCL's in-order matching on
    the partner pair's own directed groups."""
    result = _launch(bpipe_out, tmp_path, NCCL_LIKE="1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "gradients match the single-process run" in result.stdout


@pytest.mark.parametrize("flags, error", [
    (["--schedule", "gpipe"], "--schedule gpipe: activation balancing (BPipe) pairs stages under the 1f1b schedule "
                              "only, not gpipe: use --schedule 1f1b, or --activation-balancing off (or drop --schedule)"),
    (["--schedule", "zb-h1"], "--schedule zb-h1: activation balancing (BPipe) pairs stages under the 1f1b schedule"),
])
def test_run_refuses_other_schedules(bpipe_out: Path, capsys, flags: list[str], error: str) -> None:
    from helpers import run_cli
    code, _, err = run_cli(["run", str(bpipe_out), *flags], capsys)
    assert code == 2 and err.count("\n") == 1 and error in err


def test_one_process_runs_the_folder_without_balancing(bpipe_out: Path, capsys) -> None:
    """Without torchrun every stage is on one rank: a partner there frees nothing, so the run
    goes without stash transfers (same numerics)."""
    from pipecc.runtime import dist as rundist
    assert rundist.main([str(bpipe_out), "--verify", "--steps", "1", "--schedule", "interleaved"]) == 0
    assert "gradients match the single-process run" in capsys.readouterr().out


# ---------------------------------------------------------------------------- compile-time refusals


@pytest.mark.parametrize("change, error", [
    ({"schedule": "gpipe"}, "activation balancing (BPipe) pairs stages under the 1f1b schedule only, not gpipe"),
    ({"schedule": "inference"}, "activation balancing (BPipe) needs a training plan"),
    ({"virtual_stages": 2}, "needs one stage per device, not 2"),
    ({"microbatch_sizes": [[1, 3, 4]] * 4}, "needs equal micro-batches"),
    ({"activation_balancing": [dict(PAIRS[0], acceptor=2)]}, "odd pairing (0, 2)"),
    ({"activation_balancing": [dict(PAIRS[0], evictor=3, acceptor=0)]}, "odd pairing (3, 0)"),
    ({"activation_balancing": [dict(PAIRS[0], threshold=-1)]}, "threshold -1 of stage 0 is out of range"),
    ({"activation_balancing": [dict(PAIRS[0], policy="lazy")]}, "policy 'lazy'"),
])
def test_bpipe_rule_refuses_what_cannot_run(gpt_plan, change: dict, error: str) -> None:
    """BPipe's rule (`pipecc.techniques.bpipe.requires`) on edited plans: one line each; the
    folder's record of a plan without pairs is []."""
    import dataclasses

    from pipecc.techniques.bpipe.codegen import check_activation_balancing
    from pipecc import techniques
    analysis, plan, graph = gpt_plan
    bad = dataclasses.replace(plan, **{"activation_balancing": PAIRS, **change})
    message = techniques.bpipe.requires(bad, techniques.COMPILED)
    assert message is not None and error in message and "\n" not in message
    assert check_activation_balancing(dataclasses.replace(plan, activation_balancing=[])) == []


def test_cli_compile_refusal_is_one_line_and_writes_nothing(gpt_plan, tmp_path: Path, capsys,
                                                             monkeypatch) -> None:
    """A plan with BPipe under gpipe, through `pipecc compile`: exit 1, one line, no OUT."""
    import dataclasses

    from helpers import run_cli
    from pipecc.cli import compile as cli_compile
    analysis, plan, graph = gpt_plan
    bad = dataclasses.replace(plan, schedule="gpipe", activation_balancing=PAIRS)
    monkeypatch.setattr(cli_compile, "plan_from_args", lambda args: (analysis, bad, graph))
    out = tmp_path / "out"
    code, _, err = run_cli(["compile", str(ROOT / "models" / "gpt.py"), "-d", "4xcpu", "--replicas", "1",
                            "-o", str(out), "-q"], capsys)
    assert code == 1 and err.count("\n") == 1
    assert err.startswith("pipecc: error: activation balancing (BPipe) pairs stages under the 1f1b schedule only")
    assert not out.exists() and not list(tmp_path.iterdir())
