"""Whether a step's targets can weigh its micro-batches, read from a trace of loss_fn
(`pipecc.runtime.loss_targets`; issue 31: the per-step probe cost 26-57x the loss it weighs).
The quick answers are checked against the probe they replace, and a pipeline trained over
several steps whose ignored targets move is checked against the model on the whole batch."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pipecc.runtime import loss_reduction, loss_targets
from pipecc.runtime.loss_reduction import MEAN, step_factors

V = 7
W = torch.tensor([1.0, 5.0, 0.2, 3.0, 0.5, 2.0, 1.5])


def ce(o, t):
    return F.cross_entropy(o.reshape(-1, V), t.reshape(-1))


LOSSES = {  # name -> (loss_fn of logits (n, 5, V) and class targets (n, 5), what the trace must find)
    "cross_entropy": (ce, loss_targets.COUNTED),
    "class weights": (lambda o, t: torch.nn.CrossEntropyLoss(weight=W)(o.reshape(-1, V), t.reshape(-1)),
                      loss_targets.COUNTED),
    "shifted targets": (lambda o, t: F.cross_entropy(o[:, :-1].reshape(-1, V), t[:, 1:].reshape(-1)),
                        loss_targets.COUNTED),
    "padded like transformers": (lambda o, t: F.cross_entropy(
        o.reshape(-1, V), F.pad(t, (0, 1), value=-100)[:, 1:].reshape(-1)), loss_targets.COUNTED),
    "scaled": (lambda o, t: 2 * ce(o, t) / 3, loss_targets.COUNTED),
    "class dim 1": (lambda o, t: F.cross_entropy(o.transpose(1, 2), t), loss_targets.COUNTED),
    "plus a penalty": (lambda o, t: ce(o, t) + 0.1 * o.pow(2).mean(), loss_targets.GUARDED),
    "sum": (lambda o, t: F.cross_entropy(o.reshape(-1, V), t.reshape(-1), reduction="sum"), loss_targets.FIXED),
    "gathered by hand": (lambda o, t: -o.log_softmax(-1).gather(-1, t.clamp(min=0)[..., None]).mean(),
                         loss_targets.FIXED),
    "mse": (lambda o, t: F.mse_loss(o.sum(-1), t.float()), loss_targets.FIXED),
    "label smoothing": (lambda o, t: F.cross_entropy(o.reshape(-1, V), t.reshape(-1), label_smoothing=0.1),
                        loss_targets.PROBE),
    "masked mean": (lambda o, t: ((o.sum(-1) - 1) ** 2 * (t > 2)).sum() / (t > 2).sum(), loss_targets.PROBE),
    "divisor through the outputs": (lambda o, t: (o.sum(-1) * (t > 2)).sum() / (o.sum(-1) * 0 + (t > 2)).sum(),
                                    loss_targets.PROBE),
    "a branch on the targets": (lambda o, t: o.sum() if bool((t == -100).any()) else ce(o, t), loss_targets.PROBE),
}


def targets(seed: int, n: int = 3, m: int = 3) -> list[torch.Tensor]:
    """m micro-batches of n samples of 5 class targets, ignored entries spread unevenly."""
    g = torch.Generator().manual_seed(seed)
    ts = [torch.randint(0, V, (n, 5), generator=g) for _ in range(m)]
    ts[1][0, : 1 + seed % 4] = -100
    ts[-1][-1, seed % 5] = -100
    return ts


@pytest.mark.parametrize("name", list(LOSSES))
def test_the_trace_finds_how_targets_reach_the_loss(name):
    loss_fn, kind = LOSSES[name]
    step = loss_targets.step_of(loss_fn, torch.randn(3, 5, V), 0, targets(0), [3, 3, 3])
    assert step.kind == kind, step.why
    assert (step.why != "") == (kind == loss_targets.PROBE)


@pytest.mark.parametrize("name", [n for n, (_, k) in LOSSES.items() if k in (loss_targets.COUNTED,
                                                                               loss_targets.FIXED)])
def test_quick_factors_are_the_probes(name):
    """Counted: A_i / A from the replayed targets; fixed: the sample shares. Both as the probe
    finds them on random outputs, on three steps whose ignored targets differ."""
    loss_fn, kind = LOSSES[name]
    value = torch.randn(3, 5, V)
    for seed in range(3):
        ts = targets(seed)
        step = loss_targets.step_of(loss_fn, value, 0, ts, [3, 3, 3])
        quick = step.quick(ts, [3, 3, 3])
        probed = loss_reduction._factors(loss_fn, value, 0, ts, [3, 3, 3])
        want = [1 / 3] * 3 if quick is None and name != "sum" else quick
        if name == "sum":
            assert quick is None and probed == pytest.approx([1.0] * 3)
        elif name == "gathered by hand":  # a mean over every element: the sample shares
            assert quick is None and probed == pytest.approx(want)
        else:
            assert isinstance(quick, list) == (kind == loss_targets.COUNTED)
            assert probed == pytest.approx(want, rel=1e-6), (quick, probed)


def test_the_probe_runs_once_per_shape_then_the_quick_answer(monkeypatch):
    calls = []
    real = loss_reduction._factors

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(loss_reduction, "_factors", counted)

    def loss_fn(o, t):  # a fresh function: nothing cached for it
        return F.cross_entropy(o.reshape(-1, V), t.reshape(-1))
    value = torch.randn(3, 5, V)
    got = [step_factors(loss_fn, value, 0, targets(seed), [3, 3, 3], MEAN) for seed in range(4)]
    assert len(calls) == 1  # the first step's probe confirmed the count; the others are counted
    for seed, factors in enumerate(got):
        assert factors == pytest.approx(real(loss_fn, value, 0, targets(seed), [3, 3, 3]), rel=1e-9)
    plain = [torch.randint(0, V, (3, 5), generator=torch.Generator().manual_seed(9)) for _ in range(3)]
    assert step_factors(loss_fn, value, 0, plain, [3, 3, 3], MEAN) is None  # no ignored target: n_i / n
    # another shape (unequal micro-batches: each size traced on its own) is probed once again
    uneven = targets(5)[:2] + [targets(5)[2][:2]]
    assert step_factors(loss_fn, value, 0, uneven, [3, 3, 2], MEAN) == pytest.approx(
        real(loss_fn, value, 0, uneven, [3, 3, 2]), rel=1e-9)
    assert len(calls) == 2


def test_a_guarded_loss_is_probed_only_on_steps_with_ignored_targets(monkeypatch):
    calls = []
    real = loss_reduction._factors
    monkeypatch.setattr(loss_reduction, "_factors", lambda *a, **k: calls.append(1) or real(*a, **k))

    def loss_fn(o, t):
        return F.cross_entropy(o.reshape(-1, V), t.reshape(-1)) + 0.1 * o.pow(2).mean()
    value = torch.randn(3, 5, V)
    plain = [[torch.randint(0, V, (3, 5), generator=torch.Generator().manual_seed(s)) for _ in range(3)]
             for s in range(3)]
    assert [step_factors(loss_fn, value, 0, ts, [3, 3, 3], MEAN) for ts in plain] == [None] * 3
    assert len(calls) == 1
    from pipecc.errors import PipeccError
    with pytest.raises(PipeccError, match="not a weighted mean or sum"):  # two means weighed differently
        step_factors(loss_fn, value, 0, targets(1), [3, 3, 3], MEAN)
    assert len(calls) == 2


def test_a_wrong_reading_sends_the_shape_to_the_probe_for_good(monkeypatch):
    """The first step's probe checks the trace: a loss it reads as fixed that mixes samples is
    refused there, and a disagreement leaves the shape to the probe."""
    from pipecc.errors import PipeccError

    def mixing(o, t):
        return (o.softmax(0)[:, 0].sum(-1) * t[:, 0].float()).sum()
    value = torch.randn(3, 5, V)
    assert loss_targets.step_of(mixing, value, 0, targets(0), [3, 3, 3]).kind == loss_targets.FIXED
    with pytest.raises(PipeccError, match="not a weighted mean or sum"):
        step_factors(mixing, value, 0, targets(0), [3, 3, 3], MEAN)

    def weighs(o, t):
        return ce(o, t)
    step = loss_targets.step_of(weighs, value, 0, targets(0), [3, 3, 3])
    step.kind = loss_targets.FIXED  # a reading the probe disagrees with on this step
    assert step_factors(weighs, value, 0, targets(0), [3, 3, 3], MEAN) is not None
    assert step.kind == loss_targets.PROBE and not step.settled


def test_the_trace_leaves_the_targets_and_rng_as_they_were():
    ts = targets(2)
    before = [t.clone() for t in ts]
    value = torch.randn(3, 5, V)
    state = torch.random.get_rng_state()

    def in_place(o, t):
        return F.cross_entropy(o.reshape(-1, V), t.reshape(-1).masked_fill_(t.reshape(-1) == 6, -100))
    assert loss_targets.step_of(in_place, value, 0, ts, [3, 3, 3]).kind == loss_targets.PROBE
    step = loss_targets.step_of(LOSSES["padded like transformers"][0], value, 0, ts, [3, 3, 3])
    step.quick(ts, [3, 3, 3])
    assert all(torch.equal(a, b) for a, b in zip(ts, before))
    assert torch.equal(torch.random.get_rng_state(), state)


def test_moving_ignored_targets_train_as_the_model_over_steps(tmp_path, monkeypatch):
    """pipecc.distributed in one process, four steps whose ignored targets differ (one step with
    a micro-batch wholly ignored): each step's loss and gradients are the model's on the whole
    batch, and the probe ran once."""
    import pipecc.distributed
    from pipecc.models import mlp
    from test_loss_reduction import compile_model, model_file
    monkeypatch.delenv("RANK", raising=False)
    calls = []
    real = loss_reduction._factors
    monkeypatch.setattr(loss_reduction, "_factors", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = tmp_path / "out"
    assert compile_model(model_file(tmp_path, "F.cross_entropy(outputs, target)"), out, "-m", "4",
                         "--replicas", "1") == 0
    pipe = pipecc.distributed.load(str(out))
    model = mlp.build_model(in_features=16, hidden=32, depth=3, num_classes=5)
    model.load_state_dict(pipe.full_state_dict())
    g = torch.Generator().manual_seed(11)
    try:
        for step in range(4):
            x = torch.randn(8, 16, generator=g)
            y = torch.randint(0, 5, (8,), generator=g)
            y[torch.randperm(8, generator=g)[: 1 + step]] = -100
            if step == 2:
                y[2:4] = -100  # micro-batch 1 wholly ignored
            for p in list(pipe.parameters()) + list(model.parameters()):
                p.grad = None
            loss = pipe.step(x, target=y)
            want = F.cross_entropy(model(x), y)
            want.backward()
            torch.testing.assert_close(torch.tensor(loss), want.detach())
            grads = dict(model.named_parameters())
            for name, p in pipe.named_parameters():
                torch.testing.assert_close(p.grad, grads[name].grad, msg=f"step {step}: {name}")
    finally:
        pipe.close()
    assert len(calls) == 1


def test_loss_targets_is_documented():
    text = (Path(__file__).resolve().parents[1] / "docs" / "model-files.md").read_text()
    assert "loss_targets" in text and "probe" in text
