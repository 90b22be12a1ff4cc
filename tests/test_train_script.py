"""Train for real: a user's training script drives a compiled folder under torchrun through
`pipecc.distributed` (the README's example), and `pipecc run` draws a new batch every step from
the model file's `train_data`. The pipelined losses equal a one-process run of the original model
from the same weights, data order and optimizer at every step, and the loss falls."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from helpers import ROOT, pipecc_here

pytestmark = pytest.mark.xdist_group("train_script")

MODEL = textwrap.dedent('''
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    def build_model(width=48, depth=4, **_):
        torch.manual_seed(0)  # the same starting weights in every compile: how far the loss falls is fixed
        layers = [nn.Linear(16, width), nn.ReLU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(width, 10))

    def example_inputs(batch_size=1, **_):
        return (torch.randn(batch_size, 16),)

    def example_target(batch_size=1, **_):
        return torch.randint(0, 10, (batch_size,))

    def loss_fn(outputs, target):
        return F.cross_entropy(outputs, target)

    def dataset(n, seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, 16, generator=g)
        return TensorDataset(x, x[:, :10].argmax(1))   # a learnable rule: the largest of the first 10

    def train_data(batch_size, **_):
        return DataLoader(dataset(BATCHES * batch_size, 0), batch_size=batch_size, shuffle=True, drop_last=True)

    def val_data(batch_size, **_):
        return DataLoader(dataset(4 * batch_size, 1), batch_size=batch_size, drop_last=True)

    BATCHES = 10
''')

# the README's training example, with the losses written out for the test
SCRIPT = textwrap.dedent('''
    import json, sys
    import torch
    import pipecc
    from torch.utils.data import DataLoader

    out, steps, accumulate, precision, record = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    sys.path.insert(0, sys.argv[6])
    import model as m

    torch.manual_seed(0)
    pipe = pipecc.distributed.load(out, precision=None if precision == "folder" else precision)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    loader = DataLoader(m.dataset(4096, 0), batch_size=pipe.batch_size, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(0))
    if pipe.rank == 0:
        torch.save(pipe.full_state_dict(), record + ".weights.pt")
    else:
        pipe.full_state_dict()
    losses, batches = [], iter(loader)
    for step in range(steps):
        for _ in range(accumulate):
            x, y = next(batches)
            losses.append(pipe.step(x, target=y))
        pipe.clip_grad_norm_(1.0)
        opt.step(); sched.step(); opt.zero_grad()
    with open(f"{record}.rank{pipe.rank}.json", "w") as f:
        json.dump(losses, f)
    pipe.eval()  # a validation forward: the outputs on one rank (the last stage's, replica 0's)
    x, _ = next(iter(DataLoader(m.dataset(pipe.batch_size, 5), batch_size=pipe.batch_size)))
    outputs, state = pipe(x), pipe.full_state_dict()
    if outputs is not None:
        torch.save({"x": x, "outputs": outputs, "state": state, "rank": pipe.rank}, record + ".forward.pt")
    pipe.close()
    # nothing of gloo may outlive close() (pipecc.runtime.teardown); the script then exits as any does
    from pipecc.runtime.teardown import backend_threads
    with open(f"{record}.rank{pipe.rank}.threads.json", "w") as f:
        json.dump(backend_threads(), f)
''')


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"train_model_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compile(tmp: Path, name: str, *argv: str) -> Path:
    out = tmp / name
    result = pipecc_here("compile", str(tmp / "model.py"), "-b", "32", "--replicas", "1", "--use-all-devices",
                         "-o", str(out), "-q", *argv)  # in this process: only run launches
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("train")
    (tmp / "model.py").write_text(MODEL)
    (tmp / "train.py").write_text(SCRIPT)
    return tmp


def _torchrun(work: Path, out: Path, ranks: int, steps: int, accumulate: int = 1, precision: str = "fp32",
              record: str = "rec") -> list[list[float]]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
           str(work / "train.py"), str(out), str(steps), str(accumulate), precision, str(work / record), str(work)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    for r in range(ranks):  # close() ended gloo's threads on every rank (None: no /proc here)
        assert json.loads((work / f"{record}.rank{r}.threads.json").read_text()) in ([], None), r
    return [json.loads((work / f"{record}.rank{r}.json").read_text()) for r in range(ranks)]


def _reference(work: Path, record: str, steps: int, accumulate: int = 1, precision: str = "fp32",
               depth: int = 4) -> list[float]:
    """The original model in one process: same weights, loader, optimizer, schedule and clipping."""
    m = _load(work / "model.py")
    model = m.build_model(depth=depth)
    model.load_state_dict(torch.load(work / f"{record}.weights.pt"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    loader = torch.utils.data.DataLoader(m.dataset(4096, 0), batch_size=32, shuffle=True, drop_last=True,
                                         generator=torch.Generator().manual_seed(0))
    losses, batches = [], iter(loader)
    for _ in range(steps):
        for _ in range(accumulate):
            x, y = next(batches)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                loss = m.loss_fn(model(x), y)
            loss.backward()
            losses.append(float(loss.detach()))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(); sched.step(); opt.zero_grad()
    return losses


def _forward_is_the_models(work: Path, record: str, rank: int, depth: int = 4) -> None:
    """The script's validation forward, on the rank that returned outputs, is the trained model's."""
    saved = torch.load(work / f"{record}.forward.pt")
    assert saved["rank"] == rank
    model = _load(work / "model.py").build_model(depth=depth)
    model.load_state_dict(saved["state"])
    model.eval()
    torch.testing.assert_close(saved["outputs"], model(saved["x"]))


def _falls(losses: list[float]) -> None:
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < first - 0.1, (first, last)


def test_readme_script_on_two_ranks_equals_one_process(work, one_thread):
    """1F1B over 2 gloo ranks, 60 steps: every step's loss equals the one-process run's (float32),
    on every rank, and falls."""
    out = _compile(work, "two", "--devices", "2xcpu", "-m", "4", "--schedule", "1f1b")
    got = _torchrun(work, out, 2, 60, record="two")
    assert got[0] == got[1]  # the loss on every rank
    want = _reference(work, "two", 60)
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(want), rtol=1e-4, atol=1e-5)
    _falls(got[0])
    _forward_is_the_models(work, "two", rank=1)


def test_replicated_stages_train_and_forward_as_the_model(work, one_thread):
    """Two replicas of one stage (data parallel over 2 gloo ranks): the losses are the one-process
    run's, and a validation forward gathers both replicas' rows on replica 0, in the batch's order."""
    out = _compile(work, "replicas", "--devices", "2xcpu", "-m", "2", "--replicas", "2")
    assert json.loads((out / "pipecc.json").read_text())["replicas"] == 2
    got = _torchrun(work, out, 2, 12, record="replicas")
    assert got[0] == got[1]
    want = _reference(work, "replicas", 12)
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(want), rtol=1e-4, atol=1e-5)
    _forward_is_the_models(work, "replicas", rank=0)


def test_three_ranks_zero_bubble_with_accumulation_equals_one_process(work, one_thread):
    """Zero-bubble (zb-h1) over 3 ranks, two batches accumulated per optimizer step, 40 steps."""
    out = _compile(work, "three", "--devices", "3xcpu", "-m", "4", "--schedule", "zb-h1",
                   "--model-arg", "depth=6")
    plan = json.loads((out / "pipecc.json").read_text())
    assert plan["schedule"] == "zb-h1" and len(list(out.glob("stage_*"))) == 3
    got = _torchrun(work, out, 3, 40, accumulate=2, record="three")
    assert got[0] == got[1] == got[2]
    want = _reference(work, "three", 40, accumulate=2, depth=6)
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(want), rtol=1e-4, atol=1e-5)
    _falls(got[0])


def test_bf16_on_two_ranks_follows_the_one_process_autocast_run(work):
    """bf16 autocast, messages in bf16: within bfloat16's tolerance of the one-process autocast run."""
    out = _compile(work, "two-bf16", "--devices", "2xcpu", "-m", "4", "--schedule", "1f1b", "--precision", "bf16")
    got = _torchrun(work, out, 2, 10, precision="folder", record="bf16")  # the folder's: declared at compile
    want = _reference(work, "bf16", 10, precision="bf16")
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(want), rtol=2e-2, atol=1e-2)


NO_CLOSE = textwrap.dedent('''
    import atexit, json, sys
    import torch
    import torch.distributed as dist
    from pipecc.runtime.teardown import backend_threads

    out, record = sys.argv[1], sys.argv[2]
    def report():  # registered first, so it runs after pipecc's own exit handler
        with open(f"{record}.rank{rank}.exit.json", "w") as f:
            json.dump({"joined": dist.is_initialized(), "threads": backend_threads()}, f)
    atexit.register(report)
    import pipecc
    pipe = pipecc.distributed.load(out)
    rank = pipe.rank
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    x, y = torch.randn(32, 16), torch.randint(0, 10, (32,))
    for _ in range(2):
        pipe.step(x, target=y)
        opt.step(); opt.zero_grad()
    # no pipe.close(): the script just ends
''')


@pytest.mark.slow  # a torchrun launch
def test_a_script_that_never_closes_leaves_at_exit(work):
    """Without close() every rank still leaves the process group at interpreter exit, with no
    gloo thread left running, and exits 0 (pipecc.runtime.teardown.leave_at_exit)."""
    out = work / "replicas"  # pipecc's own replica groups must end too
    if not out.exists():
        out = _compile(work, "replicas", "--devices", "2xcpu", "-m", "2", "--replicas", "2")
    (work / "no_close.py").write_text(NO_CLOSE)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(work / "no_close.py"), str(out), str(work / "noclose")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    for r in range(2):
        seen = json.loads((work / f"noclose.rank{r}.exit.json").read_text())
        assert not seen["joined"] and seen["threads"] in ([], None), (r, seen)


# ----------------------------------------------------------------------------- one process


def test_one_process_pipeline_is_the_model(work):
    """Without torchrun the object runs every stage in this process: outputs, loss, names,
    gradient norm, accumulation and state dicts are the original model's."""
    import pipecc

    out = work / "two"
    if not out.exists():
        out = _compile(work, "two", "--devices", "2xcpu", "-m", "4", "--schedule", "1f1b")
    m = _load(work / "model.py")
    pipe = pipecc.distributed.load(out)
    assert pipe.rank == 0 and pipe.world_size == 1 and pipe.stages == [0, 1] and pipe.batch_size == 32
    model = m.build_model()
    model.load_state_dict(pipe.full_state_dict())
    assert sorted(n for n, _ in pipe.named_parameters()) == sorted(n for n, _ in model.named_parameters())
    x, y = next(iter(m.train_data(32)))
    pipe.eval()
    model.eval()
    torch.testing.assert_close(pipe(x), model(x))
    assert pipe.evaluate(x, target=y) == pytest.approx(float(m.loss_fn(model(x), y).detach()), rel=1e-5)
    pipe.train()
    model.train()
    loss = pipe.step(x, target=y)
    pipe.step(x, target=y)  # accumulates, as a second backward does
    ref = m.loss_fn(model(x), y)
    (2 * ref).backward()
    assert loss == pytest.approx(float(ref.detach()), rel=1e-5)
    grads = {n: p.grad for n, p in pipe.named_parameters()}
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6)
    norm = pipe.clip_grad_norm_(0.5)
    assert norm == pytest.approx(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)), rel=1e-4)
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6)
    # state dicts: this rank's under the model's names; a model state dict loads back
    before = {k: v.clone() for k, v in pipe.state_dict().items()}
    assert set(before) == set(model.state_dict())
    zeros = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    pipe.load_state_dict(zeros)
    assert all(float(v.abs().sum()) == 0 for v in pipe.state_dict().values())
    pipe.load_state_dict(before)
    with pytest.raises(pipecc.errors.PipeccError, match="no tensor for"):
        pipe.load_state_dict({})


def test_a_loss_fn_given_to_load_is_analysed_like_the_model_files(work):
    """A summed loss adds the micro-batches' losses (not their weighted mean); one that mixes
    samples (a max over the batch) is refused in one line rather than trained on wrong gradients."""
    import pipecc
    import torch.nn.functional as F
    from pipecc.errors import PipeccError

    out = work / "two"
    if not out.exists():
        out = _compile(work, "two", "--devices", "2xcpu", "-m", "4", "--schedule", "1f1b")
    m = _load(work / "model.py")
    x, y = next(iter(m.train_data(32)))
    summed = lambda outputs, target: F.cross_entropy(outputs, target, reduction="sum")  # noqa: E731
    pipe = pipecc.distributed.load(out, loss_fn=summed)
    model = m.build_model()
    model.load_state_dict(pipe.full_state_dict())
    loss = pipe.step(x, target=y)
    ref = summed(model(x), y)
    ref.backward()
    assert loss == pytest.approx(float(ref.detach()), rel=1e-5)
    grads = {n: p.grad for n, p in pipe.named_parameters()}
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-5)
    pipe.eval()
    assert pipe.evaluate(x, target=y) == pytest.approx(float(summed(model(x), y).detach()), rel=1e-5)
    worst = lambda outputs, target: F.cross_entropy(outputs, target, reduction="none").max()  # noqa: E731
    with pytest.raises(PipeccError, match="micro-batch") as caught:
        pipecc.distributed.load(out, loss_fn=worst).step(x, target=y)
    assert "\n" not in str(caught.value)


def test_api_bad_inputs_are_one_line_errors(work, tmp_path):
    import pipecc
    from pipecc.errors import PipeccError, UsageError

    out = work / "two"
    if not out.exists():
        out = _compile(work, "two", "--devices", "2xcpu", "-m", "4", "--schedule", "1f1b")
    with pytest.raises(PipeccError, match="is not a folder"):
        pipecc.distributed.load(tmp_path / "nothing")
    with pytest.raises(UsageError, match="precision='fp8'"):
        pipecc.distributed.load(out, precision="fp8")
    with pytest.raises(UsageError, match="loss_fn must be callable"):
        pipecc.distributed.load(out, loss_fn=3)
    pipe = pipecc.distributed.load(out)
    with pytest.raises(PipeccError, match="has 31 rows, the folder was compiled for batches of 32.*drop_last"):
        pipe.step(torch.randn(31, 16), target=torch.zeros(31, dtype=torch.long))
    with pytest.raises(PipeccError, match="pass target="):
        pipe.step(torch.randn(32, 16))
    with pytest.raises(UsageError, match="max_norm"):
        pipe.clip_grad_norm_(-1.0)


# ----------------------------------------------------------------------------- pipecc run


def _history(stdout: str) -> list[float]:
    return [h["loss"] for h in json.loads(stdout)["history"]]


def test_pipecc_run_draws_train_data_and_equals_one_process(work):
    """`pipecc run --epochs 2` draws a new batch every step from train_data (in the order
    pipecc.runtime.batches defines: the same on every rank), and its losses equal the original
    model trained in one process on the same batches."""
    from pipecc.runtime.batches import Batches

    out = work / "two"
    if not out.exists():
        out = _compile(work, "two", "--devices", "2xcpu", "-m", "4", "--schedule", "1f1b")
    result = pipecc_here("run", str(out), "--epochs", "3", "--optimizer", "adamw", "--lr", "1e-2",
                         "--clip-grad-norm", "1.0", "--json", "--eval-every", "10")
    assert result.returncode == 0, result.stderr
    got = _history(result.stdout)
    m = _load(work / "model.py")
    assert len(got) == 3 * m.BATCHES
    assert "eval after step 9: val loss" in result.stderr
    import pipecc
    model = m.build_model()
    model.load_state_dict(pipecc.distributed.load(out).full_state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stream = Batches(m, "model.py", "train_data", 32, {}, True, 0, epochs=3)
    want = []
    for step in range(len(got)):
        x, y = stream.next(step)
        loss = m.loss_fn(model(*x), y)
        loss.backward()
        want.append(float(loss.detach()))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-5)
    assert sum(got[-5:]) < sum(got[:5])


BAD_DATA = {
    "short batch at step 3": ("def train_data(batch_size, **_):\n"
                              "    for i in range(6):\n"
                              "        n = batch_size - 1 if i == 3 else batch_size\n"
                              "        yield torch.randn(n, 16), torch.zeros(n, dtype=torch.long)\n",
                              r"step 3: train_data in model\.py: (input '\w+'|target) has 31 rows, the folder was compiled for "
                              r"batches of 32"),
    "raises at step 3": ("def train_data(batch_size, **_):\n"
                         "    for i in range(6):\n"
                         "        if i == 3:\n"
                         "            raise ValueError('disk gone')\n"
                         "        yield torch.randn(batch_size, 16), torch.zeros(batch_size, dtype=torch.long)\n",
                         r"step 3: train_data in model\.py raised ValueError: disk gone"),
    "not a pair at step 3": ("def train_data(batch_size, **_):\n"
                             "    for i in range(6):\n"
                             "        x = torch.randn(batch_size, 16)\n"
                             "        yield x if i == 3 else (x, torch.zeros(batch_size, dtype=torch.long))\n",
                             r"step 3: train_data in model\.py must yield \(inputs, target\) pairs, got a Tensor"),
}


@pytest.mark.parametrize("case", sorted(BAD_DATA))
def test_bad_train_data_is_one_line_naming_the_step_and_keeps_checkpoints(work, tmp_path, case):
    body, message = BAD_DATA[case]
    (tmp_path / "model.py").write_text(MODEL + "\n" + body)
    out = tmp_path / "out"
    result = pipecc_here("compile", str(tmp_path / "model.py"), "-b", "32", "--devices", "2xcpu", "--replicas", "1",
                         "--use-all-devices", "-m", "2", "-o", str(out), "-q")
    assert result.returncode == 0, result.stderr
    ckpt = tmp_path / "ckpt"
    result = pipecc_here("run", str(out), "--steps", "6", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2")
    assert result.returncode == 1
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("pipecc: error:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    import re
    assert re.search(message, lines[0]), lines[0]
    assert json.loads((ckpt / "latest.json").read_text())["step"] == 2  # the last good checkpoint, intact


def test_run_data_usage_errors(work, tmp_path):
    out = work / "two"
    if not out.exists():
        out = _compile(work, "two", "--devices", "2xcpu", "-m", "4", "--schedule", "1f1b")
    result = pipecc_here("run", str(out), "--steps", "3", "--epochs", "1")
    assert result.returncode == 2 and "give --steps N or --epochs E, not both" in result.stderr
    # a model file without train_data: --epochs is refused, and a plain run says it repeats one batch
    (tmp_path / "plain.py").write_text(MODEL.split("def dataset")[0])
    plain = tmp_path / "plain"
    assert pipecc_here("compile", str(tmp_path / "plain.py"), "-b", "32", "--devices", "2xcpu", "--replicas", "1",
                       "--use-all-devices", "-m", "2", "-o", str(plain), "-q").returncode == 0
    result = pipecc_here("run", str(plain), "--epochs", "1")
    assert result.returncode == 1 and "--epochs counts passes over train_data" in result.stderr
    result = pipecc_here("run", str(plain), "--steps", "2")
    assert result.returncode == 0 and "every step repeats its example batch" in result.stdout


def test_the_readme_training_script_runs_as_written(tmp_path, monkeypatch):
    """The README's train.py, copied as it is, under torchrun on 2 CPU processes next to the
    README's model file compiled into `out`: it trains and the loss falls."""
    import re

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    model = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    script = re.search(r"```python\n(# train\.py.*?)```", readme, re.S).group(1)
    (tmp_path / "mymodel.py").write_text(model)
    (tmp_path / "train.py").write_text(script)
    monkeypatch.chdir(tmp_path)  # the README's command, from the folder of its files, in this process
    result = pipecc_here("compile", "mymodel.py", "-b", "32", "--devices", "2xcpu", "--replicas", "1",
                         "--use-all-devices", "-o", "out", "-q")
    assert result.returncode == 0, result.stderr
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [float(v) for v in re.findall(r"^step \d+: loss (\S+)$", result.stdout, re.MULTILINE)]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.3, result.stdout
