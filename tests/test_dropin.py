"""The drop-in PipelinedModule (CONTRACT §7): the model's outputs, loss and gradients on the
original parameters, its state_dict keys, train/eval, and an optimizer built before wrapping.

BatchNorm: micro-batches normalise with their own statistics in train mode, so models with
BatchNorm are compared in eval mode whenever m > 1 (and in train mode with m = 1); `pipecc.compile`
warns about it (or refuses, with strict_batchnorm), and the tests below hold it to what it says.
Composite torch.nn modules (nn.TransformerEncoderLayer, ...) compile and match the model.
"""
from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import pipecc
from helpers import ZOO
from pipecc import cli, driver
from pipecc.backends.torch import compile as torch_compile
from pipecc.backends.torch.compile import pipelined_module
from pipecc.backends.torch.stages import cut_stages
from pipecc.errors import PipeccError
from pipecc.runtime.local import PipelinedModule, load
from test_codegen import between_shards, make_plan, split_graph
from test_torch_stages import (analysed, one_thread, random_stage_of, stage_of_at,  # noqa: F401
                               stage_of_fractions, tiny)

BATCH = 4


def has_batch_norm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def batch(name: str) -> tuple[tuple, Any, Any]:
    zoo, _, _ = tiny(name)
    return zoo.example_inputs(BATCH, **zoo.TINY), zoo.example_target(BATCH, **zoo.TINY), zoo.loss_fn


def outputs_and_grads(module: nn.Module, params: dict[str, nn.Parameter], inputs: tuple,
                      loss_fn: Any, target: Any) -> tuple[Any, torch.Tensor, dict[str, torch.Tensor]]:
    for p in params.values():
        p.grad = None
    out = module(*inputs)
    loss = loss_fn(out, target)
    loss.backward()
    return out, loss.detach(), {n: p.grad.clone() for n, p in params.items() if p.grad is not None}


def assert_same(got: tuple, want: tuple) -> None:
    (out, loss, grads), (out_ref, loss_ref, grads_ref) = got, want
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
    assert grads.keys() == grads_ref.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-4, atol=1e-5, msg=name)


# ----------------------------------------------------------------------------- the zoo
@pytest.mark.parametrize("num_stages", [2, 3, 4])
@pytest.mark.parametrize("name", ZOO)
def test_dropin_matches_the_model(name: str, num_stages: int) -> None:
    model, _, graph = analysed(name)
    inputs, target, loss_fn = batch(name)
    params = dict(model.named_parameters())
    stages = cut_stages(graph, random_stage_of(graph, num_stages, seed=10 + num_stages))
    bn = has_batch_norm(model)
    try:
        for m in (1, 2, 4):
            pm = pipelined_module(model, stages, microbatches=m)
            mode = not bn or m == 1
            model.train(mode)
            pm.train(mode)
            want = outputs_and_grads(model, params, inputs, loss_fn, target)
            assert_same(outputs_and_grads(pm, params, inputs, loss_fn, target), want)
    finally:
        model.train()


@pytest.mark.parametrize("name", ZOO)
def test_optimizer_built_before_wrapping_trains_the_same(name: str) -> None:
    _, model, _ = tiny(name)
    reference = copy.deepcopy(model)
    inputs, target, loss_fn = batch(name)
    if has_batch_norm(model):
        model.eval()
        reference.eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    graph = driver.analyze_module(model, tiny(name)[2], model_name=name)
    pm = pipelined_module(model, cut_stages(graph, random_stage_of(graph, 2, 3)), microbatches=2)
    for _ in range(2):
        for module, optimizer in ((pm, opt), (reference, opt_ref)):
            optimizer.zero_grad()
            loss_fn(module(*inputs), target).backward()
            optimizer.step()
    for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=n)


def test_names_parameters_and_modes() -> None:
    model, _, graph = analysed("resnet50")
    pm = pipelined_module(model, cut_stages(graph, random_stage_of(graph, 3, 0)), microbatches=2)
    assert list(pm.state_dict()) == list(model.state_dict())
    assert [id(p) for p in pm.parameters()] == [id(p) for p in model.parameters()]
    assert [n for n, _ in pm.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert [n for n, _ in pm.named_buffers()] == [n for n, _ in model.named_buffers()]
    try:
        pm.eval()
        assert not any(m.training for m in model.modules())
        assert not any(s.training for s in pm.pipeline_info()["stages"])
        pm.train()
        assert all(m.training for m in model.modules())
    finally:
        model.train()
    pm.load_state_dict(model.state_dict())  # round-trips through the same names


def test_inputs_by_keyword_and_errors() -> None:
    model, _, graph = analysed("mlp")
    pm = pipelined_module(model, cut_stages(graph, stage_of_fractions(graph, [0.5])), microbatches=2)
    (x,), _, _ = batch("mlp")
    torch.testing.assert_close(pm(input=x), model(x))
    with pytest.raises(TypeError, match="missing input"):
        pm()
    with pytest.raises(TypeError, match="takes 1 inputs"):
        pm(x, x)


# ----------------------------------------------------------------------------- split layers, ties
@pytest.mark.parametrize("name,splits,cut_after", [
    ("mlp", [("2", [16, 16], 0), ("4", [20, 12], 1)], ["2.shard0", "4.shard0"]),
    ("gpt", [("wte", [50, 51], 0), ("lm_head", [60, 41], 0)], ["wte.shard0", "lm_head.shard0"]),
])
def test_dropin_with_split_layers(name: str, splits: list, cut_after: list[str], tmp_path: Path) -> None:
    model, _, graph = split_graph(name, splits)
    inputs, target, loss_fn = batch(name)
    params = dict(model.named_parameters())
    stages = cut_stages(graph, stage_of_at(graph, between_shards(graph, *cut_after)))
    want = outputs_and_grads(model, params, inputs, loss_fn, target)
    pm = pipelined_module(model, stages, microbatches=2)
    assert_same(outputs_and_grads(pm, params, inputs, loss_fn, target), want)
    # compiled and loaded: the shards are put back together under the original names
    out = torch_compile.write_output(tmp_path / "out", graph, make_plan(stages, name), stages)
    loaded = load(out)
    assert set(loaded.state_dict()) == set(model.state_dict())
    assert_same(outputs_and_grads(loaded, dict(loaded.named_parameters()), inputs, loss_fn, target), want)


def test_tied_weights_share_one_tensor(tmp_path: Path) -> None:
    _, model, example = tiny("gpt", tie_weights=True)
    graph = driver.analyze_module(model, example, model_name="gpt")
    stages = cut_stages(graph, stage_of_fractions(graph, [0.5]))
    assert "wte.weight" in stages[0].tied and "wte.weight" in stages[1].tied
    inputs, target, loss_fn = batch("gpt")
    params = dict(model.named_parameters())
    want = outputs_and_grads(model, params, inputs, loss_fn, target)
    assert_same(outputs_and_grads(pipelined_module(model, stages, microbatches=2), params, inputs,
                                  loss_fn, target), want)
    loaded = load(torch_compile.write_output(tmp_path / "out", graph, make_plan(stages, "gpt"), stages))
    assert set(loaded.state_dict()) == set(model.state_dict())  # lm_head.weight too
    assert loaded.state_dict()["lm_head.weight"].data_ptr() == loaded.state_dict()["wte.weight"].data_ptr()
    assert_same(outputs_and_grads(loaded, dict(loaded.named_parameters()), inputs, loss_fn, target), want)


# ----------------------------------------------------------------------------- pipecc.load
@pytest.mark.parametrize("name", ["gnmt", "bert", "tiny_cnn"])
def test_load_compiled_folder(name: str, tmp_path: Path) -> None:
    model, _, graph = analysed(name)
    stages = cut_stages(graph, random_stage_of(graph, 3, 1))
    out = torch_compile.write_output(tmp_path / "out", graph, make_plan(stages, name), stages)
    pm = load(out, microbatches=1)
    assert isinstance(pm, PipelinedModule) and set(pm.state_dict()) == set(model.state_dict())
    inputs, target, loss_fn = batch(name)
    params = dict(model.named_parameters())
    want = outputs_and_grads(model, params, inputs, loss_fn, target)
    assert_same(outputs_and_grads(pm, dict(pm.named_parameters()), inputs, loss_fn, target), want)
    pm.double()  # converted buffers stay shared between the stages and state_dict()
    held = {id(t) for t in pm.state_dict(keep_vars=True).values()}
    for stage in pm.pipeline_info()["stages"]:
        assert {id(t) for t in [*stage.parameters(), *stage.buffers()]} <= held
        assert all(t.dtype == torch.float64 for t in stage.parameters())
    with pytest.raises(PipeccError, match="not a folder written by"):
        load(tmp_path)


# ----------------------------------------------------------------------------- devices
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_stages_on_two_devices() -> None:
    _, model, example = tiny("gpt")
    graph = driver.analyze_module(model, example, model_name="gpt")
    inputs, target, loss_fn = batch("gpt")
    params = dict(model.named_parameters())
    want = outputs_and_grads(model, params, inputs, loss_fn, target)
    pm = pipelined_module(model, cut_stages(graph, stage_of_fractions(graph, [0.5])),
                          microbatches=2, devices=["cpu", "cuda:0"])
    out, loss, grads = outputs_and_grads(pm, params, inputs, loss_fn, target.cuda())
    assert out.device.type == "cuda"
    assert_same((out.cpu(), loss.cpu(), {n: g.cpu() for n, g in grads.items()}), want)


def test_a_tied_weight_on_two_devices_is_refused() -> None:
    _, model, example = tiny("gpt", tie_weights=True)
    graph = driver.analyze_module(model, example, model_name="gpt")
    with pytest.raises(PipeccError, match="tied weight"):
        pipelined_module(model, cut_stages(graph, stage_of_fractions(graph, [0.5])),
                         devices=["cpu", "meta"])


def test_runtime_does_not_import_the_compiler() -> None:
    import subprocess
    import sys
    code = ("import sys, pipecc.runtime.local; "
            "print(sorted(m for m in sys.modules if m.startswith(('sympy', 'pipecc.backends', 'pipecc.passes'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


# ----------------------------------------------------------------------------- BatchNorm, composites
def test_batchnorm_with_microbatches_warns_and_is_what_the_warning_says() -> None:
    """Issue #14 item 3: per-micro-batch statistics in train mode, stated as such at compile
    time; microbatches=1 is exact and says nothing; strict_batchnorm refuses."""
    _, model, _ = tiny("tiny_cnn")
    reference = copy.deepcopy(model)
    inputs, _, _ = batch("tiny_cnn")
    with pytest.warns(UserWarning, match=r"normalises each of the 2 micro-batches with its own "
                                         r"statistics.*microbatches=1 gives equal outputs"):
        pm = pipecc.compile(model, inputs, "cpu,cpu", microbatches=2)
    (x,) = inputs
    halves = torch.cat([reference(x[:BATCH // 2]), reference(x[BATCH // 2:])])
    torch.testing.assert_close(pm(x), halves, rtol=1e-5, atol=1e-5)  # per micro-batch, as warned
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exact = pipecc.compile(model, inputs, "cpu,cpu", microbatches=1)
    reference.load_state_dict(model.state_dict())
    torch.testing.assert_close(exact(x), reference(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(PipeccError, match="strict_batchnorm: BatchNorm .* micro-batches"):
        pipecc.compile(model, inputs, "cpu,cpu", microbatches=2, strict_batchnorm=True)


def test_batchnorm_warning_in_compile_output(tmp_path: Path, capsys) -> None:
    from helpers import ROOT
    argv = ["compile", str(ROOT / "models" / "tiny_cnn.py"), "--devices", "2xcpu", "-b", "4",
            "-m", "2", "-o", str(tmp_path / "out")]
    assert cli.main(argv + ["-q"]) == 0  # a warning reaches stderr even with -q
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("pipecc: warning:")]
    assert len(notes) == 1 and "own statistics" in notes[0], notes
    assert cli.main(argv + ["-q", "--force", "--strict-batchnorm"]) == 1
    assert "strict_batchnorm" in capsys.readouterr().err


def transformer_models() -> list[tuple[str, nn.Module, tuple]]:
    """Composite torch.nn modules that fx keeps whole unless told otherwise (dropout 0: the
    train-mode comparison must not depend on random masks)."""
    torch.manual_seed(0)
    x = torch.randn(BATCH, 6, 16)

    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.out = nn.Linear(16, 32), nn.Linear(32, 4)
            self.dec = nn.TransformerDecoderLayer(32, 4, 64, dropout=0.0, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.inp(x)
            return self.out(self.dec(h, h))

    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    return [
        ("encoder_layer", nn.Sequential(nn.Linear(16, 32), layer, nn.Linear(32, 4)), (x,)),
        ("encoder_layer_gelu_norm_first", nn.Sequential(
            nn.Linear(16, 32), nn.TransformerEncoderLayer(32, 4, 64, 0.0, "gelu", batch_first=True,
                                                         norm_first=True),
            nn.Linear(32, 4)), (x,)),
        ("encoder", nn.Sequential(nn.Linear(16, 32), nn.TransformerEncoder(
            copy.deepcopy(layer), 2, enable_nested_tensor=False), nn.Linear(32, 4)), (x,)),
        ("decoder_layer", Decoder(), (x,)),
    ]


@pytest.mark.parametrize("index", range(4), ids=[n for n, _, _ in transformer_models()])
def test_transformer_modules_compile_and_match(index: int) -> None:
    """Issue #14 item 8: traced into, not rebuilt from attributes; forward and gradients equal
    the model's in train and eval mode, and the fused fast path's (eval without grad)."""
    _, model, inputs = transformer_models()[index]
    graph = driver.analyze_module(model, inputs)
    assert graph.source == "fx" and not graph.warnings
    assert not any(node.meta["pipecc.op"].startswith("module:") for node in graph.gm.graph.nodes)
    pm = pipecc.compile(model, inputs, "cpu,cpu", microbatches=2)
    params = dict(model.named_parameters())
    loss = lambda out, _: out.square().mean()  # noqa: E731
    for mode in (True, False):
        model.train(mode)
        pm.train(mode)
        assert_same(outputs_and_grads(pm, params, inputs, loss, None),
                    outputs_and_grads(model, params, inputs, loss, None))
    with torch.no_grad():  # eval without grad: the model takes torch's fused fast path
        torch.testing.assert_close(pm(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)
