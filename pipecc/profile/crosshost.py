"""The link between hosts: `pipecc profile ... --nnodes N --node-rank R --rdzv-endpoint HOST:PORT`.

The same command runs on every host; this module is its link part, one process per host
(node R is rank R of N). They meet at a `TCPStore` that node 0 opens at HOST:PORT:

    node 0   opens the store, publishes the ping-pong settings, waits up to --timeout for
             every other node to join, then for r = 1 .. N-1 in turn: picks the backend
             with node r, ping-pongs as rank 0 of a two-rank group of the pair
             (`link.pair_group` on the store prefix "pipecc/link<r>/", `link.ping_pong`),
             fits the samples (`link.link_record`) and hands node r the record
    node r   connects to HOST:PORT (up to --timeout), joins, waits for its turn, echoes as
             rank 1, reads the record and says it is done (node 0 keeps the store up until
             then, or --timeout)

A record is `link.link_record`'s with {"scope": "cross-host", "endpoint": "HOST:PORT",
"nodes": [0, r], "hosts": [host name of node 0, of node r]} in front.

Backend per pair: NCCL when both ends have a GPU in their --devices and torch has NCCL, else
gloo between CPU buffers. gloo binds to the address this host reaches HOST through (the
interface GLOO_SOCKET_IFNAME names, if set).

NOTE: waits poll the store (`check`) and a first TCP connect stands in for the store
client's own retries: c10d's blocking waits and connection retries log multi-line C++
errors on stderr, and a node that never shows up must be one `pipecc: error:` line that
names the endpoint.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Sequence

from pipecc.errors import PipeccError
from pipecc.profile.link import DEFAULT_SIZES, link_record, pair_group, ping_pong

__all__ = ["Rendezvous", "link_device", "measure_cross_host", "summary_line"]

PREFIX = "pipecc/profile/"
_POLL_S = 0.05


@dataclass(frozen=True)
class Rendezvous:
    """Where and how the hosts meet (`--rdzv-endpoint`, `--nnodes`, `--node-rank`, `--timeout`)."""

    endpoint: str            # HOST:PORT of node 0
    nnodes: int
    node_rank: int
    timeout_s: float = 60.0

    @property
    def host(self) -> str:
        return self.endpoint.rpartition(":")[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.endpoint.rpartition(":")[2])


def link_device(torch_devices: Sequence[str]) -> tuple[str, bool]:
    """(the torch device this host's end of the link uses, whether it can use NCCL): its
    first GPU when it has one and torch has NCCL, else the CPU."""
    import torch.distributed as dist
    gpus = [d for d in torch_devices if d.startswith("cuda")]
    nccl = bool(gpus) and dist.is_available() and dist.is_nccl_available()
    return (gpus[0] if nccl else "cpu"), nccl


def measure_cross_host(rdzv: Rendezvous, device: str, nccl: bool, *,
                       sizes: Sequence[int] = DEFAULT_SIZES, warmup: int = 2,
                       repeat: int = 5) -> list[dict[str, Any]]:
    """Node 0: the records of its links to nodes 1 .. N-1. Node r: the record of its link
    to node 0 (node 0's settings `sizes`, `warmup`, `repeat` apply). Raises a one-line
    PipeccError naming the endpoint when a node does not show up within the timeout."""
    if rdzv.nnodes < 2 or not 0 <= rdzv.node_rank < rdzv.nnodes:
        raise ValueError(f"measure_cross_host needs 0 <= node_rank < nnodes >= 2, got {rdzv}")
    me = {"device": device, "nccl": nccl, "host": socket.gethostname(), "nnodes": rdzv.nnodes}
    if rdzv.node_rank == 0:
        store = _open(rdzv)
        _set(store, rdzv, "config", json.dumps({"sizes": list(sizes), "warmup": warmup,
                                                "repeat": repeat, "nnodes": rdzv.nnodes}))
        _join(store, rdzv, me)
        deadline = time.monotonic() + rdzv.timeout_s
        for r in range(1, rdzv.nnodes):
            _await(store, rdzv, f"info/{r}", deadline,
                   f"node {r} did not join the rendezvous at {rdzv.endpoint} within "
                   f"{rdzv.timeout_s:g} s; start `pipecc profile ... --nnodes {rdzv.nnodes} "
                   f"--node-rank {r} --rdzv-endpoint {rdzv.endpoint}` on it (or raise --timeout)")
        records = [_lead(store, rdzv, r, me, sizes, warmup, repeat) for r in range(1, rdzv.nnodes)]
        deadline = time.monotonic() + rdzv.timeout_s
        for r in range(1, rdzv.nnodes):  # keep the store up until every node has its record
            while not _check(store, rdzv, f"done/{r}") and time.monotonic() < deadline:
                time.sleep(_POLL_S)
        return records
    store = _connect(rdzv)
    deadline = time.monotonic() + rdzv.timeout_s
    _await(store, rdzv, "config", deadline, f"node 0 at {rdzv.endpoint} did not answer within "
           f"{rdzv.timeout_s:g} s")
    config = json.loads(_get(store, rdzv, "config"))
    if config["nnodes"] != rdzv.nnodes:
        raise PipeccError(f"node 0 at {rdzv.endpoint} runs with --nnodes {config['nnodes']}, this "
                          f"node with --nnodes {rdzv.nnodes}; give every node the same --nnodes")
    _join(store, rdzv, me)
    return [_follow(store, rdzv, config)]


def summary_line(record: dict[str, Any], node_rank: int) -> str:
    """Node r's one line on its link to node 0."""
    peer = record["nodes"][0] if node_rank != record["nodes"][0] else record["nodes"][1]
    return (f"node {node_rank}: cross-host {record['backend']} link to node {peer} "
            f"({record['hosts'][0]} <-> {record['hosts'][1]}, rendezvous {record['endpoint']}): "
            f"latency {record['latency_s'] * 1e6:.1f} us, bandwidth "
            f"{record['bandwidth_Bps'] / 1e9:.3g} GB/s; node 0 writes the profile")


# ----------------------------------------------------------------------------- the two sides
def _lead(store: Any, rdzv: Rendezvous, r: int, me: dict[str, Any], sizes: Sequence[int],
          warmup: int, repeat: int) -> dict[str, Any]:
    """Node 0's side of the pair (0, r): pick the backend, ping-pong, fit, hand over."""
    import torch
    other = json.loads(_get(store, rdzv, f"info/{r}"))
    if other["nnodes"] != rdzv.nnodes:
        raise PipeccError(f"node {r} runs with --nnodes {other['nnodes']}, node 0 with --nnodes "
                          f"{rdzv.nnodes}; give every node the same --nnodes")
    nccl = me["nccl"] and other["nccl"]
    backend, devices = ("nccl", [me["device"], other["device"]]) if nccl else ("gloo", ["cpu", "cpu"])
    _set(store, rdzv, f"plan/{r}", json.dumps({"backend": backend, "devices": devices}))
    try:
        group = _group(store, rdzv, r, 0, backend, devices[0])
        samples = ping_pong(group, 0, torch.device(devices[0]), sizes, warmup, repeat)
    except PipeccError:
        raise
    except Exception as exc:
        raise PipeccError(f"measuring the cross-host {backend} link to node {r} (rendezvous "
                          f"{rdzv.endpoint}) failed: {type(exc).__name__}: {_first_line(exc)}") from exc
    record = {"scope": "cross-host", "endpoint": rdzv.endpoint, "nodes": [0, r],
              "hosts": [me["host"], other["host"]],
              **link_record(backend, devices, samples, warmup, repeat)}
    _set(store, rdzv, f"result/{r}", json.dumps(record))
    return record


def _follow(store: Any, rdzv: Rendezvous, config: dict[str, Any]) -> dict[str, Any]:
    """Node r's side: wait for its turn, echo, read node 0's record, say done."""
    import torch
    r = rdzv.node_rank
    # node 0 measures the nodes before this one first, each within the timeout
    deadline = time.monotonic() + rdzv.timeout_s * r
    _await(store, rdzv, f"plan/{r}", deadline, f"node 0 at {rdzv.endpoint} did not start the "
           f"link measurement with node {r} in time")
    plan = json.loads(_get(store, rdzv, f"plan/{r}"))
    try:
        group = _group(store, rdzv, r, 1, plan["backend"], plan["devices"][1])
        ping_pong(group, 1, torch.device(plan["devices"][1]), config["sizes"], config["warmup"],
                  config["repeat"])
    except PipeccError:
        raise
    except Exception as exc:
        raise PipeccError(f"measuring the cross-host {plan['backend']} link to node 0 at "
                          f"{rdzv.endpoint} failed: {type(exc).__name__}: {_first_line(exc)}") from exc
    _await(store, rdzv, f"result/{r}", time.monotonic() + rdzv.timeout_s,
           f"node 0 at {rdzv.endpoint} sent no link record within {rdzv.timeout_s:g} s")
    record = json.loads(_get(store, rdzv, f"result/{r}"))
    _set(store, rdzv, f"done/{r}", "1")
    return record


def _group(store: Any, rdzv: Rendezvous, r: int, rank: int, backend: str, device: str) -> Any:
    """The two-rank group of the pair (0, r) on its own store prefix."""
    import torch
    import torch.distributed as dist
    prefixed = dist.PrefixStore(PREFIX + f"link{r}/", store)
    return pair_group(backend, prefixed, rank, timedelta(seconds=rdzv.timeout_s),
                      torch.device(device), hostname=_local_address(rdzv),
                      interface=os.environ.get("GLOO_SOCKET_IFNAME") or None)


# ----------------------------------------------------------------------------- the store
def _open(rdzv: Rendezvous) -> Any:
    import torch.distributed as dist
    try:
        return dist.TCPStore(rdzv.host, rdzv.port, rdzv.nnodes, True,
                             timeout=timedelta(seconds=rdzv.timeout_s), wait_for_workers=False)
    except Exception as exc:
        why = "the port is in use (another node 0, or another program?)" \
            if "EADDRINUSE" in str(exc) or "in use" in str(exc) else _first_line(exc)
        raise PipeccError(f"node 0 cannot open the rendezvous at {rdzv.endpoint}: {why}") from exc


def _connect(rdzv: Rendezvous) -> Any:
    """A store client of node 0's store, once HOST:PORT accepts connections (or the timeout)."""
    import torch.distributed as dist
    deadline = time.monotonic() + rdzv.timeout_s
    while True:
        try:
            with socket.create_connection((rdzv.host, rdzv.port),
                                          timeout=max(0.1, min(2.0, deadline - time.monotonic()))):
                break
        except OSError:
            if time.monotonic() >= deadline:
                raise PipeccError(f"no rendezvous at {rdzv.endpoint} within {rdzv.timeout_s:g} s: "
                                  f"start node 0 (`pipecc profile ... --node-rank 0 --rdzv-endpoint "
                                  f"{rdzv.endpoint}`) on {rdzv.host}, or raise --timeout") from None
            time.sleep(0.2)
    try:
        return dist.TCPStore(rdzv.host, rdzv.port, rdzv.nnodes, False,
                             timeout=timedelta(seconds=rdzv.timeout_s))
    except Exception as exc:
        raise PipeccError(f"{rdzv.endpoint} answers but is not a pipecc rendezvous: "
                          f"{_first_line(exc)}") from exc


def _join(store: Any, rdzv: Rendezvous, me: dict[str, Any]) -> None:
    r = rdzv.node_rank
    if _call(store, rdzv, "add", PREFIX + f"join/{r}", 1) > 1:
        raise PipeccError(f"another node already joined the rendezvous at {rdzv.endpoint} as "
                          f"--node-rank {r}; give every node its own --node-rank")
    _set(store, rdzv, f"info/{r}", json.dumps(me))


def _check(store: Any, rdzv: Rendezvous, key: str) -> bool:
    return bool(_call(store, rdzv, "check", [PREFIX + key]))


def _await(store: Any, rdzv: Rendezvous, key: str, deadline: float, message: str) -> None:
    while not _check(store, rdzv, key):
        if time.monotonic() >= deadline:
            raise PipeccError(message)
        time.sleep(_POLL_S)


def _set(store: Any, rdzv: Rendezvous, key: str, value: str) -> None:
    _call(store, rdzv, "set", PREFIX + key, value)


def _get(store: Any, rdzv: Rendezvous, key: str) -> str:
    return _call(store, rdzv, "get", PREFIX + key).decode()


def _call(store: Any, rdzv: Rendezvous, method: str, *args: Any) -> Any:
    try:
        return getattr(store, method)(*args)
    except Exception as exc:  # node 0, and its store, went away
        raise PipeccError(f"lost the rendezvous at {rdzv.endpoint} (did node 0 stop?): "
                          f"{_first_line(exc)}") from exc


def _local_address(rdzv: Rendezvous) -> str:
    """The address this host reaches node 0's host through (no packet is sent)."""
    try:
        family, _, _, _, addr = socket.getaddrinfo(rdzv.host, rdzv.port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return s.getsockname()[0]
    except OSError:
        return socket.gethostname()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
