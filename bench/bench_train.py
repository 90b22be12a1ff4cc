"""Training on real data: the pipelined run against the one-process run, side by side.

    .venv/bin/python bench/bench_train.py [--steps-char 300] [--steps-digits 230] [--write bench/RESULTS.md]

For each example model with real data (`models/chargpt.py`: Python's documentation text;
`models/digits_cnn.py`: scikit-learn's digits) this compiles the model for 2 CPU processes
(1F1B), trains it with `pipecc run --json` (AdamW, the model file's `train_data`, gloo, one thread
per rank) and trains the original model in one process (one thread) from the same weights on the
same batches (`pipecc.runtime.batches`' order) with the same optimizer. It reports the two loss
curves (every k-th step and the largest relative difference over all steps), the held-out figure
of each (the pipelined run's from its exported checkpoint), and samples/s: the pipelined run's
median step, the one-process run's median step, and the plan's predicted figure (this CPU,
roofline: the plan's basis is named).

On 2 CPUs a pipeline of 2 one-thread processes runs at best like one process with 2 threads; these
are small models whose steps take milliseconds, where per-message and per-action host costs
dominate. The figures say what the machine gave, nothing more.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from results import replace_section  # noqa: E402

PIPECC = [sys.executable, "-c", "import sys; from pipecc.cli import main; sys.exit(main())"]
CASES = {
    "chargpt": dict(args={}, batch=32, lr=3e-3, what="character-level GPT on Python's documentation topics"),
    "digits_cnn": dict(args={}, batch=64, lr=1e-2, what="CNN on scikit-learn's digits"),
}


def _pipecc(*argv: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run([*PIPECC, *argv], capture_output=True, text=True, env=env, timeout=timeout)
    if result.returncode != 0:
        raise SystemExit(f"pipecc {' '.join(argv[:2])} failed:\n{result.stderr[-3000:]}")
    return result


def _held_out(name: str, model: torch.nn.Module, zoo, args: dict) -> tuple[str, float]:
    model.eval()
    with torch.no_grad():
        if name == "digits_cnn":
            images, labels = zoo.split("val")
            return "held-out accuracy", float((model(images).argmax(1) == labels).float().mean())
        losses = [float(zoo.loss_fn(model(x), y)) for x, y in zoo.val_data(64, **args)]
        return "held-out loss (nats/char)", sum(losses) / len(losses)


def run_case(name: str, steps: int, work: Path) -> dict:
    import importlib

    import pipecc
    from pipecc.runtime.batches import Batches

    case = CASES[name]
    zoo = importlib.import_module(f"pipecc.models.{name}")
    out, ckpt = work / f"{name}_out", work / f"{name}_ckpt"
    _pipecc("compile", str(ROOT / "models" / f"{name}.py"), "-b", str(case["batch"]), "--devices", "2xcpu",
            "--replicas", "1", "--use-all-devices", "-m", "4", "--schedule", "1f1b", "-o", str(out), "-q")
    started = time.perf_counter()
    result = _pipecc("run", str(out), "--steps", str(steps), "--optimizer", "adamw", "--lr", repr(case["lr"]),
                     "--json", "--checkpoint-dir", str(ckpt))
    pipe_wall = time.perf_counter() - started
    doc = json.loads(result.stdout)
    pipelined = [h["loss"] for h in doc["history"]]
    weights = work / f"{name}.safetensors"
    _pipecc("export-checkpoint", str(ckpt), str(weights), "-q")
    from safetensors.torch import load_file

    trained = zoo.build_model(**case["args"])
    trained.load_state_dict(load_file(str(weights)))
    metric, pipe_figure = _held_out(name, trained, zoo, case["args"])

    torch.set_num_threads(1)
    model = zoo.build_model(**case["args"])
    model.load_state_dict(pipecc.distributed.load(out).full_state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=case["lr"])
    stream = Batches(zoo, f"{name}.py", "train_data", case["batch"], case["args"], True, 0)
    single, times = [], []
    for step in range(steps):
        x, y = stream.next(step)
        t0 = time.perf_counter()
        loss = zoo.loss_fn(model(*x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        single.append(float(loss.detach()))
    _, single_figure = _held_out(name, model, zoo, case["args"])
    rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(pipelined, single))
    absolute = max(abs(a - b) for a, b in zip(pipelined, single))
    basis = ((json.loads((out / "plan.json").read_text()).get("options") or {}).get("profile")
             or "roofline of the catalog's cpu (no profile)")
    return dict(name=name, what=case["what"], batch=case["batch"], lr=case["lr"], steps=steps,
                pipelined=pipelined, single=single, max_rel=rel, max_abs=absolute, metric=metric, pipe_figure=pipe_figure,
                single_figure=single_figure, pipe_sps=doc["samples_per_s"],
                single_sps=case["batch"] / statistics.median(times[1:] or times),
                predicted_sps=(case["batch"] / doc["predicted_step_s"]) if doc.get("predicted_step_s") else None,
                basis=basis, pipe_wall=pipe_wall, params=sum(p.numel() for p in model.parameters()))


def render(results: list[dict], command: str) -> str:
    lines = ["## Training on real data: pipelined vs one process (CPU)", "",
             f"`{command}` — torch {torch.__version__}, {os.cpu_count()} CPUs, load average "
             f"{', '.join(f'{x:.2f}' for x in os.getloadavg())} at the end. Each model compiled for `2xcpu` "
             "(2 stages, 1F1B, 4 micro-batches), trained by `pipecc run --json` with AdamW on the model file's "
             "`train_data` (gloo, one thread per rank), and in one process (one thread) from the same weights on "
             "the same batches.", ""]
    for r in results:
        k = max(1, r["steps"] // 10)
        lines += [f"### {r['name']}: {r['what']} ({r['params']:,} parameters, batch {r['batch']}, lr {r['lr']})", "",
                  "| step | " + " | ".join(str(i) for i in range(0, r["steps"], k)) + f" | {r['steps'] - 1} |",
                  "|---|" + "---:|" * (len(range(0, r["steps"], k)) + 1),
                  "| pipelined loss | " + " | ".join(f"{r['pipelined'][i]:.4f}" for i in range(0, r["steps"], k))
                  + f" | {r['pipelined'][-1]:.4f} |",
                  "| one-process loss | " + " | ".join(f"{r['single'][i]:.4f}" for i in range(0, r["steps"], k))
                  + f" | {r['single'][-1]:.4f} |", "",
                  f"Largest relative difference of the two losses over all {r['steps']} steps: "
                  f"**{r['max_rel']:.2e}** relative, {r['max_abs']:.2e} absolute. {r['metric']}: pipelined {r['pipe_figure']:.4f}, one process "
                  f"{r['single_figure']:.4f}.", "",
                  f"samples/s (median step): pipelined **{r['pipe_sps']:.1f}**, one process {r['single_sps']:.1f} "
                  f"(ratio {r['pipe_sps'] / r['single_sps']:.2f}); predicted "
                  + (f"{r['predicted_sps']:.1f} ({r['basis']})" if r["predicted_sps"] else "— (no plan.json)")
                  + f"; the whole `pipecc run` took {r['pipe_wall']:.1f} s.", ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps-char", type=int, default=300)
    ap.add_argument("--steps-digits", type=int, default=230)
    ap.add_argument("--write", type=Path, help="rewrite this section of the results file (bench/RESULTS.md)")
    args = ap.parse_args()
    command = "python bench/bench_train.py" + "".join(
        f" --{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k != "write") + (
        f" --write {args.write}" if args.write else "")
    with tempfile.TemporaryDirectory(prefix="pipecc-bench-train-") as tmp:
        results = [run_case("chargpt", args.steps_char, Path(tmp)), run_case("digits_cnn", args.steps_digits, Path(tmp))]
    text = render(results, command)
    print(text)
    if args.write:
        replace_section(args.write, "train", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
