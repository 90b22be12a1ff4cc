"""In-place ops on a stage's received values (`backends.torch.inplace`): the stage works on a
copy of exactly the inputs it writes, in stage.py (`x = x.clone()`), in the drop-in module and
under recomputation, so a cut right before `x.relu_()` runs with the model's numerics; a write
to a received value that shares memory with another received value is refused at compile time.

Stages are cut by hand (plan node lists edited) so the cut lands where the write is.
"""
from __future__ import annotations

import copy
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import pipecc
from helpers import pipecc_here
from pipecc import driver
from pipecc.backends.torch.codegen import _kept_in_place
from pipecc.backends.torch.inplace import written_inputs
from pipecc.errors import PipeccError
from pipecc.frontend import fx_tracer

MODEL = '''
import torch
import torch.nn.functional as F
from torch import nn


class Mid(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = self.a(x)
        h = h.relu_()
        h = self.b(h)
        h.add_(1.0)
        return self.c(h) + h.sum(1, keepdim=True)


def build_model(**_):
    torch.manual_seed(0)
    return Mid()


def example_inputs(batch_size=1, **_):
    return (torch.randn(batch_size, 8, generator=torch.Generator().manual_seed(1)),)


def example_target(batch_size=1, **_):
    return torch.randint(4, (batch_size,), generator=torch.Generator().manual_seed(2))


def loss_fn(outputs, target):
    return F.cross_entropy(outputs, target)
'''

# the write reaches `a` through a view that also crosses the cut when the cut is after getitem
ALIAS = MODEL.replace('''        h = self.a(x)
        h = h.relu_()
        h = self.b(h)
        h.add_(1.0)
        return self.c(h) + h.sum(1, keepdim=True)''', '''        h = self.a(x)
        v = h[:, :8]
        v.mul_(2.0)
        h = self.b(h)
        return self.c(h)''')

# the model writes its own input: stage 0 works on a copy, the caller's tensor is left alone
SCALED = MODEL.replace("        h = self.a(x)\n", "        h = self.a(x.mul_(2.0))\n", 1)

BATCH = 4


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("inplace")
    out = {}
    for name, source in (("mid", MODEL), ("alias", ALIAS), ("scaled", SCALED)):
        out[name] = folder / f"{name}.py"
        out[name].write_text(source)
    return out


def load_file(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def hand_plan(analysis: Any, cuts: str, recompute: tuple[int, ...] = ()) -> tuple[Any, Any]:
    """A plan whose stages hold the node lists of `cuts` ("a/relu_,b,..."), in order."""
    groups = [g.split(",") for g in cuts.split("/")]
    plan, graph = driver.plan(analysis, ",".join(["cpu"] * len(groups)), batch_size=BATCH,
                              microbatches=2, schedule="1f1b", replicas=1, split_layers=False)
    for k, (stage, nodes) in enumerate(zip(plan.stages, groups)):
        stage.nodes, stage.recompute = nodes, k in recompute
    return plan, graph


def compile_folder(path: Path, out: Path, cuts: str, recompute: tuple[int, ...] = ()) -> Path:
    analysis = driver.analyze(path, batch_size=BATCH)
    plan, graph = hand_plan(analysis, cuts, recompute)
    plan.model_path = str(path)
    driver.compile(analysis, plan, graph, out)
    return out


def grads_of(module: nn.Module, params: dict[str, nn.Parameter], m: Any) -> tuple:
    for p in params.values():
        p.grad = None
    x = m.example_inputs(BATCH)
    out = module(*x)
    m.loss_fn(out, m.example_target(BATCH)).backward()
    return out.detach(), {n: p.grad.clone() for n, p in params.items()}


def assert_same(got: tuple, want: tuple) -> None:
    torch.testing.assert_close(got[0], want[0])
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], msg=name)


# ----------------------------------------------------------------------------- the analysis
class Two(nn.Module):
    def __init__(self, body: str, act: nn.Module | None = None) -> None:
        super().__init__()
        self.body, self.act = body, act or nn.Identity()

    def forward(self, x, y):
        return self.body(self, x, y)


WRITES = [  # forward body, positions of (x, y) written
    (lambda s, x, y: x.relu_() + y, [0]),
    (lambda s, x, y: x * y.add_(1.0), [1]),
    (lambda s, x, y: torch.relu_(x) + y, [0]),
    (lambda s, x, y: F.relu(y, inplace=True) + x, [1]),
    (lambda s, x, y: F.leaky_relu(x, 0.2, True) + y, [0]),
    (lambda s, x, y: torch.add(x, 1.0, out=y), [1]),
    (lambda s, x, y: x.view(-1).mul_(2.0).sum() + y, [0]),        # through a view
    (lambda s, x, y: x.transpose(0, 1).contiguous().sub_(1.0).t() + y, [0]),  # may be x itself
    (lambda s, x, y: (x * 2).relu_() + y, []),                     # a new tensor
    (lambda s, x, y: torch.relu(x) + y.clone().add_(1.0), []),
]


@pytest.mark.parametrize("body,want", WRITES, ids=[f"case{i}" for i in range(len(WRITES))])
def test_written_inputs_finds_each_kind_of_write(body: Any, want: list[int]) -> None:
    gm = fx_tracer.trace(Two(body))
    assert written_inputs(gm) == want, gm.graph
    x, y = torch.randn(3, 3), torch.randn(3, 3)
    gm(x.clone(), y.clone())  # the traced graph runs (the cases are real code)


def test_inplace_modules_count_unless_written_out_of_place() -> None:
    relu = fx_tracer.trace(Two(lambda s, x, y: s.act(x) + y, nn.ReLU(inplace=True)))
    hardtanh = fx_tracer.trace(Two(lambda s, x, y: s.act(x) + y, nn.Hardtanh(inplace=True)))
    plain = fx_tracer.trace(Two(lambda s, x, y: s.act(x) + y, nn.ReLU()))
    assert written_inputs(relu) == [0] and written_inputs(plain) == []  # the GraphModule's view
    assert written_inputs(relu, _kept_in_place) == []       # stage.py: F.relu, out of place
    assert written_inputs(hardtanh, _kept_in_place) == [0]  # kept whole, in place


def test_setitem_and_in_place_operators_are_writes() -> None:
    """`x[i] = v` and `x += 1` (fx cannot trace them; torch.export-captured graphs may hold them)."""
    import operator
    g = fx.Graph()
    x, y, z = g.placeholder("x"), g.placeholder("y"), g.placeholder("z")
    g.call_function(operator.setitem, (g.call_method("view", (x, -1)), 0, 0.0))
    g.call_function(operator.iadd, (y, 1.0))
    g.output((x, y, g.call_function(operator.add, (z, 1.0))))
    assert written_inputs(fx.GraphModule(nn.Module(), g)) == [0, 1]


def test_aten_ops_follow_their_schema() -> None:
    """torch.export graphs: `Tensor(a!)` arguments are written, unannotated returns are new."""
    aten = torch.ops.aten
    g = fx.Graph()
    x, y, z = g.placeholder("x"), g.placeholder("y"), g.placeholder("z")
    g.call_function(aten.relu_.default, (g.call_function(aten.view.default, (x, [-1])),))
    g.call_function(aten.add_.Tensor, (g.call_function(aten.mul.Tensor, (y, y)), 1.0))
    g.call_function(aten.add.out, (y, y), {"out": z})
    g.output((x,))
    assert written_inputs(fx.GraphModule(nn.Module(), g)) == [0, 2]


# ----------------------------------------------------------------------------- stage.py
def test_stage_py_clones_exactly_the_written_inputs(files: dict[str, Path], tmp_path: Path) -> None:
    out = compile_folder(files["mid"], tmp_path / "out", "a/relu_,b,add_,c,sum,add")
    first = (out / "stage_0" / "stage.py").read_text()
    second = (out / "stage_1" / "stage.py").read_text()
    assert ".clone()" not in first
    body = second.split("def forward(self, a: torch.Tensor) -> tuple:\n")[1].splitlines()
    assert body[0] == "        a = a.clone()  # mutated in place below: the received tensor is a leaf"
    assert second.count(".clone()") == 1  # b is written too, but b is computed here


@pytest.mark.parametrize("cuts", ["a/relu_,b,add_,c,sum,add", "a,relu_,b/add_,c/sum,add"])
def test_loaded_stage_files_match_the_model(files: dict[str, Path], tmp_path: Path, cuts: str) -> None:
    """pipecc.load runs the generated stage.py files: the written value relayed on (b, from
    stage 1 to stage 2 in the second cut) carries the write, as in the model."""
    m = load_file(files["mid"])
    out = compile_folder(files["mid"], tmp_path / "out", cuts)
    model, pm = m.build_model(), pipecc.load(out)
    want = grads_of(model, dict(model.named_parameters()), m)
    assert_same(grads_of(pm, dict(pm.named_parameters()), m), want)


def test_a_written_model_input_is_copied(files: dict[str, Path], tmp_path: Path) -> None:
    m = load_file(files["scaled"])
    out = compile_folder(files["scaled"], tmp_path / "out", "mul_,a,relu_/b,add_,c,sum,add")
    source = (out / "stage_0" / "stage.py").read_text()
    assert "x = x.clone()  # mutated in place below: the caller's input stays as it is" in source
    x = m.example_inputs(BATCH)[0]
    got = pipecc.load(out)(x)
    torch.testing.assert_close(x, m.example_inputs(BATCH)[0])  # not doubled
    torch.testing.assert_close(got, m.build_model()(x.clone()))


# ----------------------------------------------------------------------------- drop-in
@pytest.mark.parametrize("recompute", [(), (0, 1), (0, 1, 2)])
def test_dropin_matches_the_model(files: dict[str, Path], recompute: tuple[int, ...]) -> None:
    """With recomputation the checkpointed stage re-runs from its inputs: without the copy it
    would re-run from the written input (autograd: 'modified by an inplace operation')."""
    m = load_file(files["mid"])
    model = m.build_model()
    reference = copy.deepcopy(model)
    cuts = "a/relu_,b,add_,c,sum,add" if len(recompute) < 3 else "a/relu_,b/add_,c,sum,add"
    plan, graph = hand_plan(driver.analyze_module(model, m.example_inputs(BATCH)), cuts, recompute)
    pm = driver.compile_module(model, graph, plan, m.example_inputs(BATCH))
    want = grads_of(reference, dict(reference.named_parameters()), m)
    assert_same(grads_of(pm, dict(model.named_parameters()), m), want)


# ----------------------------------------------------------------------------- refused
def test_write_to_a_value_sharing_memory_with_another_port_is_refused(files: dict[str, Path],
                                                                      tmp_path: Path) -> None:
    analysis = driver.analyze(files["alias"], batch_size=BATCH)
    plan, graph = hand_plan(analysis, "a,getitem/mul_,b,c")
    with pytest.raises(PipeccError, match=r"stage 1 writes 'getitem' in place \('mul_'\), but 'a'"):
        driver.compile(analysis, plan, graph, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_write_through_a_view_in_one_stage_matches_the_model(files: dict[str, Path],
                                                             tmp_path: Path) -> None:
    m = load_file(files["alias"])
    out = compile_folder(files["alias"], tmp_path / "out", "a/getitem,mul_,b,c")
    assert "a = a.clone()  # mutated in place below" in (out / "stage_1" / "stage.py").read_text()
    model, pm = m.build_model(), pipecc.load(out)
    want = grads_of(model, dict(model.named_parameters()), m)
    assert_same(grads_of(pm, dict(pm.named_parameters()), m), want)


# ----------------------------------------------------------------------------- torchrun
@pytest.mark.slow  # a torchrun launch of several processes (make test-fast leaves it out)
def test_run_verify_with_a_cut_before_an_inplace_op(files: dict[str, Path], tmp_path: Path) -> None:
    """The bug: rank 1 raised 'a leaf Variable that requires grad is being used in an in-place
    operation'. Stage 1 starts with relu_ on its received `a` and runs under recomputation;
    stage 2 starts with add_ on its received `b`."""
    out = compile_folder(files["mid"], tmp_path / "out", "a/relu_,b/add_,c,sum,add", recompute=(1,))
    result = pipecc_here("run", str(out), "--steps", "1", "--verify", "--timeout", "60")
    assert result.returncode == 0, result.stderr
    assert "verify: outputs, loss and 6 gradients match the single-process run" in result.stdout


# ----------------------------------------------------------------------------- interop
def test_torch_pipelining_stages_copy_written_inputs(files: dict[str, Path]) -> None:
    """pipecc.interop hands torch.distributed.pipelining the stage modules: a stage that writes
    its received value in place runs on a copy there too (world 1, both stages on this rank)."""
    import torch.distributed as dist

    from pipecc.interop import pipeline_stages, torch_schedule
    m = load_file(files["mid"])
    model = m.build_model()
    reference = copy.deepcopy(model)
    plan, graph = hand_plan(driver.analyze_module(model, m.example_inputs(BATCH)), "a/relu_,b,add_,c,sum,add")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        stages = pipeline_stages(plan, graph, 0, "cpu", world=1)
        losses: list[torch.Tensor] = []
        torch_schedule(plan, stages, m.loss_fn, schedule="interleaved").step(
            *m.example_inputs(BATCH), target=m.example_target(BATCH), losses=losses)
    finally:
        dist.destroy_process_group()
    want = grads_of(reference, dict(reference.named_parameters()), m)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[1][name], msg=name)
