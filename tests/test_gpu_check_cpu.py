"""bench/gpu_check.py, the one prepared script for a lent GPU (docs/gpu-check.md), run end to end
on the CPU (`--device cpu --small`): every step and sub-step runs and passes, and its files say so.
On the GPU the same code runs at full sizes; what only CUDA has (peak memory) is n/a here."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("gpu_check")]

SUBSTEPS = {
    "1_import": {"import", "compile"},
    "2_numerics": {"gpt.fp32", "gpt.bf16", "vgg16.fp32", "vgg16.bf16"},
    "3_run": {"heterogeneous", "one_process"},
    "4_fidelity": {"gpt-tiny", "gpt-tiny.calibrated", "gpt-tiny4", "gpt-tiny4.calibrated", "vgg16",
                   "vgg16.calibrated"},
    "5_train": {"folders", "reference", "dropin_bf16", "distributed_bf16", "distributed_bf16_one_process",
                "stages_bf16"},
}


def test_cpu_smoke_run_passes_every_step_and_writes_its_files(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("OUT", None)
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--device", "cpu", "--small", "--out", str(out),
           "--train-steps", "4", "--budget-s", "3000"]
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # every file the device tool brings back, and no folder (it brings back at most 8 files)
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.log", "gpu_check.md",
                                                     "gpu_check_runs.json"]
    doc = json.loads((out / "gpu_check.json").read_text())
    assert doc["format"] == "pipecc-gpu-check" and doc["device"] == "cpu" and doc["torch"]
    assert {k: set(v) for k, v in doc["sections"].items()} == SUBSTEPS
    failed = {f"{s}/{k}": v.get("error") for s, rows in doc["sections"].items() for k, v in rows.items()
              if v.get("ok") is not True}
    assert not failed, failed
    # each sub-step printed its line as it finished
    for section, names in SUBSTEPS.items():
        for name in names:
            assert f"] {section}/{name}: ok in " in result.stdout, (section, name)

    numerics = doc["sections"]["2_numerics"]
    assert set(numerics["gpt.fp32"]) >= {"vs_model_on_device", "vs_model_on_cpu"}
    assert numerics["gpt.fp32"]["vs_model_on_cpu"]["gradients"] > 0
    assert numerics["gpt.bf16"]["vs_model_on_device"]["dtype_out"] == "torch.bfloat16"
    fid = doc["sections"]["4_fidelity"]["gpt-tiny4"]
    assert len(fid["stages"]) == 2 and all(s["forward_s"] > 0 and s["backward_s"] > 0 for s in fid["stages"])
    assert all(s["peak_memory_bytes"] is None and s["plan_peak_memory_bytes"] > 0 for s in fid["stages"])
    runs = json.loads((out / "gpu_check_runs.json").read_text())
    assert {"fid_gpt-tiny", "fid_gpt-tiny4", "fid_vgg16", "run_hetero"} <= set(runs)
    assert all(r["format"] == "pipecc-run" for r in runs.values())
    train = doc["sections"]["5_train"]
    hetero = train["distributed_bf16"]
    assert [r["stages"] for r in hetero["ranks"]] == [[0], [1]] and hetero["same_loss_on_every_rank"]
    assert len(train["dropin_bf16"]["losses"]) == 4 and train["dropin_bf16"]["vs_bf16"]["ok"]
    md = (out / "gpu_check.md").read_text()
    assert "### 5_train" in md and "| step |" in md and "peak MiB: plan / measured" in md
    # the markdown again from the JSON, for bench/RESULTS.md's gpu-check section (in this process:
    # --render runs nothing, and a second python importing torch costs seconds)
    results = tmp_path / "RESULTS.md"
    assert _bench("gpu_check", "main", ["--render", str(out / "gpu_check.json"), "--write", str(results)]) == 0
    text = results.read_text()
    assert "<!-- gpu-check:begin -->" in text and "### 4_fidelity" in text


def _bench(name, call=None, *args):
    """bench/NAME imported (bench/ on sys.path only meanwhile); with `call`, NAME.call(*args)
    run with bench/ still on the path (gpu_check's --write imports bench/results.py)."""
    before = list(sys.path)
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        module = __import__(name)
        return module if call is None else getattr(module, call)(*args)
    finally:
        sys.path[:] = before


@pytest.mark.parametrize("run, ok", [
    ([4.0] * 12, True),  # the float32 run itself
    ([4.0] * 11 + [4.3], True),  # the bf16 reference's late drift
    ([4.0] * 11 + [4.6], False),  # near neither reference
    ([4.0] * 5 + [4.3] + [4.0] * 6, False),  # an early step near neither
])
def test_a_bf16_run_must_match_both_references_early_and_one_always(run, ok):
    train = _bench("gpu_check_train")
    fp32, bf16 = [4.0] * 12, [4.0] * 11 + [4.3]  # the bf16 reference strays at step 11
    assert train.bf16_verdict(run, fp32, bf16) is ok
    # within the first 10 steps one reference is not enough
    assert train.bf16_verdict([4.0] * 12, fp32, [4.0] * 5 + [4.3] + [4.0] * 6) is False
