"""How micro-batch losses combine (`pipecc.runtime.loss_reduction`; issue 33, "training that is
silently wrong without --verify"): the model file's loss_fn is analysed at compile; a sum trains
on the sum of the micro-batch losses, a mean on their weighted mean, and a loss that mixes
samples (a max, softmax or std over the batch) runs only on the whole batch, a split refused in
one line at compile and at run. Runs are in-process (one rank holds both stages)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers import run_cli
from pipecc import cli
from pipecc.runtime import dist
from pipecc.runtime.loss_reduction import MEAN, MIXED, SUM, LossReduction, analyse, weight

ROOT = Path(__file__).resolve().parents[1]
MLP = (ROOT / "models" / "mlp.py").read_text()
DEFAULT_LOSS = "return F.cross_entropy(outputs, target)"
TINY = ["--model-arg", "in_features=16", "--model-arg", "hidden=32", "--model-arg", "depth=3",
        "--model-arg", "num_classes=5"]

LOSSES = {  # the return line of loss_fn -> the kind the analysis must find
    "cross_entropy": ("F.cross_entropy(outputs, target)", MEAN),
    "cross_entropy sum": ('F.cross_entropy(outputs, target, reduction="sum")', SUM),
    "sum over a fixed count": ('F.cross_entropy(outputs, target, reduction="sum") / 8', SUM),
    "mse plus a mean penalty": ("F.mse_loss(outputs, F.one_hot(target, outputs.shape[1]).float())"
                                " + 0.1 * outputs.pow(2).mean()", MEAN),
    "max over the batch": ('F.cross_entropy(outputs, target, reduction="none").max()', MIXED),
    "softmax over the batch": ('(F.softmax(F.cross_entropy(outputs, target, reduction="none"), 0) * '
                               'F.cross_entropy(outputs, target, reduction="none")).sum()', MIXED),
    "std over the batch": ("outputs.std(0).mean()", MIXED),
    "a count of the batch": ('F.cross_entropy(outputs, target, reduction="sum") / outputs.shape[0] ** 2', MIXED),
}


def model_file(folder: Path, loss: str) -> Path:
    path = folder / "m.py"
    path.write_text(MLP.replace(DEFAULT_LOSS, f"return {loss}"))
    return path


@pytest.mark.parametrize("name", list(LOSSES))
def test_the_analysis_finds_how_a_loss_combines(name):
    body, kind = LOSSES[name]
    loss_fn = eval(f"lambda outputs, target: {body}", {"F": F})  # noqa: S307 (the table's own text)
    got = analyse(loss_fn, torch.empty(8, 5), torch.randint(5, (8,)), 8)
    assert got.kind == kind, got


def test_outputs_as_a_dict_and_a_one_sample_batch():
    def loss_fn(out, tgt):
        return F.cross_entropy(out["logits"], tgt["y"], reduction="sum")
    assert analyse(loss_fn, {"logits": torch.empty(6, 3)}, {"y": torch.zeros(6, dtype=torch.long)}, 6).kind == SUM
    assert analyse(loss_fn, {"logits": torch.empty(1, 3)}, {"y": torch.zeros(1, dtype=torch.long)}, 1).kind == MEAN


def test_the_analysis_leaves_the_global_rng_as_it_was():
    state = torch.random.get_rng_state()
    analyse(lambda o, t: o.mean() + torch.rand(()) * 0, torch.empty(4, 2), torch.zeros(4), 4)
    assert torch.equal(state, torch.random.get_rng_state())


def test_the_weights_runners_use():
    assert weight(MEAN, 2, 8) == 0.25 and weight(SUM, 2, 8) == 1.0
    assert weight(LossReduction(SUM), 3, 8) == 1.0
    with pytest.raises(ValueError):
        weight(MIXED, 1, 2)
    assert LossReduction.from_json(None).kind == MEAN  # a folder from before the analysis
    assert LossReduction.from_json({"kind": "sum"}).kind == SUM


def compile_model(path: Path, out: Path, *flags: str) -> int:
    return cli.main(["compile", str(path), "-d", "2xcpu", "-b", "8", "-q", "-o", str(out), *TINY, *flags])


@pytest.mark.parametrize("name", ["cross_entropy sum", "sum over a fixed count", "cross_entropy"])
def test_a_sum_or_mean_loss_trains_as_the_model_over_four_micro_batches(name, tmp_path):
    """--verify compares the pipeline's loss and gradients with the model's on the whole batch;
    before the analysis a sum loss trained on a quarter of the gradients here."""
    body, kind = LOSSES[name]
    out = tmp_path / "out"
    assert compile_model(model_file(tmp_path, body), out, "-m", "4", "--replicas", "1") == 0
    assert json.loads((out / "pipecc.json").read_text())["loss_reduction"]["kind"] == kind
    assert dist.main([str(out), "--steps", "1", "--schedule", "interleaved", "--verify"]) == 0


def test_a_loss_that_mixes_samples_is_refused_split_and_runs_whole(tmp_path, capsys):
    path = model_file(tmp_path, LOSSES["max over the batch"][0])
    code, out, err = run_cli(["compile", str(path), "-d", "2xcpu", "-b", "8", "-o", str(tmp_path / "o"), *TINY,
                              "-m", "4", "--replicas", "1"], capsys)
    assert code == 1 and err.count("\n") == 1 and "neither a mean nor a sum" in err, err
    assert "--microbatches 1 --replicas 1" in err and not (tmp_path / "o").exists()
    out_dir = tmp_path / "whole"
    assert compile_model(path, out_dir, "-m", "1", "--replicas", "1") == 0
    code, out, err = run_cli(["run", str(out_dir), "-m", "2", "--steps", "1"], capsys)
    assert code == 1 and err.count("\n") == 1 and "losses of 2 micro-batches do not combine" in err, err
    assert dist.main([str(out_dir), "--steps", "1", "--schedule", "interleaved", "--verify"]) == 0


# ---------------------------------------------------------------------------- targets that weigh
# cross_entropy's mean is over the targets it counts: ignore_index entries (and class weights)
# make each micro-batch's share depend on its targets, not on its sample count
IGNORED = """
def example_target(batch_size=1, num_classes=10, **_):
    g = torch.Generator().manual_seed(SEED + 1)
    t = torch.randint(num_classes, (batch_size,), generator=g)
    t[:{ignored}] = -100  # the first micro-batches' targets mostly ignored (padding)
    return t
"""


def weighted_model_file(folder: Path, loss: str, ignored: int) -> Path:
    path = folder / "m.py"
    text = MLP.replace(DEFAULT_LOSS, f"return {loss}")
    head, rest = text.split("def example_target", 1)
    rest = rest.split("\ndef loss_fn", 1)[1]
    path.write_text(head + IGNORED.format(ignored=ignored).lstrip() + "\n\ndef loss_fn" + rest)
    return path


@pytest.mark.parametrize("loss,ignored", [("F.cross_entropy(outputs, target)", 3),
                                          ("F.cross_entropy(outputs, target)", 2),  # micro-batch 0 all ignored
                                          ("F.cross_entropy(outputs, target.clamp(min=0), weight=torch.tensor("
                                           "[1.0, 5.0, 0.2, 3.0, 0.5]))", 0)])
def test_targets_that_weigh_micro_batches_train_as_the_model(loss, ignored, tmp_path, capsys):
    """Before: micro-batch losses weighted by sample count (2 of 8 each), while the batch's mean
    counts only the targets not ignored (or weighs them by class): other gradients, no error."""
    out = tmp_path / "out"
    assert compile_model(weighted_model_file(tmp_path, loss, ignored), out, "-m", "4", "--replicas", "1") == 0
    assert json.loads((out / "pipecc.json").read_text())["loss_reduction"]["kind"] == MEAN
    capsys.readouterr()
    assert dist.main([str(out), "--steps", "1", "--schedule", "interleaved", "--verify"]) == 0
    assert "verify: outputs, loss and" in capsys.readouterr().out


def test_step_factors_are_the_counted_targets_shares():
    from pipecc.errors import PipeccError
    from pipecc.runtime.loss_reduction import step_factors

    def loss_fn(o, t):
        return F.cross_entropy(o, t)
    targets = [torch.tensor([-100, -100, 1]), torch.tensor([0, 2, 1]), torch.tensor([-100, -100, -100])]
    got = step_factors(loss_fn, torch.empty(3, 4), 1, targets, [3, 3, 3], MEAN)
    assert got is not None and [round(w, 9) for w in got] == [0.25, 0.75, 0.0]
    plain = [torch.tensor([0, 1, 2]), torch.tensor([3, 0, 1])]
    assert step_factors(loss_fn, torch.empty(3, 4), 0, plain, [3, 3], MEAN) is None  # n_i / n holds
    with pytest.raises(PipeccError, match="give --replicas 1"):
        step_factors(loss_fn, torch.empty(3, 4), 0, targets, [3, 3, 3], MEAN, replicas=2)
    # a loss that is a mean on the example but mixes samples on this step's targets: refused
    with pytest.raises(PipeccError, match="not a weighted mean or sum"):
        step_factors(lambda o, t: (o.softmax(0)[:, 0] * t.float()).sum(), torch.empty(3, 4), 0,
                     [torch.tensor([1, 2, 3]), torch.tensor([1, 0, 0])], [3, 3], MEAN)


@pytest.mark.parametrize("given", ["sum", "ignored"])
def test_a_loss_given_to_load_is_weighed_by_each_step(given, tmp_path, monkeypatch):
    """pipecc.distributed.load(out, loss_fn=...) took any loss for a per-sample mean (a sum
    trained on a quarter of the gradients at 4 micro-batches); each step's factors now follow it."""
    import pipecc.distributed
    from pipecc.models import mlp
    monkeypatch.delenv("RANK", raising=False)
    out = tmp_path / "out"
    assert compile_model(model_file(tmp_path, "F.cross_entropy(outputs, target)"), out, "-m", "4",
                         "--replicas", "1") == 0

    def loss_fn(outputs, target):
        return F.cross_entropy(outputs, target, reduction="sum" if given == "sum" else "mean")
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(6))
    # ignored: micro-batch 2 wholly (its own loss is 0/0), the others in part
    y = torch.tensor([-100, 3, -100, 1, -100, -100, 4, 0]) if given == "ignored" else torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])
    pipe = pipecc.distributed.load(str(out), loss_fn=loss_fn)
    try:
        model = mlp.build_model(in_features=16, hidden=32, depth=3, num_classes=5)
        model.load_state_dict(pipe.full_state_dict())
        loss = pipe.step(x, target=y)
        want = loss_fn(model(x), y)
        want.backward()
        torch.testing.assert_close(torch.tensor(loss), want.detach())
        grads = dict(model.named_parameters())
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(p.grad, grads[name].grad, msg=name)
    finally:
        pipe.close()


def test_ignored_targets_in_the_data_not_the_example_train_as_the_model(tmp_path, monkeypatch):
    """The silent case: the example target ignores nothing (the analysis finds a plain mean), the
    data does, unevenly. pipecc.distributed in one process against the model on the whole batch."""
    import importlib.util

    import pipecc.distributed
    monkeypatch.delenv("RANK", raising=False)
    path = model_file(tmp_path, "F.cross_entropy(outputs, target)")
    out = tmp_path / "out"
    assert compile_model(path, out, "-m", "4", "--replicas", "1") == 0
    spec = importlib.util.spec_from_file_location("m_ignored", path)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(5))
    y = torch.tensor([-100, -100, -100, 1, 2, -100, 4, 0])
    pipe = pipecc.distributed.load(str(out))
    try:
        model = m.build_model(in_features=16, hidden=32, depth=3, num_classes=5)
        model.load_state_dict(pipe.full_state_dict())
        loss = pipe.step(x, target=y)
        want = F.cross_entropy(model(x), y)
        want.backward()
        torch.testing.assert_close(torch.tensor(loss), want.detach())
        grads = dict(model.named_parameters())
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(p.grad, grads[name].grad, msg=name)
    finally:
        pipe.close()


@pytest.mark.slow  # a torchrun launch
def test_replicas_whose_targets_weigh_differently_train_as_the_model(tmp_path):
    """Two replicas, one micro-batch each (data parallel): replica 0's targets mostly ignored.
    Each replica alone sees one micro-batch, so only every replica's targets together give the
    factors (gathered once per step); before, each replica's loss counted half."""
    from helpers import pipecc_here
    out = tmp_path / "out"
    assert compile_model(weighted_model_file(tmp_path, "F.cross_entropy(outputs, target)", 3), out,
                         "-m", "1", "--replicas", "2") == 0
    result = pipecc_here("run", str(out), "--steps", "1", "--verify", "--timeout", "60")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "verify: outputs, loss and" in result.stdout, result.stdout[-2000:]
