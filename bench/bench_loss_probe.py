"""What the runtime's per-step loss factors cost against the loss they weigh.

    python bench/bench_loss_probe.py [--repeats 5]

The last stage calls `pipecc.runtime.loss_reduction.step_factors` once per step for a mean
loss (it finds the micro-batches' true factors when the step's targets weigh them, e.g.
cross_entropy's ignore_index). For `F.cross_entropy` over (micro-batch, T, V) logits, in one
process on CPU, this times the probe on random outputs (`_factors`: what every step cost
before `loss_targets`), the first step of a fresh loss function (the trace of `loss_fn` plus
the probe that confirms it), and a later step (the counted factors `loss_targets` reads from
the targets), beside the step's own m losses forward and backward on one micro-batch's
logits. Each step's targets hold ignored entries in micro-batch 1; the factors the later step
finds are shown beside the probe's. Prints a Markdown table; nothing is written.
"""
from __future__ import annotations

import argparse
import platform
import time

import torch
import torch.nn.functional as F

from pipecc.runtime.loss_reduction import MEAN, _factors, step_factors

CASES = [(16, 4, 64, 1024), (32, 8, 128, 8192)]  # batch, micro-batches, sequence, vocabulary


def make_loss():
    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return loss_fn  # a fresh function each time: nothing remembered for it


def timed(fn, repeats: int) -> float:
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t) / repeats


def row(batch: int, m: int, seq: int, vocab: int, repeats: int) -> str:
    mb = batch // m
    gen = torch.Generator().manual_seed(0)
    targets = [torch.randint(0, vocab, (mb, seq), generator=gen) for _ in range(m)]
    targets[1][0, :5] = -100  # five ignored targets in micro-batch 1
    value = torch.randn(mb, seq, vocab, generator=gen)
    loss_fn = make_loss()
    _factors(loss_fn, value, 0, targets, [mb] * m)  # warm-up
    probe = timed(lambda: _factors(loss_fn, value, 0, targets, [mb] * m), repeats)
    probed = _factors(loss_fn, value, 0, targets, [mb] * m)
    step_factors(make_loss(), value, 0, targets, [mb] * m, MEAN)  # warm-up: make_fx's first trace
    first = timed(lambda: step_factors(make_loss(), value, 0, targets, [mb] * m, MEAN), repeats)
    step_factors(loss_fn, value, 0, targets, [mb] * m, MEAN)  # the probe confirms the trace
    later = timed(lambda: step_factors(loss_fn, value, 0, targets, [mb] * m, MEAN), repeats * 20)
    found = step_factors(loss_fn, value, 0, targets, [mb] * m, MEAN)
    out = torch.randn(mb, seq, vocab, generator=gen, requires_grad=True)

    def own_losses() -> None:
        for y in targets:
            loss_fn(out, y).backward()
    own = timed(own_losses, repeats)
    assert isinstance(probed, list) and found is not None
    return (f"| {batch} | {m} | {seq} | {vocab} | {own * 1e3:.1f} | {probe * 1e3:.1f} ({probe / own:.0f}x) | "
            f"{first * 1e3:.1f} | {later * 1e3:.3f} ({later / own:.4f}x) | {found[1]:.4f} vs {found[0]:.4f} "
            f"({probed[1]:.4f} vs {probed[0]:.4f}) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"{platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| B | m | T | V | the step's m losses fwd+bwd ms | probe ms (before: every step) | first step ms "
          "(trace + probe) | later step ms | factors mb 1 vs 0 (probe's) |")
    print("|--:|--:|--:|--:|--:|--:|--:|--:|---|")
    for case in CASES:
        print(row(*case, args.repeats), flush=True)


if __name__ == "__main__":
    main()
