"""Library functions kept as one node (`torch.fx.wrap`, as torchvision's `stochastic_depth` and
Swin's attention are): stage files import them by module path, the model file's own through
the hashed model file, what no import reaches is refused in one line; and their cost is what
they run (FlopCounterMode on fake tensors), not a guess.

The library is tests/data/wrapped_lib (on sys.path here, on PYTHONPATH for the CLI), the model
tests/data/wrapped_funcs.py, which also wraps a function of its own (`centre`)."""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.fx as fx

from helpers import PIPECC, ROOT, reference_flops
from pipecc import cost, driver
from pipecc.backends.torch import render
from pipecc.errors import PipeccError
from pipecc.frontend import torch_capture as frontend
from pipecc.frontend.modelfile import load_model_file
from pipecc.ir.graph import AnnotatedGraph

DATA = ROOT / "tests" / "data"
MODEL = DATA / "wrapped_funcs.py"


@pytest.fixture(autouse=True)
def _library_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(DATA))


def _pipecc(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(DATA), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([*PIPECC, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _imports(source: str) -> list[str]:
    tree = ast.parse(source)
    return [ast.unparse(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]


def _same_as_model(pm: torch.nn.Module, spec, train: bool) -> None:
    """pm's outputs and gradients equal the model's (train or eval mode)."""
    model = spec.model
    model.train(train)
    pm.train(train)
    x = spec.make_inputs(4)
    target = spec.make_target(4)
    model.zero_grad(set_to_none=True)
    expected = model(*x)
    spec.loss_fn(expected, target).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    pm.zero_grad(set_to_none=True)
    out = pm(*x)
    torch.testing.assert_close(out, expected)
    spec.loss_fn(out, target).backward()
    for name, p in pm.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], msg=name)


def test_compiled_folder_imports_the_functions_and_runs_verified(tmp_path: Path) -> None:
    """compile: stage.py imports the library's functions by module path (`wrapped_lib.scale`
    is shadowed by the function of that name, as `torchvision.ops.stochastic_depth` is) and the
    model file's through its hash; `pipecc run --verify` and `pipecc.load` match the model."""
    model_file = tmp_path / "wrapped_funcs.py"
    shutil.copy(MODEL, model_file)
    out = tmp_path / "out"
    done = _pipecc("compile", str(model_file), "--devices", "2xcpu", "--replicas", "1", "--use-all-devices", "-o", str(out))
    assert done.returncode == 0, done.stderr
    sources = "\n".join((out / f"stage_{i}" / "stage.py").read_text() for i in range(2))
    imports = set(_imports(sources))
    assert "from wrapped_lib.attention import window_attention as window_attention_fn" in imports
    assert "from wrapped_lib.scale import scale as scale_fn" in imports
    assert "from pipecc.runtime.modelfuncs import model_function" in imports
    assert "centre_fn = model_function(__file__, 'centre')" in sources
    run = _pipecc("run", str(out), "--verify", "--steps", "1")
    assert run.returncode == 0, run.stderr
    assert "verify: outputs, loss and" in run.stdout + run.stderr

    import pipecc
    spec = load_model_file(model_file)
    for train in (True, False):
        _same_as_model(pipecc.load(out), spec, train)

    # the hash guarantee: an edited model file is not imported by the stages either
    model_file.write_text(model_file.read_text() + "\n# edited\n")
    with pytest.raises(PipeccError, match="not the one this folder was compiled from") as err:
        pipecc.load(out)
    assert "\n" not in str(err.value)
    model_file.unlink()  # and a missing one: restore it or compile again
    with pytest.raises(PipeccError, match="calls centre of the model file, but the model file .* is missing; "
                                          "restore the model file beside the folder or compile again"):
        pipecc.load(out)


def test_drop_in_runs_the_functions(tmp_path: Path) -> None:
    import pipecc
    spec = load_model_file(MODEL, batch_size=4)
    pm = pipecc.compile(spec.model, spec.example_inputs, "cpu,cpu")
    assert len(pm.plan.stages) == 2
    for train in (True, False):
        _same_as_model(pm, spec, train)


def test_interop_stages_run_the_functions() -> None:
    """torch.distributed.pipelining route 2: pipecc's stage graphs call the library and
    model-file functions and chain to the model's output."""
    from pipecc.interop.pipelining import stage_modules

    spec = load_model_file(MODEL, batch_size=4)
    graph = driver.analyze_module(spec.model, spec.example_inputs, debug=True)
    plan, graph = driver.plan(graph, "2xcpu", microbatches=2, schedule="gpipe", replicas=1)
    stages = stage_modules(plan, graph, world=2)
    assert len(stages) == 2
    env = dict(zip([p.name for p in stages[0].receives], spec.example_inputs))
    for stage in stages:
        outs = stage.gm(*[env[p.name] for p in stage.receives])
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)  # PipelineStage's one-output form
        env.update(zip([p.name for p in stage.sends], outs))
    torch.testing.assert_close(env[stages[-1].model_output["port"]], spec.model(*spec.example_inputs))


def _local_function() -> object:
    def inner(x: torch.Tensor) -> torch.Tensor:
        return x * 2
    return inner


_LAMBDA = lambda x: x + 1  # noqa: E731  (a lambda is the case under test)


@pytest.mark.parametrize("target, why", [
    (_LAMBDA, "'_LAMBDA' (a lambda in test_library_functions)"),
    (_local_function(), "'inner' (defined inside _local_function() in test_library_functions)"),
])
def test_functions_no_import_reaches_are_refused_in_one_line(target, why: str, tmp_path: Path) -> None:
    """A graph calling a lambda or a local function: one line naming it and the fix."""
    from pipecc.backends.torch.codegen import write_stage
    from pipecc.backends.torch.stages import cut_stages

    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(target, (x,)))
    gm = fx.GraphModule(torch.nn.Module(), g)
    inputs = (torch.randn(2, 3),)
    symbols, point, _ = frontend.propagate_shapes(gm, inputs, [frontend.SymbolSpec("B", (0,), 0)])
    frontend.annotate_ops_and_names(gm)
    graph = AnnotatedGraph(gm, symbols, point, "fx")
    cost.annotate(graph)
    stage = cut_stages(graph, {n.meta["pipecc.name"]: 0 for n in graph.compute_nodes()})[0]
    with pytest.raises(PipeccError) as err:
        write_stage(tmp_path / "stage_0", stage, model_name="m", num_stages=1)
    message = str(err.value)
    assert "\n" not in message and why in message
    assert "define it (with def) at the top level of an importable module or of the model file" in message


def test_lambda_of_the_model_file_is_named_in_the_cli_error(tmp_path: Path) -> None:
    """`double = lambda x: x * 2; torch.fx.wrap("double")` in a model file: compile stops with
    one line naming `double` and the model file, and writes nothing."""
    model = tmp_path / "lam.py"
    model.write_text(
        "import torch, torch.fx\n"
        "double = lambda x: x * 2\n"
        "torch.fx.wrap('double')\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.a = torch.nn.Linear(4, 4); self.b = torch.nn.Linear(4, 4)\n"
        "    def forward(self, x):\n"
        "        return self.b(double(self.a(x)))\n"
        "def build_model(): return M()\n"
        "def example_inputs(batch_size=2): return (torch.randn(batch_size, 4),)\n")
    done = _pipecc("compile", str(model), "--devices", "2xcpu", "-o", str(tmp_path / "out"))
    assert done.returncode == 1
    assert done.stderr.strip() == (
        "pipecc: error: stage code generation cannot name the function 'double' (a lambda in the model "
        "file lam.py); a stage file imports the functions it calls: define it (with def) at the top "
        "level of an importable module or of the model file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lam.py"]


def test_main_module_function_is_refused() -> None:
    def f(x):
        return x
    f.__module__, f.__qualname__ = "__main__", "f"
    with pytest.raises(PipeccError, match=r"script being run \(__main__\)"):
        render.importable(f)


def test_opaque_call_costs_what_it_runs() -> None:
    """The model's matmuls are mostly inside `window_attention`, one node to the trace: its
    measured FLOPs make the totals FlopCounterMode's (within 2 %), forward and backward,
    symbolic in B, with no guess warned about."""
    spec = load_model_file(MODEL, batch_size=3)
    graph = driver.analyze_module(spec.model, spec.example_inputs, debug=True)
    assert not [w for w in graph.warnings if "no cost formula" in w or "example sizes" in w]
    node = next(n for n in graph.gm.graph.nodes if n.name == "window_attention")
    attn = node.meta["pipecc.cost"]
    assert attn.forward_flops_matmul > 0 and attn.backward_weight_flops_matmul > 0
    totals = cost.totals(graph)
    ref_fwd, ref_bwd = reference_flops(spec.model, spec.example_inputs, spec.loss_fn, spec.make_target(3))
    assert totals["forward_flops_matmul"] == pytest.approx(ref_fwd, rel=0.02)
    assert totals["backward_flops_matmul"] == pytest.approx(ref_bwd, rel=0.02)
    symbolic = cost.totals(graph, symbolic=True)
    b = graph.symbols["B"]
    other = load_model_file(MODEL, batch_size=5)
    ref5 = reference_flops(other.model, other.example_inputs, other.loss_fn, other.make_target(5))
    assert int(symbolic["forward_flops_matmul"].subs(b, 5)) == pytest.approx(ref5[0], rel=0.02)
    assert int(symbolic["backward_flops_matmul"].subs(b, 5)) == pytest.approx(ref5[1], rel=0.02)


class _ScaledClip(torch.autograd.Function):
    """Clamps in forward; backward reads a value into Python, which fake tensors cannot."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        return x.clamp(-1, 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return grad / max(float(x.abs().max()), 1.0)


def scaled_clip(x: torch.Tensor) -> torch.Tensor:
    return _ScaledClip.apply(x)


fx.wrap("scaled_clip")


class _Clipped(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scaled_clip(self.lin(x))


def test_opaque_call_that_cannot_run_on_fake_tensors_keeps_the_warned_guess() -> None:
    """A wrapped function whose backward reads a tensor's value cannot be measured: the guess
    stays, and the warning names the function and why."""
    graph = driver.analyze_module(_Clipped(), (torch.randn(2, 4),))
    warning = next(w for w in graph.warnings if "no cost formula" in w)
    assert "scaled_clip" in warning and "could not be run on fake tensors" in warning
    assert "\n" not in warning


def cubed_steps(x: torch.Tensor) -> torch.Tensor:
    """B**3 elementwise steps over B rows: FLOPs of degree four in B."""
    for _ in range(x.shape[0] ** 3):
        x = x * 0.5
    return x


fx.wrap("cubed_steps")


class _Cubed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cubed_steps(self.lin(x))


def test_opaque_cost_beyond_degree_two_is_kept_at_the_example_and_said() -> None:
    graph = driver.analyze_module(_Cubed(), (torch.randn(2, 4),))
    assert any("cubed_steps" in w and "kept at the example sizes" in w for w in graph.warnings)
    node = next(n for n in graph.gm.graph.nodes if n.name == "cubed_steps")
    assert node.meta["pipecc.cost"].forward_flops == 2 ** 3 * 2 * 4  # measured at B = 2, a number
