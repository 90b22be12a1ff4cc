"""Fixed costs of CPU eager PyTorch on this machine: the measurement behind the `cpu` defaults
of `pipecc.targets.fixed_costs.DEFAULTS` (issue #20 item 2).

    OMP_NUM_THREADS=1 python bench/bench_fixed_costs.py [--repeats 200] [--json]

One thread, as each rank of `pipecc run` gets. Every figure is a median over `--repeats`
timings after a warm-up, and a per-op figure is the slope of a straight-line fit over chains of
1, 16 and 64 ops (the intercept is the per-call part the next figures measure):

  op_forward_s   one op's forward in a training step: a chain of Linear(8, 8) / ReLU on a
                 [1, 8] input that requires grad (dispatch + the autograd node it records)
  op_backward_s  that op's share of the chain's backward (`torch.autograd.backward`)
  microbatch_s   what a stage pays per micro-batch, forward and backward together, whatever its
                 ops: the chain's two intercepts (one `nn.Module.__call__`, one
                 `autograd.backward` call) plus the engine's bookkeeping per action (detaching
                 and re-marking a received input, the output-gradient tensor, stash list work),
                 timed on a one-op stage minus that op's op_forward_s + op_backward_s;
                 microbatch_forward_share: the forward action's part of it
  step_s         zero_grad + Adam step of a one-Linear stage (two parameter tensors): the
                 per-iteration cost beyond the optimizer's bytes
  message_s      host cost per message on each side: a gloo send/recv ping-pong of 64 bytes
                 between two processes on this host, one-way time minus the `loopback` link's
                 30 us latency (the catalog's), halved (sender and receiver each pay it);
                 median and tenth percentile (a loaded host's descheduled ranks make the
                 median jump to milliseconds)
  matmul_w_half  the small-matmul half-rate work (FLOPs): Linear's per-call intercept beyond
                 ReLU's over a size sweep, times the large-matmul rate measured here

Prints one line per figure (or a JSON document with --json). Nothing is written.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

torch.set_num_threads(1)
LOOPBACK_LATENCY_S = 30e-6  # pipecc/targets/data/devices.toml [link.loopback]


def _median(fn, repeats: int) -> float:
    for _ in range(max(repeats // 10, 5)):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares intercept and slope."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def _chain(n: int) -> nn.Module:
    layers: list[nn.Module] = []
    for i in range(n):
        layers.append(nn.Linear(8, 8) if i % 2 == 0 else nn.ReLU())
    return nn.Sequential(*layers)


def ops(repeats: int) -> dict[str, float]:
    """op_forward_s, op_backward_s and the per-call intercepts of the chain's fits."""
    sizes, fwd, bwd = [1, 16, 64], [], []
    for n in sizes:
        model = _chain(n)
        x = torch.randn(1, 8, requires_grad=True)
        fwd.append(_median(lambda: model(x), repeats))
        g = torch.ones(1, 8)

        def backward() -> None:
            y = model(x)
            torch.autograd.backward(y, g)
        bwd.append(_median(backward, repeats) - fwd[-1])
    fa, fc = _fit(sizes, fwd)
    ba, bc = _fit(sizes, bwd)
    return {"op_forward_s": fc, "op_backward_s": bc, "forward_call_s": max(fa, 0.0),
            "backward_call_s": max(ba, 0.0)}


def engine_action(repeats: int, op_f: float, op_b: float) -> tuple[float, float]:
    """A one-op stage's F + B as the engine runs them (module docstring), minus the op."""
    model = nn.Linear(8, 8)
    received = torch.randn(1, 8)
    stash: list = []

    def forward() -> None:
        x = received.detach().requires_grad_(True)  # a received activation
        y = model(x)
        stash.append((x, y))

    def backward() -> None:
        x, y = stash.pop(0)
        grad = torch.ones_like(y)  # a received output gradient
        torch.autograd.backward(y, grad)
        _ = x.grad.detach()  # the input gradient to send
        model.zero_grad(set_to_none=False)

    def both() -> None:
        forward()
        backward()
    def forward_only() -> None:
        forward()
        stash.clear()
    total = max(_median(both, repeats) - op_f - op_b, 0.0)
    fwd = max(_median(forward_only, repeats) - op_f, 0.0)
    return total, min(fwd / total, 1.0) if total > 0 else 0.5


def optimizer_step(repeats: int) -> float:
    model = nn.Linear(8, 8)
    opt = torch.optim.Adam(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)

    def step() -> None:
        opt.zero_grad(set_to_none=False)
        opt.step()
    return _median(step, repeats)


def small_matmul(repeats: int) -> dict[str, float]:
    """Linear's per-call intercept beyond ReLU's (forward, no grad), and the large rate."""
    lin, relu = [], []
    works = []
    for width in (8, 32, 64, 128):
        layer = nn.Linear(width, width)
        x = torch.randn(16, width)
        with torch.no_grad():
            lin.append(_median(lambda: layer(x), repeats))
            relu.append(_median(lambda: torch.relu(x), repeats))
        works.append(2.0 * 16 * width * width)
    big = nn.Linear(1024, 1024)
    xb = torch.randn(256, 1024)
    with torch.no_grad():
        t_big = _median(lambda: big(xb), max(repeats // 20, 5))
    rate = 2.0 * 256 * 1024 * 1024 / t_big
    a_lin, _ = _fit(works, lin)
    extra = max(a_lin - statistics.median(relu), 0.0)
    return {"matmul_rate_flops": rate, "matmul_extra_s": extra, "matmul_w_half": extra * rate}


def _pingpong(rank: int, port: int, repeats: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    t = torch.zeros(16)
    times = []
    for i in range(repeats + 20):
        start = time.perf_counter()
        if rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        else:
            dist.recv(t, 0)
            dist.send(t, 0)
        if i >= 20:
            times.append(time.perf_counter() - start)
    if rank == 0:  # NOTE: the median and the tenth percentile: a loaded host deschedules
        times.sort()  # ranks (bimodal times), which the cost model counts apart (fixed_costs)
        out.put((statistics.median(times) / 2, times[len(times) // 10] / 2))
    dist.destroy_process_group()


def message(repeats: int) -> tuple[float, float]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=_pingpong, args=(r, port, repeats, q)) for r in range(2)]
    for p in procs:
        p.start()
    median, p10 = q.get(timeout=120)
    for p in procs:
        p.join(timeout=60)
    return max(median - LOOPBACK_LATENCY_S, 0.0) / 2, max(p10 - LOOPBACK_LATENCY_S, 0.0) / 2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    o = ops(args.repeats)
    msg, msg_p10 = message(args.repeats)
    mb, share = engine_action(args.repeats, o["op_forward_s"], o["op_backward_s"])
    res = {"op_forward_s": o["op_forward_s"], "op_backward_s": o["op_backward_s"],
           "microbatch_s": mb, "microbatch_forward_share": share,
           "step_s": optimizer_step(args.repeats), "message_s": msg, "message_s_p10": msg_p10,
           **small_matmul(args.repeats),
           "host": f"{os.cpu_count()} cores, torch {torch.__version__}, OMP_NUM_THREADS="
                   f"{os.environ.get('OMP_NUM_THREADS')}"}
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        for k, v in res.items():
            print(f"{k:18s} {v:.4g}" if isinstance(v, float) else f"{k:18s} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
