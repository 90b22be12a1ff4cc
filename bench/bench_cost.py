"""Cost-model benchmark: pipecc's matmul-class FLOPs against torch's FlopCounterMode on every
zoo model at full size, and `pipecc cost` wall time on GPT-2 small and a 48-layer GPT.

    .venv/bin/python bench/bench_cost.py            # writes the cost section of RESULTS.md

The reference runs on the meta device (no memory, no arithmetic), where fused CPU kernels
(LSTM, flash attention) decompose into the mm/bmm calls FlopCounterMode counts; matrix-vector
products (aten.mv/dot), which it does not count, are added to it (see tests/helpers.py).
"""
from __future__ import annotations

import importlib
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import replace_section  # noqa: E402
from helpers import reference_flops  # noqa: E402

from pipecc import cost, driver  # noqa: E402

BATCH = {"vgg16": 8, "resnet50": 8, "gnmt": 8, "gpt": 4, "bert": 4, "tiny_cnn": 8, "mlp": 8}
ARGS = {"gnmt": {"src_len": 20, "tgt_len": 20}, "gpt": {"seq_len": 256}, "bert": {"seq_len": 128}}


def flop_rows() -> list[list[str]]:
    rows = []
    for name, batch in BATCH.items():
        zoo = importlib.import_module(f"pipecc.models.{name}")
        args = ARGS.get(name, {})
        with torch.device("meta"):
            model = zoo.build_model(**args)
        inputs = tuple(x.to("meta") for x in zoo.example_inputs(batch, **args))
        target = zoo.example_target(batch, **args).to("meta")
        t0 = time.perf_counter()
        graph = driver.analyze_module(model, inputs, model_name=name)
        seconds = time.perf_counter() - t0
        ours = cost.totals(graph)
        ref_f, ref_b = reference_flops(model, inputs, zoo.loss_fn, target)
        rows.append([name, str(batch), f"{ours['forward_flops_matmul']:,}", f"{ref_f:,}",
                     f"{ours['backward_flops_matmul']:,}", f"{ref_b:,}",
                     "exact" if (ours["forward_flops_matmul"], ours["backward_flops_matmul"]) == (ref_f, ref_b)
                     else f"{ours['backward_flops_matmul'] / ref_b - 1:+.2%}", f"{seconds:.1f} s"])
    return rows


def cli_seconds(*args: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pipecc.cli", "cost", *args, "--json"], cwd=ROOT,
                   check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def table(headers: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
                     + ["| " + " | ".join(r) + " |" for r in rows])


def write_section(text: str, key: str = "cost") -> None:
    """Rewrite section `key` of bench/RESULTS.md (bench/results.py)."""
    replace_section(ROOT / "bench" / "RESULTS.md", key, text)


def main() -> None:
    rows = flop_rows()
    gpt2 = cli_seconds("models/gpt.py", "-b", "8")
    gpt48 = cli_seconds("models/gpt.py", "-b", "8", "--model-arg", "n_layer=48")
    text = "\n".join([
        "## Cost model vs FlopCounterMode (matmul-class FLOPs, full-size zoo models)",
        "",
        f"`{Path(sys.executable).name} bench/bench_cost.py` on {time.strftime('%Y-%m-%d')}, "
        f"torch {torch.__version__}. Reference: FlopCounterMode on the meta device plus aten.mv/dot.",
        "",
        table(["model", "batch", "pipecc fwd", "reference fwd", "pipecc bwd", "reference bwd",
               "agreement", "analysis time"], rows),
        "",
        f"`pipecc cost models/gpt.py -b 8 --json` (GPT-2 small, 12 layers): {gpt2:.1f} s wall, "
        f"48 layers (`--model-arg n_layer=48`): {gpt48:.1f} s wall (process start and torch import included).",
    ])
    print(text)
    write_section(text)


if __name__ == "__main__":
    main()
