"""Hostile names through both frontends (issue #14): a torch module whose nn.ModuleDict keys,
submodule and parameter names are keywords, builtins, non-ASCII digits, control characters...,
and an ONNX graph whose input, initializer, node and value names are. Analysis must succeed or
stop with one `pipecc: error:` line; when it succeeds, `pipecc compile` writes stage.py files
that parse and import, and the compiled pipeline (`pipecc.load`) returns the model's output.

Hypothesis draws the names (derandomized in CI, see conftest.py); the names issue #14 lists are
always tried (`@example`). No name may ever run as code: the generated files import torch
(and pipecc's ONNX operators) only.
"""

from __future__ import annotations

import ast
import importlib.util
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings, strategies as st

import pipecc
from pipecc import cli

LISTED = ["in", "None", "return", "class", "²", "⑴", "a-b", "x\r", "\x1b[2J"]
HOSTILE = LISTED + ["import", "self", "F", "torch", "lambda", "0", "_", "__init__", "weight",
                    'a"b', "a\\b", "é", "ℌ", "x y", "def f():", "__class__", "input", "nn"]
CHARS = list("ab_-0²⑴é\r\n\x1b\"'\\ [(:#")
NAMES = st.one_of(st.sampled_from(HOSTILE), st.text(alphabet=st.sampled_from(CHARS), min_size=1,
                                                    max_size=5))
SETTINGS = settings(max_examples=12, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])
ALLOWED_IMPORTS = {"import torch", "import torch.nn.functional as F",
                   "from pipecc.frontend import onnx_ops"}


def compile_or_one_line_error(model: Path, out: Path, capfd) -> bool:
    """`pipecc compile`: True when it wrote OUT, False after exactly one error line."""
    code = cli.main(["compile", str(model), "--devices", "2xcpu", "--use-all-devices", "-b", "3", "-o", str(out), "-q",
                     "--no-split-layers"])
    err = capfd.readouterr().err
    if code == 0:
        return True
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith("pipecc: error: "), err
    assert not out.exists()
    return False


def check_stage_files(out: Path) -> None:
    """Every stage.py parses, imports only what it may, and imports."""
    files = sorted(out.glob("stage_*/stage.py"))
    assert files
    for i, path in enumerate(files):
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
        imports = {ast.unparse(n) for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))}
        assert imports <= ALLOWED_IMPORTS, imports
        spec = importlib.util.spec_from_file_location(f"fuzz_stage_{i}", path)
        assert spec is not None and spec.loader is not None
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


# ----------------------------------------------------------------------------- torch
TORCH_MODEL = '''
import torch
from torch import nn

KEYS = {keys!r}
PARAM = {param!r}
SUB = {sub!r}


class Block(nn.Module):
    def __init__(self, g):
        super().__init__()
        self.register_parameter(PARAM, nn.Parameter(torch.randn(6, 6, generator=g) * 0.3))
        self.add_module(SUB, nn.Linear(6, 6))

    def forward(self, x):
        return torch.tanh(getattr(self, SUB)(x) @ getattr(self, PARAM))


class Hostile(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.blocks = nn.ModuleDict({{k: Block(g) for k in KEYS}})

    def forward(self, x):
        for k in KEYS:
            x = self.blocks[k](x)
        return x


def build_model():
    torch.manual_seed(0)  # the Linear layers: the same model every time the file is built
    return Hostile()


def example_inputs(batch_size=1):
    return (torch.randn(batch_size, 6, generator=torch.Generator().manual_seed(1)),)
'''


def legal_torch_names(keys: list[str], param: str, sub: str) -> bool:
    """What torch itself accepts (a dot, or a name nn.Module already has, is the user's error)."""
    try:
        block = torch.nn.Module()
        block.register_parameter(param, torch.nn.Parameter(torch.zeros(1)))
        block.add_module(sub, torch.nn.Identity())
        torch.nn.ModuleDict({k: torch.nn.Identity() for k in keys})
    except (KeyError, TypeError, ValueError):
        return False
    return param != sub


def import_file(path: Path):
    spec = importlib.util.spec_from_file_location(f"fuzz_model_{abs(hash(str(path)))}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@SETTINGS
@given(keys=st.lists(NAMES, min_size=1, max_size=3, unique=True), param=NAMES, sub=NAMES)
@example(keys=["class", "None", "²"], param="in", sub="return")
@example(keys=["⑴", "a-b"], param="²", sub="\x1b[2J")
@example(keys=["x\r", "in"], param="⑴", sub="a-b")
@example(keys=["self", "F", "torch"], param="weight", sub="import")
def test_torch_module_with_hostile_names(keys: list[str], param: str, sub: str, capfd) -> None:
    if not legal_torch_names(keys, param, sub):
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "hostile.py"
        path.write_text(TORCH_MODEL.format(keys=keys, param=param, sub=sub), encoding="utf-8")
        if not compile_or_one_line_error(path, Path(tmp) / "out", capfd):
            return
        check_stage_files(Path(tmp) / "out")
        module = import_file(path)
        model, (x,) = module.build_model(), module.example_inputs(3)
        pm = pipecc.load(Path(tmp) / "out")
        assert set(pm.state_dict()) == set(model.state_dict())
        torch.testing.assert_close(pm(x), model(x))


# ----------------------------------------------------------------------------- ONNX
def onnx_file(path: Path, names: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """x -> MatMul(W) -> Add(b) -> Relu -> y, every name hostile; returns (W, b)."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper
    x, w, b, mm, add, y, n_mm, n_add, n_relu = names
    weight = np.random.RandomState(0).randn(6, 6).astype(np.float32)
    bias = np.random.RandomState(1).randn(6).astype(np.float32)
    nodes = [helper.make_node("MatMul", [x, w], [mm], name=n_mm),
             helper.make_node("Add", [mm, b], [add], name=n_add),
             helper.make_node("Relu", [add], [y], name=n_relu)]
    graph = helper.make_graph(nodes, "hostile",
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["B", 6])],
                              [helper.make_tensor_value_info(y, TensorProto.FLOAT, ["B", 6])],
                              [numpy_helper.from_array(weight, w), numpy_helper.from_array(bias, b)])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return weight, bias


@SETTINGS
@given(names=st.lists(NAMES, min_size=9, max_size=9, unique=True))
@example(names=["in", "None", "return", "class", "²", "⑴", "a-b", "x\r", "\x1b[2J"])
@example(names=["self", "import", "torch", "F", "lambda", "0", "__init__", "weight", "input"])
@example(names=['a"b', "a\\b", "é", "ℌ", "x y", "def f():", "__class__", "nn", "_"])
def test_onnx_graph_with_hostile_names(names: list[str], capfd) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "hostile.onnx"
        weight, bias = onnx_file(path, names)
        if not compile_or_one_line_error(path, Path(tmp) / "out", capfd):
            return
        check_stage_files(Path(tmp) / "out")
        x = torch.randn(3, 6)
        want = torch.relu(x @ torch.from_numpy(weight) + torch.from_numpy(bias))
        torch.testing.assert_close(pipecc.load(Path(tmp) / "out")(x), want)
