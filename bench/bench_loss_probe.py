"""What the runtime's per-step loss-factor probe costs against the loss it weighs.

    python bench/bench_loss_probe.py [--repeats 5]

The last stage calls `pipecc.runtime.loss_reduction.step_factors` once per step for a mean
loss (it finds the micro-batches' true factors when the step's targets weigh them, e.g.
cross_entropy's ignore_index). This times it in one process on CPU, for `F.cross_entropy` over
(micro-batch, T, V) logits, beside the step's own m losses forward and backward on one
micro-batch's logits, and checks that it still finds the factors of a step whose second
micro-batch holds ignored targets. Prints a Markdown table; nothing is written.
"""
from __future__ import annotations

import argparse
import platform
import time

import torch
import torch.nn.functional as F

from pipecc.runtime.loss_reduction import MEAN, step_factors

CASES = [(16, 4, 64, 1024), (32, 8, 128, 8192)]  # batch, micro-batches, sequence, vocabulary


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def row(batch: int, m: int, seq: int, vocab: int, repeats: int) -> str:
    mb = batch // m
    gen = torch.Generator().manual_seed(0)
    targets = [torch.randint(0, vocab, (mb, seq), generator=gen) for _ in range(m)]
    value = torch.randn(mb, seq, vocab, generator=gen)
    step_factors(loss_fn, value, 0, targets, [mb] * m, MEAN)  # warm-up
    t = time.perf_counter()
    for _ in range(repeats):
        step_factors(loss_fn, value, 0, targets, [mb] * m, MEAN)
    probe = (time.perf_counter() - t) / repeats
    out = torch.randn(mb, seq, vocab, generator=gen, requires_grad=True)
    t = time.perf_counter()
    for _ in range(repeats):
        for y in targets:
            loss_fn(out, y).backward()
    own = (time.perf_counter() - t) / repeats
    targets[1][0, :5] = -100  # five ignored targets in micro-batch 1
    found = step_factors(loss_fn, value, 0, targets, [mb] * m, MEAN)
    shown = "none" if found is None else f"{found[1]:.4f} vs {found[0]:.4f}"
    return (f"| {batch} | {m} | {seq} | {vocab} | {probe * 1e3:.1f} | {own * 1e3:.1f} | "
            f"{probe / own:.0f}x | {shown} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"{platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| B | m | T | V | probe ms/step | the step's m losses fwd+bwd ms | ratio | factors with ignored "
          "targets (mb 1 vs 0) |")
    print("|--:|--:|--:|--:|--:|--:|--:|---|")
    for case in CASES:
        print(row(*case, args.repeats), flush=True)


if __name__ == "__main__":
    main()
