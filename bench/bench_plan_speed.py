"""Planner speed on a 20,000-node graph over 16 devices.

    .venv/bin/python bench/bench_plan_speed.py [--blocks 5000]   # writes its RESULTS.md section

The model is a chain of `blocks` residual blocks x + LayerNorm(ReLU(Linear(x))) (4 nodes
each), width 128, built on the meta device (no weight memory), input [32, 512, 128]; planned
on 16xa100 with 1F1B and 32 micro-batches, with and without the layer-split search.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

from pipecc import driver

sys.path.insert(0, str(Path(__file__).parent))
from bench_cost import write_section  # noqa: E402


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear, self.norm = nn.Linear(width, width), nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(torch.relu(self.linear(x)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=5000)
    args = parser.parse_args()
    with torch.device("meta"):
        model = nn.Sequential(*[Block(128) for _ in range(args.blocks)])
    t0 = time.perf_counter()
    graph = driver.analyze_module(model, (torch.empty(32, 512, 128, device="meta"),))
    analysis = time.perf_counter() - t0
    rows = []
    for split in (True, False):
        t0 = time.perf_counter()
        plan, _ = driver.plan(graph, "16xa100", microbatches=32, schedule="1f1b", split_layers=split, replicas=1)
        rows.append((split, time.perf_counter() - t0, plan.balance_ratio, len(plan.split_layers)))
    text = "\n".join([
        "## Planner speed: 20,000-node graph on 16 devices",
        "",
        f"`python bench/bench_plan_speed.py --blocks {args.blocks}` on {time.strftime('%Y-%m-%d')}: "
        f"{len(graph.compute_nodes())} nodes.",
        "",
        f"- analysis (capture, fitted shapes, sympy costs): {analysis:.1f} s",
        *[f"- `driver.plan` end to end, layer-split search {'on' if s else 'off'}: **{t:.1f} s**, "
          f"balance ratio {r:.3f}, {k} split layers" for s, t, r, k in rows],
    ])
    print(text)
    write_section(text, key="planspeed")


if __name__ == "__main__":
    main()
