"""BPipe, the runtime half: the saved-tensor store (``pipecc.runtime.stash``) in one process and
between two gloo processes, and compiled BPipe folders run by ``pipecc run --verify`` on 4 ranks
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
from pipecc.runtime.stash import SavedTensors, module_storages, recv_stash, send_stash, storage_key
from pipecc.runtime.wire import Wire

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
        back = recv_stash(wire, 1, lambda i: 5000 + 2 * i, "RECV_R mb 0", device)
        assert [b.numel() for b in back] == sizes
        store.restore(back)
        y.square().sum().backward()
        ok = all(torch.equal(p.grad, w) for p, w in zip(block.parameters(), want))
        Path(result).write_text("ok" if ok else "gradients differ")
    else:  # the acceptor: receive and keep, send back
        kept = recv_stash(wire, 0, tag, "RECV_S mb 0", device)
        send_stash(wire, kept, 0, lambda i: 5000 + 2 * i, "SEND_R mb 0", key="R", device=device)
        wire.flush()
    dist.barrier()
    dist.destroy_process_group()


def test_stash_travels_between_two_gloo_processes(tmp_path: Path) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    init = f"file://{tempfile.mkdtemp(dir=tmp_path)}/store"
    result = tmp_path / "result.txt"
    mp.spawn(_transport_worker, args=(init, str(result)), nprocs=2, join=True)
    assert result.read_text() == "ok"
