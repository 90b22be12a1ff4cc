"""GPU check, one prepared script (#35, #34 item 5): pipecc's stages, drop-in, runtime and cost
model on cuda:0, with every result written as it finishes.

    python bench/gpu_check.py --out "$OUT"                        # the GPU run (docs/gpu-check.md)
    python bench/gpu_check.py --device cpu --small --out DIR      # the same code on a CPU, tiny sizes

Steps, in order; each sub-step is guarded (a failure is recorded with its one-line error, its
traceback goes to DIR/gpu_check.log, and the script goes on), and a step that would start after
`--budget-s` seconds is skipped with a note:

  1. import: `import pipecc` (installed, else made importable from this checkout), the torch the
     project declares (setup.cfg) against this one, one `pipecc.compile` on DEVICE.
  2. numerics: the zoo GPT and VGG-16 through `pipecc.compile(..., "2xh200@DEVICE")`, forward and
     backward against the same model on DEVICE and on the CPU (fp32, TF32 off): outputs and every
     gradient; then `precision="bf16"` against the model under torch.autocast on DEVICE.
  3. run: a folder compiled for `h200@DEVICE,cpu` run with `pipecc run --verify --backend gloo`
     (stage 0 on DEVICE, stage 1 on the CPU); when that cannot run, its error is recorded and a
     folder for `2xh200@DEVICE` runs in one process (`python -m pipecc.runtime.dist --verify`).
  4. fidelity: each stage's measured forward/backward and peak memory beside the h200 plan
     (bench/gpu_check_measure.py) for the GPT at two sizes and VGG-16; then a one-process run's
     `--json` document, the plan made again with `--calibrate` from it, and the same table.
  5. train: chargpt in bf16, drop-in and `pipecc.distributed` (bench/gpu_check_train.py).

DIR gets four files (the device tool brings back at most eight): gpu_check.json (rewritten after
every sub-step: partial results survive a timeout), gpu_check.md (the same as tables),
gpu_check.log (every command's output and every traceback) and gpu_check_runs.json (the
`pipecc run --json` documents). The compiled folders (weights: GBs at GPU sizes) go to a temporary
folder removed at the end (`--work DIR` keeps them there). `--small` (with `--device cpu`)
runs every step at tiny sizes; on a CPU what needs CUDA (peak memory) is n/a. Exit status: 0 when
every sub-step passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent


def bootstrap() -> str:
    """How pipecc imports here: "installed" (pip install -e .), else "checkout" (a folder of links,
    pipecc/ with passes/, backends/ and models/ mapped in as setup.cfg maps them, put on
    PYTHONPATH so the commands and ranks this script starts import the same pipecc)."""
    try:
        import pipecc.models  # noqa: F401  (setup.cfg's package_dir mapping, only an install has it)
        import pipecc.passes  # noqa: F401
        return f"installed ({Path(sys.modules['pipecc'].__file__).parent})"
    except ImportError:
        for name in [n for n in sys.modules if n == "pipecc" or n.startswith("pipecc.")]:
            del sys.modules[name]
    shim = Path(tempfile.mkdtemp(prefix="pipecc-path-"))
    (shim / "pipecc").mkdir()
    for entry in (ROOT / "pipecc").iterdir():
        if entry.name != "__pycache__":
            (shim / "pipecc" / entry.name).symlink_to(entry)
    for name in ("passes", "backends", "models"):
        (shim / "pipecc" / name).symlink_to(ROOT / name)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(shim), *filter(None, [os.environ.get("PYTHONPATH")])])
    sys.path.insert(0, str(shim))
    return f"checkout ({shim} on PYTHONPATH)"


INSTALL = bootstrap()
sys.path.insert(0, str(BENCH))

import torch  # noqa: E402

import gpu_check_measure as measure  # noqa: E402
import gpu_check_train as train  # noqa: E402

# (model file, model args, batch, micro-batches): GPU sizes, and --small
NUMERICS = {
    "gpt": ("gpt", dict(preset="gpt2", seq_len=256), 4, 4),
    "vgg16": ("vgg16", dict(), 8, 4),
}
NUMERICS_SMALL = {
    "gpt": ("gpt", dict(n_layer=2, n_head=2, n_embd=32, vocab_size=101, block_size=16, seq_len=8), 8, 4),
    "vgg16": ("vgg16", dict(width=0.125, image_size=32, num_classes=10, fc_dim=32), 8, 4),
}
FIDELITY = {
    "gpt2-small": ("gpt", dict(preset="gpt2", seq_len=512), 8, 4),
    "gpt2-medium": ("gpt", dict(n_layer=24, n_head=16, n_embd=1024, seq_len=512), 8, 4),
    "vgg16": ("vgg16", dict(), 32, 4),
}
FIDELITY_SMALL = {
    "gpt-tiny": ("gpt", dict(n_layer=2, n_head=2, n_embd=32, vocab_size=101, block_size=16, seq_len=8), 8, 4),
    "gpt-tiny4": ("gpt", dict(n_layer=4, n_head=2, n_embd=48, vocab_size=101, block_size=16, seq_len=16), 8, 4),
    "vgg16": ("vgg16", dict(width=0.125, image_size=32, num_classes=10, fc_dim=32), 8, 4),
}
RUN_MODEL = ("gpt", dict(n_layer=4, n_head=4, n_embd=128, vocab_size=1000, block_size=64, seq_len=32), 8, 4)
CHARGPT = dict(n_layer=4, n_head=4, n_embd=128, seq_len=128, init_seed=0)
CHARGPT_SMALL = dict(n_layer=2, n_head=2, n_embd=32, seq_len=16, init_seed=0)
FP32, BF16 = 1e-4, 1.6e-2  # rtol per dtype, as `pipecc run --verify` (pipecc/runtime/verify.py)


# ----------------------------------------------------------------------------- the record

class Check:
    """The run's state: options, the JSON document (written after every sub-step) and the budget."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.dev = args, args.device
        self.small, self.start = args.small, time.monotonic()
        self.out: Path = args.out
        # NOTE: compiled folders hold the weights (GBs at GPU sizes): outside OUT, whose files travel back
        self.work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gpu-check-work-"))
        # NOTE: the device tool brings back at most 8 files from $OUT: everything goes into four
        self.work.mkdir(parents=True, exist_ok=True)
        self.out.mkdir(parents=True, exist_ok=True)
        self.logfile, self.runsfile = self.out / "gpu_check.log", self.out / "gpu_check_runs.json"
        self.logfile.write_text("")
        self.runs: dict[str, Any] = {}
        self.failures = 0
        cuda = self.dev.startswith("cuda")
        self.doc: dict[str, Any] = {
            "format": "pipecc-gpu-check", "version": 1,
            "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
            "device": self.dev, "device_name": torch.cuda.get_device_name(self.dev) if cuda else "CPU",
            "torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
            "small": self.small, "budget_s": args.budget_s, "pipecc_import": INSTALL,
            "commit": _git_commit(), "cpu_count": os.cpu_count(), "tf32": False, "sections": {}}

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.args.budget_s - self.elapsed()

    def step(self, section: str, name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        """Run one sub-step: its result (with ok, wall_s) recorded under sections[section][name]."""
        rows = self.doc["sections"].setdefault(section, {})
        if self.left() <= 0:
            rows[name] = {"ok": None, "skipped": f"budget of {self.args.budget_s:g} s spent "
                                                   f"({self.elapsed():.0f} s elapsed)"}
            self.say(f"{section}/{name}: SKIPPED ({rows[name]['skipped']})")
            self.write()
            return None
        t0 = time.monotonic()
        try:
            result = fn()
            result.setdefault("ok", True)
        except Exception as e:  # noqa: BLE001  one failing step is recorded, the script goes on
            first = (str(e).strip().splitlines() or [""])[0]
            result = {"ok": False, "error": f"{type(e).__name__}: {first}"[:500]}
            self.log(f"{section}/{name}: traceback", traceback.format_exc())
        result["wall_s"] = round(time.monotonic() - t0, 2)
        if torch.cuda.is_available():
            # the step's models and pipelines: one GPU holds one step's at a time. NOTE: not on a
            # CPU-only machine, where nothing waits for that memory and each full collection of a
            # process holding torch, sympy and fx costs ~0.2-0.5 s (20 sub-steps: seconds of --small)
            gc.collect()
            torch.cuda.empty_cache()
        rows[name] = result
        self.failures += result["ok"] is False
        verdict = "ok" if result["ok"] else "FAILED"
        self.say(f"{section}/{name}: {verdict} in {result['wall_s']} s  {_brief(result)}")
        self.write()
        return result

    def log(self, name: str, text: str, limit: int = 40_000) -> None:
        """Append a command's output (its first and last `limit` / 2 characters) to gpu_check.log."""
        if len(text) > limit:
            text = text[:limit // 2] + f"\n[... {len(text) - limit} characters left out ...]\n" + text[-limit // 2:]
        with self.logfile.open("a") as f:
            f.write(f"\n===== {name} ({self.elapsed():.1f} s)\n{text}\n")

    def keep_run(self, name: str, document: str) -> None:
        """A `pipecc run --json` document, kept in gpu_check_runs.json."""
        try:
            self.runs[name] = json.loads(document)
        except ValueError:
            self.runs[name] = {"unreadable": document[-2000:]}
        _atomic(self.runsfile, json.dumps(self.runs, indent=1))

    def say(self, line: str) -> None:
        print(f"[gpu_check {self.elapsed():6.1f} s] {line}", flush=True)

    def write(self) -> None:
        self.doc["elapsed_s"] = round(self.elapsed(), 1)
        _atomic(self.out / "gpu_check.json", json.dumps(self.doc, indent=1, default=str))
        _atomic(self.out / "gpu_check.md", markdown(self.doc))

    # -- commands ------------------------------------------------------------------------------

    def command(self, name: str, argv: list[str], timeout: float) -> dict[str, Any]:
        """Run `argv` (a budget-bounded timeout); its output goes to gpu_check.log."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // 4)))}
        limit = max(30.0, min(timeout, self.left() + 30.0))
        t0 = time.monotonic()
        try:
            # NOTE: not in ROOT: `python -m` puts the working directory first on sys.path, and ROOT's
            # own pipecc/ (without setup.cfg's passes/backends/models mapping) would shadow the install
            p = subprocess.run(argv, cwd=self.work, env=env, capture_output=True, text=True, timeout=limit)
            rc, stdout, stderr = p.returncode, p.stdout, p.stderr
        except subprocess.TimeoutExpired as e:
            rc, stdout, stderr = 124, _text(e.stdout), _text(e.stderr) + f"\n(timed out after {limit:.0f} s)"
        self.log(name, f"$ {' '.join(argv)}\n# rc {rc}\n--- stdout\n{stdout}\n--- stderr\n{stderr}")
        return {"rc": rc, "wall_s": round(time.monotonic() - t0, 2), "stdout": stdout, "stderr": stderr,
                "error": error_line(stderr) if rc else None, "command": " ".join(argv)}

    def cli(self, name: str, argv: list[str], timeout: float = 300.0) -> dict[str, Any]:
        """`pipecc ARGV` as a user types it (`python -m pipecc.cli`: no console script needed)."""
        return self.command(name, [sys.executable, "-m", "pipecc.cli", *argv], timeout)

    def in_process(self, name: str, argv: list[str]) -> dict[str, Any]:
        """`pipecc ARGV` in this process (`pipecc.cli.main`, as the tests call it): no interpreter and
        torch import per command; its output goes to gpu_check.log."""
        from pipecc.cli import main as pipecc_main
        stdout, stderr = io.StringIO(), io.StringIO()
        t0 = time.monotonic()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                rc = pipecc_main(argv)
            except SystemExit as e:  # argparse's usage errors
                rc = e.code if isinstance(e.code, int) else 1
        err = stderr.getvalue()
        self.log(name, f"$ pipecc {' '.join(argv)}\n# rc {rc}\n--- stdout\n{stdout.getvalue()}\n--- stderr\n{err}")
        return {"rc": rc, "wall_s": round(time.monotonic() - t0, 2), "command": "pipecc " + " ".join(argv),
                "error": error_line(err) if rc else None}

    def compile(self, name: str, case: tuple, devices: str, *extra: str) -> Path:
        """`pipecc compile` of a zoo model file into work/NAME; raises with the error line."""
        model, margs, batch, m = case
        out = self.work / name
        argv = ["compile", str(ROOT / "models" / f"{model}.py"), "-b", str(batch), "-m", str(m), "--devices", devices,
                "--schedule", "1f1b", "--replicas", "1", "--use-all-devices", "-o", str(out), "--force", "-q",
                *[a for k, v in margs.items() for a in ("--model-arg", f"{k}={v}")], *extra]
        r = self.in_process(f"compile.{name}", argv)
        if r["rc"]:
            raise RuntimeError(f"pipecc compile {name}: {r['error']}")
        return out


def error_line(stderr: str) -> str:
    """The line that says what failed: pipecc's one-line error, else the first exception line of a
    rank (not torchrun's ChildFailedError wrapper), else the last line."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for pattern in (r"^(pipecc|gpu_check_train): error: ", r"^(\[rank\d+\]: )?\w*(Error|Exception): ", r"[Ee]rror"):
        hits = [ln for ln in lines if re.search(pattern, ln) and "ChildFailedError" not in ln]
        if hits:
            return hits[0][:500]
    return (lines[-1] if lines else "")[:500]


def _text(b: Any) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _brief(result: dict[str, Any]) -> str:
    """One line of the result for the log: its error, else its headline fields."""
    if result.get("error"):
        return result["error"]
    keys = ("summary", "mode", "verdict", "max_abs_out", "max_abs_grad")
    return "  ".join(f"{k}={result[k]}" for k in keys if k in result)


# ----------------------------------------------------------------------------- numerics

def _zoo(name: str) -> Any:
    import importlib
    return importlib.import_module(f"pipecc.models.{name}")


def build(case: tuple) -> tuple[torch.nn.Module, tuple, torch.Tensor, Any]:
    model_name, margs, batch, _ = case
    module = _zoo(model_name)
    torch.manual_seed(0)
    model = module.build_model(**margs)
    inputs = module.example_inputs(batch, **margs)
    return model, tuple(inputs), module.example_target(batch, **margs), module.loss_fn


def close(got: torch.Tensor, want: torch.Tensor, rtol: float) -> tuple[bool, float, float]:
    """(within, max |got - want|, max |want|): assert_close with `pipecc run --verify`'s rule, atol the
    larger of 1e-5 and rtol times the tensor's largest value (the resolution of its partial sums)."""
    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    scale = float(want.abs().max()) if want.numel() else 0.0
    diff = float((got - want).abs().max()) if want.numel() else 0.0
    try:
        torch.testing.assert_close(got, want, rtol=rtol, atol=max(1e-5, rtol * scale))
        return True, diff, scale
    except AssertionError:
        return False, diff, scale


def forward_backward(model: torch.nn.Module, inputs: tuple, target: torch.Tensor, loss_fn: Any, device: str,
                     bf16: bool = False, chunks: int = 1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Output and every parameter's gradient of one forward + backward on `device`; ``chunks`` > 1
    runs the batch as that many slices whose outputs are joined (a pipeline's micro-batches)."""
    dev = torch.device(device)
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
        out = torch.cat([model(*[x.to(dev) for x in part]) for part in zip(*[x.chunk(chunks) for x in inputs])])
    loss_fn(out.float(), target.to(dev)).backward()
    return out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def compare_run(pm_out: torch.Tensor, pm_grads: dict, ref_out: torch.Tensor, ref_grads: dict, rtol: float) -> dict:
    ok, dout, sout = close(pm_out, ref_out, rtol)
    bad, worst = [], 0.0
    if set(pm_grads) != set(ref_grads):
        bad.append(f"gradient names differ: {sorted(set(pm_grads) ^ set(ref_grads))[:3]}")
    for name in sorted(set(pm_grads) & set(ref_grads)):
        within, diff, scale = close(pm_grads[name], ref_grads[name], rtol)
        worst = max(worst, diff / scale if scale else diff)
        if not within:
            bad.append(f"{name}: max |diff| {diff:.3g} of max |value| {scale:.3g}")
    return {"ok": ok and not bad, "output_ok": ok, "max_abs_out": f"{dout:.3g}", "out_scale": f"{sout:.3g}",
            "gradients": len(ref_grads), "worst_grad_diff_over_scale": f"{worst:.3g}", "rtol": rtol,
            "failures": bad[:5], "dtype_out": str(pm_out.dtype)}


def as_accurate(verdict: dict, pipe: tuple, model: tuple, truth: tuple) -> dict:
    """bf16: the pipeline passes where it matches the model under autocast (``compare_run``), or
    where each tensor's error against the float32 run is at most twice the model's own bf16 error.
    Under autocast a split batch rounds other partial sums to bf16 (a weight's gradient is each
    micro-batch's bf16 product, summed in float32), so a gradient that sums many terms of both
    signs (a bias) can differ from the unsplit bf16 run by more than bf16's rtol while being as
    close to the float32 answer as that run is; the figures behind the verdict are kept."""
    (p_out, p_grads), (m_out, m_grads), (t_out, t_grads) = pipe, model, truth
    worst, bad = 0.0, []
    pairs = [("output", p_out, m_out, t_out)] + [(n, p_grads[n], m_grads[n], t_grads[n])
                                                 for n in sorted(set(p_grads) & set(m_grads) & set(t_grads))]
    for name, p, m, t in pairs:
        p, m, t = (x.detach().float().cpu() for x in (p, m, t))
        e_pipe, e_model = float((p - t).abs().max()), float((m - t).abs().max())
        ratio = e_pipe / e_model if e_model else (0.0 if e_pipe == 0 else float("inf"))
        worst = max(worst, ratio)
        if ratio > 2.0:
            bad.append(f"{name}: error vs float32 {e_pipe:.3g}, the model's own bf16 error {e_model:.3g}")
    verdict = dict(verdict, matched_model_bf16=verdict["ok"], worst_error_ratio_vs_model_bf16=f"{worst:.3g}",
                   accuracy_failures=bad[:5])
    verdict["ok"] = verdict["ok"] or not bad
    return verdict


def numerics(check: Check, name: str, case: tuple, precision: str) -> dict[str, Any]:
    """The drop-in on 2xh200@DEVICE against the model on DEVICE (and, fp32, on the CPU)."""
    import pipecc
    model, inputs, target, loss_fn = build(case)
    on_dev, on_cpu = copy.deepcopy(model).to(check.dev), copy.deepcopy(model)
    pm = pipecc.compile(model, inputs, f"2xh200@{check.dev}", microbatches=case[3], schedule="1f1b", replicas=1,
                        precision=precision)
    bf16 = precision == "bf16"
    truth = copy.deepcopy(on_dev) if bf16 else None
    out, grads = forward_backward(pm, inputs, target, loss_fn, check.dev)
    ref_out, ref_grads = forward_backward(on_dev, inputs, target, loss_fn, check.dev, bf16=bf16)
    result = {"devices": [str(d) for d in pm.pipeline_info()["devices"]], "stages": len(pm.plan.stages),
              "vs_model_on_device": compare_run(out, grads, ref_out, ref_grads, BF16 if bf16 else FP32)}
    if bf16:
        sliced = copy.deepcopy(truth)
        f32_out, f32_grads = forward_backward(truth, inputs, target, loss_fn, check.dev)
        result["vs_model_on_device"] = as_accurate(result["vs_model_on_device"], (out, grads),
                                                   (ref_out, ref_grads), (f32_out, f32_grads))
        # the same arithmetic: the model under autocast, the batch in the pipeline's micro-batches
        mb_out, mb_grads = forward_backward(sliced, inputs, target, loss_fn, check.dev, bf16=True, chunks=case[3])
        result["vs_model_microbatched"] = compare_run(out, grads, mb_out, mb_grads, BF16)
    if not bf16:
        cpu_out, cpu_grads = forward_backward(on_cpu, inputs, target, loss_fn, "cpu")
        result["vs_model_on_cpu"] = compare_run(out, grads, cpu_out, cpu_grads, FP32)
    verdicts = [v["ok"] for k, v in result.items() if k.startswith("vs_")]
    # bf16: as close as the unsplit model's autocast run (``as_accurate``), or as its micro-batched one
    result["ok"] = any(verdicts) if bf16 else all(verdicts)
    result["summary"] = ", ".join(f"{k}: {'match' if v['ok'] else 'DIFFER'}" for k, v in result.items()
                                  if k.startswith("vs_"))
    return result


# ----------------------------------------------------------------------------- the steps

def step_import(check: Check) -> None:
    def imported() -> dict[str, Any]:
        import pipecc
        declared = re.search(r"^\s*torch\s*([<>=!~][^\n;]*)", (ROOT / "setup.cfg").read_text(), re.M)
        spec = declared.group(1).strip() if declared else ""
        ok = _satisfies(torch.__version__, spec)
        return {"ok": ok, "pipecc": pipecc.__version__, "from": str(Path(pipecc.__file__).parent),
                "declared_torch": spec, "summary": f"torch {torch.__version__} {'within' if ok else 'OUTSIDE'} {spec}"}

    def compiled() -> dict[str, Any]:
        import pipecc
        model, inputs, target, loss_fn = build(("mlp", dict(in_features=16, hidden=32, depth=3, num_classes=5), 8, 2))
        ref = copy.deepcopy(model)
        pm = pipecc.compile(model, inputs, f"2xh200@{check.dev}", microbatches=2, replicas=1)
        out, grads = forward_backward(pm, inputs, target, loss_fn, check.dev)
        ref_out, ref_grads = forward_backward(ref.to(check.dev), inputs, target, loss_fn, check.dev)
        r = compare_run(out, grads, ref_out, ref_grads, FP32)
        r.update(plan=repr(pm.plan), devices=[str(d) for d in pm.pipeline_info()["devices"]])
        return r

    check.step("1_import", "import", imported)
    check.step("1_import", "compile", compiled)


def _satisfies(version: str, spec: str) -> bool:
    """Whether torch `version` meets setup.cfg's `spec` (">=2.5" or ">=2.5,<3"; numbers only)."""
    have = tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3])
    for part in filter(None, (p.strip() for p in spec.split(","))):
        op, want = re.match(r"([<>=!~]+)\s*([\d.]+)", part).groups()
        w = tuple(int(x) for x in want.split("."))
        h = have[:len(w)]
        if not {">=": h >= w, ">": h > w, "<": h < w, "<=": h <= w, "==": h == w, "!=": h != w,
                "~=": h >= w}.get(op, False):
            return False
    return True


def step_numerics(check: Check) -> None:
    for name, case in (NUMERICS_SMALL if check.small else NUMERICS).items():
        for precision in ("fp32", "bf16"):
            check.step("2_numerics", f"{name}.{precision}", lambda n=name, c=case, p=precision: numerics(check, n, c, p))


def step_run(check: Check) -> None:
    """A folder run with `pipecc run --verify`: heterogeneous first, else every stage in one process."""
    state: dict[str, Any] = {}

    def hetero() -> dict[str, Any]:
        out = check.compile("run_hetero", RUN_MODEL, f"h200@{check.dev},cpu")
        r = check.cli("run.hetero", ["run", str(out), "--steps", "3", "--verify", "--backend", "gloo",
                                     "--timeout", "60", "--json"], timeout=150)
        if r["rc"] == 0:
            check.keep_run("run_hetero", r["stdout"])
        verify = [ln for ln in r["stderr"].splitlines() + r["stdout"].splitlines() if ln.startswith("verify")]
        state["ran"] = r["rc"] == 0
        return {"ok": r["rc"] == 0, "mode": "stage 0 on DEVICE, stage 1 on the CPU, 2 ranks over gloo",
                "verdict": verify[-1] if verify else None, "error": r["error"], "rc": r["rc"], "command": r["command"]}

    def one_process() -> dict[str, Any]:
        out = check.compile("run_one", RUN_MODEL, f"2xh200@{check.dev}")
        r = check.command("run.one_process", [sys.executable, "-m", "pipecc.runtime.dist", str(out), "--steps", "3",
                                              "--verify", "--schedule", "interleaved"], timeout=150)
        verify = [ln for ln in r["stderr"].splitlines() + r["stdout"].splitlines() if ln.startswith("verify")]
        return {"ok": r["rc"] == 0, "mode": "every stage in one process on DEVICE", "verdict": verify[-1] if verify else None,
                "error": r["error"], "rc": r["rc"], "command": r["command"]}

    check.step("3_run", "heterogeneous", hetero)
    if not state.get("ran") or check.small:  # --small runs both paths: the fallback is proven too
        check.step("3_run", "one_process", one_process)


def step_fidelity(check: Check) -> None:
    reps = 3 if check.small else 10
    for name, case in (FIDELITY_SMALL if check.small else FIDELITY).items():
        folders: dict[str, Any] = {}

        def planned(name: str = name, case: tuple = case) -> dict[str, Any]:
            out = check.compile(f"fid_{name}", case, f"2xh200@{check.dev}")
            folders["plan"] = out
            result = measure.measure_folder(out, check.dev, reps)
            folders["measured"] = result
            return {**result, "summary": _ratios(result)}

        def calibrated(name: str = name, case: tuple = case) -> dict[str, Any]:
            out = folders["plan"]
            run = check.command(f"fid.{name}.run", [sys.executable, "-m", "pipecc.runtime.dist", str(out), "--steps",
                                                    "4" if check.small else "8", "--json", "--warmup-steps", "2",
                                                    "--schedule", "interleaved"], timeout=300)
            if run["rc"]:
                raise RuntimeError(f"one-process run --json: {run['error']}")
            doc = check.work / f"fid_{name}.run.json"
            doc.write_text(run["stdout"])
            check.keep_run(f"fid_{name}", run["stdout"])
            cal = check.compile(f"fid_{name}_cal", case, f"2xh200@{check.dev}", "--calibrate", str(doc))
            same = measure.same_cuts(out, cal)
            result = measure.measure_folder(cal, check.dev, reps) if not same else _replanned(folders["measured"], cal)
            measured_run = json.loads(doc.read_text())
            return {**result, "same_cuts_as_uncalibrated": same, "run_document": str(doc),
                    "run_stages": [{k: s.get(k) for k in ("index", "forward_s", "backward_s", "host_s",
                                                          "predicted_forward_s", "predicted_backward_s")}
                                   for s in measured_run.get("stages", [])],
                    "run_step_s": measured_run.get("step_s", {}).get("median"),
                    "run_predicted_step_s": measured_run.get("predicted_step_s"), "summary": _ratios(result)}

        check.step("4_fidelity", name, planned)
        if "measured" in folders:
            check.step("4_fidelity", f"{name}.calibrated", calibrated)


def _replanned(measured: dict[str, Any], cal: Path) -> dict[str, Any]:
    """The measured stages of a plan with the same cuts, beside the calibrated plan's figures."""
    plan = json.loads((cal / "plan.json").read_text())
    rows = [{**row, "plan_forward_s": s["forward_s"], "plan_backward_s": s["backward_s"],
             "plan_peak_memory_bytes": s["peak_memory_bytes"]} for row, s in zip(measured["stages"], plan["stages"])]
    return {**measured, "folder": str(cal), "predicted_iteration_s": plan.get("predicted_iteration_s"), "stages": rows}


def _ratios(result: dict[str, Any]) -> str:
    """measured / plan per stage, forward and backward."""
    return "; ".join(f"stage {s['stage']} fwd x{s['forward_s'] / s['plan_forward_s']:.2f} "
                     f"bwd x{s['backward_s'] / s['plan_backward_s']:.2f}" for s in result["stages"]
                     if s["plan_forward_s"] and s["plan_backward_s"])


def step_train(check: Check) -> None:
    """#34 item 5 (bench/gpu_check_train.py)."""
    args = dict(CHARGPT_SMALL if check.small else CHARGPT)
    batch, m, lr = (8, 4, 3e-3) if check.small else (32, 4, 3e-3)
    steps = check.args.train_steps or (10 if check.small else 40)
    case = ("chargpt", args, batch, m)
    state: dict[str, Any] = {}

    def folders() -> dict[str, Any]:
        import pipecc
        gpu = check.compile("train_gpu", case, f"2xh200@{check.dev}", "--precision", "bf16")
        hetero = check.compile("train_hetero", case, f"h200@{check.dev},cpu", "--precision", "bf16")
        weights = pipecc.load(gpu).state_dict()
        path = check.work / "train_weights.pt"
        torch.save(weights, path)
        state.update(gpu=gpu, hetero=hetero, weights=weights, path=path)
        return {"gpu_folder": str(gpu), "hetero_folder": str(hetero), "model_args": args, "batch": batch,
                "microbatches": m, "steps": steps, "lr": lr, "clip_grad_norm": train.CLIP}

    def references() -> dict[str, Any]:
        for name, bf16, chunks in (("fp32", False, 1), ("bf16", True, 1), ("bf16_microbatched", True, m)):
            state[name] = train.reference(state["weights"], args, steps, batch, lr, check.dev, bf16, chunks)
        return {"fp32": state["fp32"], "bf16": state["bf16"], "bf16_microbatched": state["bf16_microbatched"],
                "bf16_vs_fp32": train.compare(state["bf16"]["losses"], state["fp32"]["losses"]),
                "bf16_microbatched_vs_bf16": train.compare(state["bf16_microbatched"]["losses"],
                                                           state["bf16"]["losses"]),
                "summary": f"fp32 {state['fp32']['losses'][0]:.3f} -> {state['fp32']['losses'][-1]:.3f}, "
                           f"bf16 {state['bf16']['losses'][0]:.3f} -> {state['bf16']['losses'][-1]:.3f}"}

    def against(losses: list[float]) -> dict[str, Any]:
        refs = [k for k in ("fp32", "bf16", "bf16_microbatched") if k in state]
        out = {f"vs_{k}": train.compare(losses, state[k]["losses"]) for k in refs}
        out["ok"] = len(refs) == 3 and (out["vs_bf16_microbatched"]["ok"] or
                                        train.bf16_verdict(losses, *(state[k]["losses"] for k in refs)))
        out["summary"] = f"{losses[0]:.3f} -> {losses[-1]:.3f}; " + ", ".join(
            f"{k}: {'within' if v['ok'] else 'OUTSIDE'} bf16 tolerance" for k, v in out.items() if k.startswith("vs_"))
        return out

    def dropin() -> dict[str, Any]:
        r = train.dropin(state["weights"], args, steps, batch, m, lr, check.dev)
        return {**r, **against(r["losses"])}

    def distributed() -> dict[str, Any]:
        record = check.work / "train_hetero"
        for old in check.work.glob("train_hetero.rank*"):
            old.unlink()
        r = check.command("train.hetero", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                           "--nproc-per-node", "2", str(BENCH / "gpu_check_train.py"), "worker",
                                           str(state["hetero"]), str(steps), str(lr), str(state["path"]),
                                           str(record), str(args["seq_len"])], timeout=180)
        state["hetero_ran"] = r["rc"] == 0
        if r["rc"]:
            ranks = {f.name: f.read_text().splitlines()[0] for f in sorted(check.work.glob("train_hetero.rank*.error.txt"))}
            for f in sorted(check.work.glob("train_hetero.rank*.error.txt")):
                check.log(f"train.{f.name}", f.read_text())
            return {"ok": False, "mode": "2 ranks: stage 0 on DEVICE, stage 1 on the CPU, gloo",
                    "error": r["error"], "rank_errors": ranks, "rc": r["rc"], "command": r["command"]}
        ranks = [json.loads(Path(f"{record}.rank{k}.json").read_text()) for k in range(2)]
        return {"mode": "2 ranks: stage 0 on DEVICE, stage 1 on the CPU, gloo", "ranks": ranks,
                "same_loss_on_every_rank": ranks[0]["losses"] == ranks[1]["losses"], **against(ranks[0]["losses"])}

    def one_process() -> dict[str, Any]:
        rec = train.distributed_loop(str(state["gpu"]), steps, lr, str(state["path"]), args["seq_len"])
        return {"mode": "one process, every stage on DEVICE", "rank": rec, **against(rec["losses"])}

    def stages() -> dict[str, Any]:
        result = measure.measure_folder(state["gpu"], check.dev, 3 if check.small else 10)
        return {**result, "summary": _ratios(result)}

    if check.step("5_train", "folders", folders) is None or "weights" not in state:
        return
    check.step("5_train", "reference", references)
    check.step("5_train", "dropin_bf16", dropin)
    check.step("5_train", "distributed_bf16", distributed)
    if not state.get("hetero_ran") or check.small:
        check.step("5_train", "distributed_bf16_one_process", one_process)
    check.step("5_train", "stages_bf16", stages)


# ----------------------------------------------------------------------------- report

def markdown(doc: dict[str, Any]) -> str:
    lines = [f"## GPU check: {doc['device_name']} ({doc['device']}), torch {doc['torch']} (CUDA {doc['cuda']}), "
             f"TF32 off", "", f"Command: `{doc['command']}`; pipecc {doc['pipecc_import']}, commit "
             f"{doc['commit']}; {doc.get('elapsed_s', 0)} s of a {doc['budget_s']:g} s budget.", ""]
    for section, rows in doc["sections"].items():
        lines += [f"### {section}", ""]
        for name, r in rows.items():
            state = "skipped" if r.get("ok") is None else "ok" if r["ok"] else "FAILED"
            lines.append(f"- **{name}**: {state}" + (f" — {r['skipped']}" if r.get("skipped") else "")
                         + (f" — `{r['error']}`" if r.get("error") else "")
                         + (f" — {r['summary']}" if r.get("summary") else "")
                         + (f" — {r['mode']}" if r.get("mode") else "")
                         + (f" — {r['verdict']}" if r.get("verdict") else ""))
            for key, v in r.items():
                if key.startswith("vs_") and isinstance(v, dict) and "max_abs_out" in v:
                    lines.append(f"  - {key}: {'match' if v['ok'] else 'DIFFER'} (rtol {v['rtol']:g}; output "
                                 f"{v['dtype_out']} max |Δ| {v['max_abs_out']} of max {v['out_scale']}; "
                                 f"{v['gradients']} gradients, worst max |Δ| / max |value| "
                                 f"{v['worst_grad_diff_over_scale']})" + "".join(f"; {f}" for f in v["failures"]))
                    if "worst_error_ratio_vs_model_bf16" in v:
                        lines.append(f"    - against the float32 run: the pipeline's error is at most "
                                     f"{v['worst_error_ratio_vs_model_bf16']}x the model's own bf16 error (bar 2x)"
                                     + "".join(f"; {f}" for f in v["accuracy_failures"]))
                elif key.startswith("vs_") and isinstance(v, dict) and "worst_step" in v:
                    lines.append(f"  - {key}: {'within' if v['ok'] else 'OUTSIDE'} rtol {v['rtol']:g} atol "
                                 f"{v['atol']:g}; max |Δ| {v['max_abs_diff']:.3g}, worst step {v['worst_step']}: "
                                 f"{v['got']:.4f} vs {v['want']:.4f}")
            if r.get("rank_errors"):
                lines += [f"  - {k}: `{v}`" for k, v in r["rank_errors"].items()]
            if isinstance(r.get("stages"), list) and r["stages"] and isinstance(r["stages"][0], dict):
                lines += ["", f"  {r.get('devices')}, batch {r.get('batch')}, {r.get('microbatches')} micro-batches, "
                              f"{r.get('schedule')}, {r.get('precision')}; per micro-batch:", ""]
                lines += ["  " + row for row in measure.table(r)] + [""]
        if section == "5_train":
            lines += loss_table(rows)
        lines.append("")
    return "\n".join(lines)


def loss_table(rows: dict[str, Any]) -> list[str]:
    """Every 5th step's loss (and the last) of each training run, side by side."""
    runs = {k: v["losses"] for k, v in (rows.get("reference") or {}).items() if isinstance(v, dict) and "losses" in v}
    runs.update({k: v["losses"] for k, v in rows.items() if isinstance(v, dict) and "losses" in v})
    for k, v in rows.items():
        if isinstance(v, dict) and isinstance(v.get("ranks"), list) and v["ranks"]:
            runs[k] = v["ranks"][0]["losses"]
        elif isinstance(v, dict) and isinstance(v.get("rank"), dict):
            runs[k] = v["rank"]["losses"]
    if not runs:
        return []
    n = max(len(v) for v in runs.values())
    steps = sorted({*range(0, n, 5), n - 1})
    out = ["", "| step | " + " | ".join(runs) + " |", "|---:|" + "---:|" * len(runs)]
    for i in steps:
        out.append(f"| {i} | " + " | ".join(f"{v[i]:.4f}" if i < len(v) else "" for v in runs.values()) + " |")
    return out


STEPS = {"import": step_import, "numerics": step_numerics, "run": step_run, "fidelity": step_fidelity,
         "train": step_train}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda:0", help="cuda:0 (default), or cpu for a smoke run")
    parser.add_argument("--small", action="store_true", help="tiny sizes (a smoke run of every step)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu_check_out"),
                        help="folder for the four result files (default $OUT, else ./gpu_check_out)")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="no step starts after this many seconds (default 420)")
    parser.add_argument("--steps", default=",".join(STEPS), help=f"which steps, in order (default {','.join(STEPS)})")
    parser.add_argument("--train-steps", type=int, default=None, help="chargpt steps (default 40; --small 10)")
    parser.add_argument("--work", type=Path, default=None,
                        help="folder for the compiled folders (default: a temporary one, removed at the end)")
    parser.add_argument("--render", type=Path, metavar="JSON",
                        help="run nothing: print the markdown of a gpu_check.json a GPU run brought back")
    parser.add_argument("--write", type=Path, metavar="RESULTS_MD",
                        help="with --render: put it in this file's `gpu-check` section (bench/RESULTS.md)")
    args = parser.parse_args(argv)
    if args.render is not None:
        text = markdown(json.loads(args.render.read_text()))
        if args.write is None:
            print(text)
        else:
            from results import replace_section
            replace_section(args.write, "gpu-check", text)
        return 0
    if args.write is not None:
        parser.error("--write goes with --render JSON")
    unknown = [s for s in args.steps.split(",") if s not in STEPS]
    if unknown:
        parser.error(f"--steps: unknown {unknown}; choose from {','.join(STEPS)}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("no CUDA device here; use --device cpu --small for a smoke run")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    check = Check(args)
    check.say(f"{check.doc['device_name']}, torch {torch.__version__}, pipecc {INSTALL}; writing {args.out}")
    check.write()
    for name in args.steps.split(","):
        STEPS[name](check)
    if args.work is None:
        shutil.rmtree(check.work, ignore_errors=True)
    check.say(f"done: {check.failures} failed; {args.out / 'gpu_check.md'}")
    return 1 if check.failures else 0


if __name__ == "__main__":
    sys.exit(main())
