"""Checkpoints that survive a re-plan (issue #23 item 1): a checkpoint of one compiled folder resumes
in another folder of the same model (other stage counts, schedule, split layers, replicas),
mapped through the original model's tensor names (``pipecc.runtime.ckpt_remap``), and
``pipecc export-checkpoint`` writes the model's state dict that ``load_state_dict`` takes.

What is bit-identical to a run that never moved, and what is only close (measured here):
  * other stage counts and schedules (2 stages -> 4 stages, 2 -> 3 stages under gpipe), in one
    process and under torchrun: bit-identical (every op runs on the same shapes in the same
    order; the gradients of the micro-batches are summed in the same order);
  * split layers (a Linear cut into shards along its output dim): assert_close (a shard's matmul
    is a smaller BLAS call: ~1.5e-8 apart after 4 Adam steps);
  * replicas (2 stages x 2 replicas): assert_close (each replica's half micro-batch and the
    all-reduce sum the gradient in another order: ~4.5e-8).
  * Bi-Partition folders from and to plain ones (a residual MLP, SGD): assert_close.
The tiny MLP has no dropout, so the RNG (re-seeded when the ranks' stages change) plays no part;
an MLP with dropout shows both RNG cases (the same ranks' state: bit-identical; re-seeded: not).

In process where it can be (one process runs every stage of a folder); one test launches
torchrun three times (2 ranks, then 4 ranks and 2 x 2 replicas resuming that checkpoint).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import MLP_TINY, compile_mlp as compile_tiny_mlp, model_args, rehash, zoo_module
from helpers import pipecc_here as pipecc  # in this process: only torchrun and its ranks start
from pipecc import cli, driver
from pipecc.runtime import dist
from pipecc.runtime.checkpoints import _sha256 as file_sha256

pytestmark = pytest.mark.xdist_group(name="checkpoint_replan")

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ("--optimizer", "adam", "--lr", "0.01")
STEP = re.compile(r"^step (\d+): loss (\S+)", re.MULTILINE)


# NOTE: the split-layer case uses hidden 1024, not MLP_TINY's 32: with the fixed costs counted
# the planner splits no layer of the TINY MLP on any device count (a split only adds calls there)
BIG = {**MLP_TINY, "hidden": 1024}


def compile_mlp(out: Path, devices: str, *extra: str, args: dict | None = None) -> Path:
    """The MLP (tiny unless `args`), batch 8 in 2 micro-batches; `extra` gives --replicas."""
    return compile_tiny_mlp(out, *extra, devices=devices, replicas=None, args=args or MLP_TINY)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("replan")
    return {
        "two": compile_mlp(base / "two", "2xcpu", "--replicas", "1", "--split-layers", "off"),
        "four": compile_mlp(base / "four", "4xcpu", "--replicas", "1", "--split-layers", "off"),
        "three_gpipe": compile_mlp(base / "three", "3xcpu", "--replicas", "1", "--split-layers", "off",
                                   "--schedule", "gpipe"),
        # the planner splits a layer (gpipe: under 1f1b the unsplit plan now predicts the shorter iteration)
        "split": compile_mlp(base / "split", "4xcpu", "--replicas", "1", "--schedule", "gpipe", args=BIG),
        "two_big": compile_mlp(base / "two_big", "2xcpu", "--replicas", "1", "--split-layers", "off", args=BIG),
        "replicas": compile_mlp(base / "rep", "4xcpu", "--replicas", "2", "--split-layers", "off"),
        "other": compile_mlp(base / "other", "2xcpu", "--replicas", "1", "--split-layers", "off",
                             args={**MLP_TINY, "hidden": 24}),
    }


def train(out: Path, ckpt: Path, steps: int, *extra: str) -> str:
    """One process runs every stage of ``out``: ``--steps`` Adam steps, checkpoints in ``ckpt``;
    what it printed."""
    printed, errors = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
        code = dist.main([str(out), "--steps", str(steps), "--schedule", "interleaved", "--checkpoint-dir",
                          str(ckpt), *TRAIN, *extra])
    assert code == 0, errors.getvalue()
    return printed.getvalue()


def export(ckpt: Path, path: Path) -> dict[str, torch.Tensor]:
    assert cli.main(["export-checkpoint", str(ckpt), str(path), "-q", "--force"]) == 0
    return load_file(path)


def _straight(two: Path, base: Path) -> tuple[dict[str, torch.Tensor], str, Path]:
    out = train(two, base / "ckpt", 4, "--checkpoint-every", "2")
    half = base / "half"  # the folder as it was after step 2
    half.mkdir()
    shutil.copytree(base / "ckpt" / "step_2", half / "step_2")
    latest = json.loads((base / "ckpt" / "latest.json").read_text())
    (half / "latest.json").write_text(json.dumps({**latest, "step": 2}))
    return export(base / "ckpt", base / "straight.safetensors"), out, half


@pytest.fixture(scope="module")
def straight(folders, tmp_path_factory) -> tuple[dict[str, torch.Tensor], str, Path]:
    """4 steps of the 2-stage folder, never moved: (exported weights, its output, a copy of its
    step-2 checkpoint to resume elsewhere)."""
    return _straight(folders["two"], tmp_path_factory.mktemp("straight"))


@pytest.fixture(scope="module")
def straight_big(folders, tmp_path_factory) -> tuple[dict[str, torch.Tensor], str, Path]:
    """`straight` for the BIG model (the split-layer case)."""
    return _straight(folders["two_big"], tmp_path_factory.mktemp("straight_big"))


def resumed(straight, tmp_path: Path, into: Path, steps: int) -> tuple[dict[str, torch.Tensor], str]:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(straight[2], ckpt)
    out = train(into, ckpt, steps, "--resume")
    return export(ckpt, tmp_path / "resumed.safetensors"), out


def losses(text: str) -> list[str]:
    return [loss for _, loss in STEP.findall(text)]


@pytest.mark.parametrize("into", ["four", "three_gpipe"])
def test_a_replanned_resume_is_bitwise(folders, straight, tmp_path, capsys, into) -> None:
    """2 stages for 2 steps, then 4 stages (or 3 under gpipe) to step 4 == 2 stages for 4 steps."""
    got, out = resumed(straight, tmp_path, folders[into], 4)
    stages = 4 if into == "four" else 3
    assert f"note: re-mapped from a plan of 2 stages on 1 rank to this one of {stages} stages on 1 rank" in out
    assert [int(i) for i, _ in STEP.findall(out)] == [2, 3]
    want = straight[0]
    assert got.keys() == want.keys() == {"0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"}
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]


def test_split_layers_both_ways_are_close(folders, straight_big, tmp_path, capsys) -> None:
    """Into a folder whose layer 0 is split in shards (the slices cut from the full weights and
    Adam state), and from it back into whole layers (the shards joined)."""
    split = folders["split"]
    assert any("SHARDS = {" in p.read_text() for p in split.glob("stage_*/stage.py")), "no split layer"
    got, out = resumed(straight_big, tmp_path / "in", split, 4)
    assert "note: re-mapped from a plan of 2 stages" in out
    for k, want in straight_big[0].items():
        torch.testing.assert_close(got[k], want, rtol=1e-5, atol=1e-6)
    # and back: 2 steps of the split folder, resumed by the 2-stage one, against 4 steps of the split folder
    ckpt, back = tmp_path / "split_ckpt", tmp_path / "back"
    train(split, ckpt, 4, "--checkpoint-every", "2")
    split_4 = export(ckpt, tmp_path / "split4.safetensors")
    shutil.copytree(ckpt, back)
    shutil.rmtree(back / "step_4")
    latest = json.loads((back / "latest.json").read_text())
    (back / "latest.json").write_text(json.dumps({**latest, "step": 2}))
    out = train(folders["two_big"], back, 4, "--resume")
    assert "note: re-mapped from a plan of 4 stages" in out
    got = export(back, tmp_path / "back.safetensors")
    for k, want in split_4.items():
        torch.testing.assert_close(got[k], want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # three torchrun launches (make test-fast leaves it out)
def test_torchrun_replan_to_four_ranks_is_bitwise_and_to_replicas_close(folders, straight, tmp_path) -> None:
    """2 ranks checkpoint at step 2; 4 ranks (4 stages) resume it bit-identically, 2 stages x 2
    replicas resume it within rounding; the losses printed are the straight run's."""
    first = tmp_path / "ckpt"
    run = pipecc("run", str(folders["two"]), "--steps", "2", *TRAIN, "--checkpoint-dir", str(first), "--timeout", "60")
    assert run.returncode == 0, run.stderr[-3000:]
    copy = tmp_path / "ckpt_rep"
    shutil.copytree(first, copy, ignore=shutil.ignore_patterns(".pipecc-run.lock"))
    four = pipecc("run", str(folders["four"]), "--steps", "4", *TRAIN, "--checkpoint-dir", str(first), "--resume",
                  "--timeout", "60")
    assert four.returncode == 0, four.stderr[-3000:]
    assert "note: re-mapped from a plan of 2 stages on 2 ranks to this one of 4 stages on 4 ranks" in four.stdout
    assert losses(four.stdout) == losses(straight[1])[2:]
    got = export(first, tmp_path / "four.safetensors")
    assert all(torch.equal(got[k], v) for k, v in straight[0].items())
    rep = pipecc("run", str(folders["replicas"]), "--steps", "4", *TRAIN, "--checkpoint-dir", str(copy),
                 "--resume", "--timeout", "60")
    assert rep.returncode == 0, rep.stderr[-3000:]
    assert "to this one of 2 stages on 4 ranks" in rep.stdout
    assert sorted(p.name for p in (copy / "step_4").glob("*.safetensors")) == [f"stage_{r}.safetensors"
                                                                               for r in range(4)]
    got = export(copy, tmp_path / "rep.safetensors")
    for k, want in straight[0].items():
        torch.testing.assert_close(got[k], want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- export-checkpoint


def test_export_loads_strict_with_buffers_and_tied_weights(tmp_path, capsys) -> None:
    """tiny_cnn (BatchNorm running statistics) and a GPT whose tied embedding/head weight sits on
    both stages: the exported file loads strict into the model the model file builds, and holds
    the trained values (the buffers moved off their initial values)."""
    gpt_args = {**zoo_module("gpt").TINY, "tie_weights": True}
    for name, args, batch in (("tiny_cnn", zoo_module("tiny_cnn").TINY, "4"), ("gpt", gpt_args, "16")):
        out = tmp_path / name
        argv = ["compile", str(ROOT / "models" / f"{name}.py"), "-d", "2xcpu", "--replicas", "1", "-b", batch,
                "-m", "2", "-o", str(out), "-q", "--split-layers", "off", "--use-all-devices"]
        for arg in model_args(args):
            argv += ["--model-arg", arg]
        assert cli.main(argv) == 0
        ckpt = tmp_path / f"{name}_ckpt"
        train(out, ckpt, 2)
        state = export(ckpt, tmp_path / f"{name}.safetensors")
        model = zoo_module(name).build_model(**args)
        fresh = {k: v.clone() for k, v in model.state_dict().items()}
        model.load_state_dict(state, strict=True)
        saved = {}
        for rank_file in (ckpt / "step_2").glob("stage_*.safetensors"):
            saved.update(load_file(rank_file))
        names = {}
        for rank_json in (ckpt / "step_2").glob("stage_*.json"):
            names.update(json.loads(rank_json.read_text())["names"])
        for key, naming in names.items():  # the stage tensors, under each of their names
            for qualified in naming:
                assert torch.equal(model.state_dict()[qualified], saved[key]), qualified
        changed = [k for k in fresh if not torch.equal(fresh[k], model.state_dict()[k])]
        if name == "tiny_cnn":
            assert {"bn2.running_mean", "bn2.num_batches_tracked"} <= set(changed)
        else:
            assert model.lm_head.weight is model.wte.weight  # load_state_dict kept the tie
            assert torch.equal(state["wte.weight"], state["lm_head.weight"]) and "wte.weight" in changed
    assert "wrote" not in capsys.readouterr().out  # -q


def test_export_prints_what_it_wrote(folders, straight, tmp_path, capsys) -> None:
    assert cli.main(["export-checkpoint", str(straight[2]), str(tmp_path / "m.safetensors")]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'm.safetensors'}: 6 tensors of the model after step 2"


# ---------------------------------------------------------------------------- bad input


def one_line(err: str, pattern: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pipecc: error:"), err
    assert re.search(pattern, lines[0]), lines[0]


def tamper(step_dir: Path, edit) -> None:
    """Edit rank 0's files with ``edit(meta, tensors)`` and rewrite its sha256: what only the
    checks after the checksum can catch."""
    meta = json.loads((step_dir / "stage_0.json").read_text())
    tensors = load_file(step_dir / "stage_0.safetensors")
    edit(meta, tensors)
    (step_dir / "stage_0.json").write_text(json.dumps(meta))
    save_file(tensors, step_dir / "stage_0.safetensors")
    sums = {n: file_sha256(step_dir / n) for n in ("stage_0.safetensors", "stage_0.json")}
    (step_dir / "stage_0.sha256").write_text(json.dumps(sums))


def _rename(meta, tensors) -> None:
    meta["names"]["model.1.linear_4_weight"] = ["4.weight_renamed"]


def _extra(meta, tensors) -> None:
    tensors["model.1.extra"] = torch.zeros(3)
    meta["names"]["model.1.extra"] = ["extra.weight"]


def _no_names(meta, tensors) -> None:
    del meta["names"]


RESUME_CASES = [
    ("a checkpoint of another model", None, "other",
     r"another compiled folder and cannot be mapped onto this one: its 0\.bias is float32\[32\], this model's is "
     r"float32\[24\]: it is a checkpoint of another model"),
    ("a missing tensor", _rename, "four", r"onto this one: it has no tensor 4\.weight, which this model has"),
    ("an extra tensor", _extra, "four",
     r"onto this one: it holds a tensor extra\.weight, which this model does not have"),
    ("an older pipecc's files without names", _no_names, "four",
     r"another compiled folder and cannot be mapped onto this one: .*stage_0\.json records no tensor names"),
    ("a rank's files missing", lambda m, t: None, "four",
     r"has no stage_0\.safetensors \(rank 0 of 1\): .*--checkpoint-dir must be one folder all nodes share"),
    ("a flipped byte", lambda m, t: None, "four", r"stage_0\.safetensors does not match the sha256 written with it"),
]


@pytest.mark.parametrize("what, edit, into, message", RESUME_CASES, ids=[c[0] for c in RESUME_CASES])
def test_a_bad_replanned_resume_is_one_line_and_writes_nothing(folders, straight, tmp_path, capsys, what, edit, into,
                                                               message) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(straight[2], ckpt)
    step = ckpt / "step_2"
    if edit is not None:
        tamper(step, edit)
    if what == "a rank's files missing":
        (step / "stage_0.safetensors").unlink()
    if what == "a flipped byte":
        data = bytearray((step / "stage_0.safetensors").read_bytes())
        data[-1] ^= 1
        (step / "stage_0.safetensors").write_bytes(data)
    before = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*"))
    assert dist.main([str(folders[into]), "--steps", "4", "--schedule", "interleaved", "--checkpoint-dir", str(ckpt),
                      "--resume", *TRAIN]) == 1
    one_line(capsys.readouterr().err, message)
    assert sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if ".pipecc-run.lock" not in p.name) == \
        [p for p in before if ".pipecc-run.lock" not in p]


def test_bad_exports_are_one_line_and_leave_nothing(straight, tmp_path, capsys, monkeypatch) -> None:
    ckpt = straight[2]
    target = tmp_path / "m.safetensors"
    target.write_text("mine")
    assert cli.main(["export-checkpoint", str(ckpt), str(target)]) == 1
    one_line(capsys.readouterr().err, r"m\.safetensors exists; give --force to replace it")
    assert target.read_text() == "mine"
    assert cli.main(["export-checkpoint", str(ckpt), str(tmp_path / "no" / "m.safetensors")]) == 1
    one_line(capsys.readouterr().err, r"no is not a folder; create it first")
    assert cli.main(["export-checkpoint", str(tmp_path), str(tmp_path / "x.safetensors")]) == 1
    one_line(capsys.readouterr().err, r"holds no checkpoint \(no latest\.json\)")
    assert cli.main(["export-checkpoint", str(ckpt), str(tmp_path / "x.safetensors"), "--step", "7"]) == 1
    one_line(capsys.readouterr().err, r"holds no checkpoint of step 7 \(it holds step_2\)")
    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    (broken / "step_2" / "stage_0.json").write_text("{}")
    assert cli.main(["export-checkpoint", str(broken), str(tmp_path / "x.safetensors")]) == 1
    one_line(capsys.readouterr().err, r"stage_0\.json does not match the sha256")

    import safetensors.torch

    def disk_full(tensors, path, metadata=None):
        Path(path).write_bytes(b"half")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    assert cli.main(["export-checkpoint", str(ckpt), str(target), "--force"]) == 1
    one_line(capsys.readouterr().err, r"cannot write .*m\.safetensors \(No space left on device\); nothing was written")
    assert target.read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "m.safetensors"]


def test_bipartition_folders_resume_plain_checkpoints_and_back(tmp_path) -> None:
    """A Bi-Partition folder (cores + segments; the owners' tensors are the checkpoint's, the
    replicas refreshed after the load) resumes a plain folder's checkpoint of the same model,
    and the plain folder resumes the Bi-Partition one's; SGD, close to the plain run (the
    segments' backward runs on another worker: another summation order)."""
    from test_bipartition_run import _analysis, _bipartition

    analysis, plan, graph = _analysis(tmp_path)
    plain, bip = tmp_path / "plain", tmp_path / "bip"
    driver.compile(analysis, plan, graph, plain)
    driver.compile(analysis, _bipartition(plan), graph, bip)
    sgd = ("--optimizer", "sgd", "--lr", "0.5")

    def run(out: Path, ckpt: Path, steps: int, *extra: str) -> str:
        printed, errors = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
            code = dist.main([str(out), "--steps", str(steps), "--schedule", "interleaved", "--checkpoint-dir",
                              str(ckpt), *sgd, *extra])
        assert code == 0, errors.getvalue()
        return printed.getvalue()

    run(plain, tmp_path / "straight", 4)
    want = export(tmp_path / "straight", tmp_path / "straight.safetensors")
    for first, then in ((plain, bip), (bip, plain)):
        ckpt = tmp_path / f"{first.name}_then_{then.name}"
        run(first, ckpt, 2)
        assert "note: re-mapped from a plan of 3 stages" in run(then, ckpt, 4, "--resume")
        got = export(ckpt, tmp_path / f"{ckpt.name}.safetensors")
        assert got.keys() == want.keys()
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=k)


DROPOUT_MLP = '''
import torch
import torch.nn.functional as F
from torch import nn


def build_model(**_):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 32), nn.ReLU(),
                         nn.Dropout(0.5), nn.Linear(32, 5))


def example_inputs(batch_size=1, **_):
    return (torch.randn(batch_size, 16, generator=torch.Generator().manual_seed(1)),)


def example_target(batch_size=1, **_):
    return torch.randint(5, (batch_size,), generator=torch.Generator().manual_seed(2))


def loss_fn(outputs, target):
    return F.cross_entropy(outputs, target)
'''


def test_dropout_rng_follows_the_same_ranks_and_is_reseeded_otherwise(tmp_path) -> None:
    """With dropout: a folder whose ranks hold the same stages (here: the same cut, its stage.py
    edited, so another folder) takes each rank's RNG state, and the resumed run is bit-identical;
    a 3-stage folder re-seeds (the note says so) and its dropout masks, so its weights, differ."""
    model = tmp_path / "dropout_mlp.py"
    model.write_text(DROPOUT_MLP)
    outs = {}
    for name, devices in (("two", "2xcpu"), ("three", "3xcpu")):
        outs[name] = tmp_path / name
        assert cli.main(["compile", str(model), "-d", devices, "-b", "8", "-m", "2", "--replicas", "1",
                         "--split-layers", "off", "--use-all-devices", "-o", str(outs[name]), "-q"]) == 0
    edited = tmp_path / "edited"
    shutil.copytree(outs["two"], edited)
    stage = edited / "stage_1" / "stage.py"
    stage.write_text(stage.read_text() + "# edited: another folder, the same stages\n")
    rehash(edited)  # an edit alone is refused by hash: re-recorded, as a recompile would
    train(outs["two"], tmp_path / "straight", 4)
    want = export(tmp_path / "straight", tmp_path / "straight.safetensors")
    results = {}
    for name, into in (("same", edited), ("three", outs["three"])):
        ckpt = tmp_path / f"ckpt_{name}"
        train(outs["two"], ckpt, 2)
        results[name] = (train(into, ckpt, 4, "--resume"), export(ckpt, tmp_path / f"{name}.safetensors"))
    out, got = results["same"]
    assert "to this one of 2 stages on 1 rank, by the model's tensor names; RNG state of the same ranks" in out
    assert all(torch.equal(got[k], v) for k, v in want.items())
    out, got = results["three"]
    assert "RNG re-seeded from the step (dropout draws differ from an uninterrupted run)" in out
    assert not all(torch.equal(got[k], v) for k, v in want.items())
