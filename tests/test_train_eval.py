"""Stages follow train()/eval() (issue 19 item 1), and --verify compares like with like (issue 24 item 1).

torch.export writes `self.training` into its graphs as constants; pipecc captures both modes
(`pipecc.frontend.modes`) and stage modules read their own flag (`pipecc.ir.train_flag`), in the
drop-in module, in stage.py and through `pipecc.load`. `--verify` runs its checked step with
dropout off and random draws fixed in both runs (`pipecc.runtime.determinism`), so gradients are
always compared. Models: tests/data/train_eval_model.py (small, one per case) and
tests/data/hf_tiny.py (GPT-2 and BERT from their config classes, random weights). One torchrun
launch; the other runs are in process (`dist.main`, every stage in one process).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

import pipecc
from helpers import ROOT, pipecc_here, rehash
from pipecc import cli
from pipecc.runtime import dist
from pipecc.runtime.determinism import Deterministic

pytest.importorskip("transformers")

DATA = ROOT / "tests" / "data"
SMALL, HF = DATA / "train_eval_model.py", DATA / "hf_tiny.py"
VERDICT = re.compile(r"^verify: outputs, loss and (\d+) gradients match the single-process run(.*)$", re.MULTILINE)


def load(path: Path):
    import importlib.util
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compile_folder(model: Path, out: Path, *args: str, batch: int = 8) -> Path:
    argv = ["compile", str(model), "--devices", "2xcpu", "--replicas", "1", "--use-all-devices", "-o", str(out), "-b", str(batch),
            "-m", "2", "-q"]
    for arg in args:
        argv += ["--model-arg", arg] if "=" in arg else [arg]
    assert cli.main(argv) == 0
    return out


def verify_here(out: Path, monkeypatch, capsys, *extra: str) -> tuple[int, str, str]:
    """`pipecc run OUT --verify` with every stage in this process."""
    monkeypatch.delenv("RANK", raising=False)
    code = dist.main([str(out), "--steps", "1", "--verify", *extra])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ---------------------------------------------------------------------------- the drop-in and stage.py


@pytest.fixture(scope="module")
def small():
    return load(SMALL)


def test_export_stages_follow_train_and_eval(small) -> None:
    """An exported model with nn.Dropout, F.dropout(..., self.training) and BatchNorm: the
    pipeline in eval mode is the model in eval mode, in train mode it draws the model's masks
    (same seed, one micro-batch); compiled in eval mode, pipe.train() drops out again. Before
    the fix the stage code held `dropout.default(x, 0.3, True)`: eval mode still dropped out."""
    model = small.build_model(batchnorm=True)
    x = small.example_inputs(8)[0]
    pipe = pipecc.compile(model, (x,), "cpu,cpu", microbatches=1)
    assert pipe.training and all(s.training for s in pipe._pipecc_stages)
    code = "\n".join(s.code for s in pipe._pipecc_stages)
    assert "dropout.default" in code and "self.training" in code  # the export route, flag read
    pipe.eval()
    model.eval()
    torch.testing.assert_close(pipe(x), model(x))
    pipe.train()
    model.train()
    torch.manual_seed(3)
    got = pipe(x)
    torch.manual_seed(3)
    torch.testing.assert_close(got, model(x))

    model = small.build_model().eval()
    pipe = pipecc.compile(model, (x,), "cpu,cpu", microbatches=1)
    assert not pipe.training  # the stages start in the model's mode
    torch.testing.assert_close(pipe(x), model(x))
    pipe.train()
    model.train()
    torch.manual_seed(4)
    got = pipe(x)
    torch.manual_seed(4)
    torch.testing.assert_close(got, model(x))
    assert not torch.allclose(got, model.eval()(x))  # dropout is on again


def test_stage_files_and_load_follow_the_flag(small, tmp_path: Path) -> None:
    """stage.py reads self.training where export wrote True; `pipecc.load` follows eval()."""
    out = compile_folder(SMALL, tmp_path / "out")
    text = "".join((out / f"stage_{i}" / "stage.py").read_text() for i in range(2))
    assert "self.training" in text
    assert not re.search(r"dropout\.default\([^)]*, (True|False)\)", text), text
    pipe = pipecc.load(out).eval()
    model = small.build_model().eval()
    x = small.example_inputs(8)[0]
    torch.testing.assert_close(pipe(x), model(x))
    pipe.train()
    assert not torch.allclose(pipe(x), model(x))


class _BranchOnTraining(torch.nn.Module):
    """Other ops in train mode than in eval mode, and a branch torch.fx cannot trace."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 1:
            x = x + 0
        h = self.a(x)
        if self.training:
            h = torch.sigmoid(h)
        return self.b(h)


def test_a_forward_with_other_ops_per_mode_runs_its_own_mode_only() -> None:
    """No silent wrong mode: such stages refuse the other mode in one line that says why."""
    model, x = _BranchOnTraining(), torch.randn(4, 8)
    pipe = pipecc.compile(model, (x,), "cpu,cpu", microbatches=1)
    torch.testing.assert_close(pipe(x), model(x))
    pipe.eval()
    with pytest.raises(AssertionError, match=r"captured in train mode only \(train mode runs sigmoid"):
        pipe(x)


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_hf_dropin_equals_the_model(kind: str) -> None:
    """GPT2LMHeadModel and BertForSequenceClassification (torch.export): the drop-in's eval
    outputs are the model's, its train-mode gradients the model's with dropout off in both, and
    its train mode really drops out."""
    hf = load(HF)
    model = hf.build_model(kind=kind)
    ids, target = hf.example_inputs(4)[0], hf.example_target(4, kind=kind)
    pipe = pipecc.compile(model, (ids,), "cpu,cpu", microbatches=2)
    model.eval()
    pipe.eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe(ids)["logits"], model(ids).logits)
        eval_logits = model(ids).logits
    model.train()
    pipe.train()

    def grads(module) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with Deterministic() as mode:
            hf.loss_fn(module(ids), target).backward()
        assert "dropout" in mode.seen
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want, got = grads(model), grads(pipe)  # the drop-in shares the model's parameters
    assert got.keys() == want.keys() and len(got) > 20
    torch.testing.assert_close(got, want)
    with torch.no_grad():
        assert not torch.allclose(pipe(ids)["logits"], eval_logits)  # train mode: dropout on


# ---------------------------------------------------------------------------- pipecc run --verify


@pytest.fixture(scope="module")
def gpt_out(tmp_path_factory) -> Path:
    return compile_folder(HF, tmp_path_factory.mktemp("te") / "gpt", "kind=gpt2", batch=4)


def test_hf_gpt2_run_verify_torchrun(gpt_out: Path) -> None:
    """The README's path on an HF model: `pipecc run --verify` under torchrun, train mode."""
    result = pipecc_here("run", str(gpt_out), "--steps", "1", "--verify", "--timeout", "60")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    found = VERDICT.search(result.stdout)
    assert found and int(found.group(1)) > 20, result.stdout
    assert "dropout off in both runs" in found.group(2)


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_hf_inference_verify(kind: str, tmp_path: Path, monkeypatch, capsys) -> None:
    """Compiled with --inference from the model as built (train mode): eval-mode outputs match."""
    out = compile_folder(HF, tmp_path / kind, f"kind={kind}", "--inference", batch=4)
    code, stdout, err = verify_here(out, monkeypatch, capsys)
    assert code == 0, err
    assert "verify: outputs match the single-process run (forward only)" in stdout


def test_hf_bert_verify_in_process(tmp_path: Path, monkeypatch, capsys) -> None:
    out = compile_folder(HF, tmp_path / "bert", "kind=bert", batch=4)
    code, stdout, err = verify_here(out, monkeypatch, capsys, "--schedule", "interleaved")
    assert code == 0, err
    assert "dropout off in both runs" in VERDICT.search(stdout).group(2)


@pytest.mark.parametrize("args, says", [
    (["variant=dropout", "batchnorm=True"], "dropout off in both runs; BatchNorm over the same 2 micro-batches"),
    (["variant=noise"], "random draws (randn_like) at their means"),
    (["variant=unused"], "dropout off"),
    (["variant=nan"], "dropout off"),
    (["variant=bf16"], "dropout off"),
    (["--recompute", "full"], "dropout off"),  # recomputed in backward under the same mode
])
def test_verify_compares_gradients_without_false_alarms(args: list[str], says: str, tmp_path: Path,
                                                        monkeypatch, capsys) -> None:
    """Dropout, BatchNorm over micro-batches, randn_like noise, an unused layer, a NaN loss, a
    bfloat16 model, activation recomputation: gradients are compared and match, and the line says what was compared."""
    out = compile_folder(SMALL, tmp_path / "out", *args)
    code, stdout, err = verify_here(out, monkeypatch, capsys, "--schedule", "interleaved")
    assert code == 0, err
    found = VERDICT.search(stdout)
    assert found and int(found.group(1)) >= 6 and says in found.group(2), stdout


def test_verify_catches_wrong_gradients_under_dropout(tmp_path: Path, monkeypatch, capsys) -> None:
    """With dropout in the model: a planted bug in a stage file fails --verify on a gradient
    (before, dropout made verify compare eval outputs only), while torch.no_grad() inside
    forward, which fx traced through (wrong gradients), is now captured with torch.export as
    ops on detached inputs: --verify matches (issue 22, item 2)."""
    out = compile_folder(SMALL, tmp_path / "nograd", "variant=nograd")
    code, stdout, err = verify_here(out, monkeypatch, capsys, "--schedule", "interleaved")
    assert code == 0, err
    assert VERDICT.search(stdout), stdout

    out = compile_folder(SMALL, tmp_path / "ok")
    buggy = tmp_path / "buggy"
    shutil.copytree(out, buggy)
    last = buggy / "stage_1" / "stage.py"
    source, n = re.subn(r"return \((\w+),\)", r"return (\1 * 1.01,)", last.read_text())
    assert n == 1
    last.write_text(source)
    rehash(buggy)  # re-recorded: an edit alone is refused by hash before --verify (test_trust)
    code, _, err = verify_here(buggy, monkeypatch, capsys, "--schedule", "interleaved")
    assert code == 1
    assert re.search(r"verify: rank 0 stage \d gradient of \S+.* differs: ", err), err
