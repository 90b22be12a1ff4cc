"""Intra-layer split on the graphs torch.export and the ONNX importer produce: the same checks as
for fx modules (`test_split_layers.check_split`: verify, structure, costs, outputs, gradients),
the planner splitting one dominant layer whatever the frontend, stage files over the split
weights, and named refusals for the forms that do not split."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper

from helpers import pipecc_here, zoo_module
from pipecc import driver
from pipecc.backends.torch.codegen import load_stage, write_stage
from pipecc.backends.torch.stages import cut_stages
from pipecc.frontend import torch_capture
from pipecc.frontend.modelfile import load_model_file
from pipecc.ir.graph import META_NAME, META_OP, AnnotatedGraph, verify
from pipecc.passes.split_forms import recognise
from pipecc.passes.split_layers import extent, split_node, splittable
from pipecc.passes.split_search import splittable_names
from test_codegen import check_generated, run_loaded
from test_split_layers import check_split
from test_torch_stages import placeable, stage_of_at


class Exported(nn.Module):
    """One layer followed by tanh (test_split_layers.Net), but out of torch.fx's reach: Python
    control flow on a shape makes pipecc capture it with torch.export."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] > 0:
            return torch.tanh(self.layer(x))
        return x


def exported(model: nn.Module, inputs: tuple) -> AnnotatedGraph:
    graph = driver.analyze_module(model, inputs, debug=True)
    assert graph.source == "export"
    return graph


def decomposed(model: nn.Module, inputs: tuple, monkeypatch) -> AnnotatedGraph:
    """The core-ATen form of the exported graph (addmm over a permuted weight, convolution)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = torch.export.export(model, inputs, strict=False).run_decompositions().module()
    for node in list(gm.graph.nodes):  # as torch_capture.capture does
        if node.op == "call_module" and str(node.target).startswith("_guards_fn"):
            gm.graph.erase_node(node)
    gm.recompile()
    monkeypatch.setattr(torch_capture, "capture", lambda *args: (gm, "export", []))
    return driver.analyze_module(model, inputs, debug=True)


def named(graph: AnnotatedGraph, op: str) -> list[str]:
    return [n.meta[META_NAME] for n in graph.compute_nodes() if n.meta[META_OP] == op]


def halves(total: int) -> list[int]:
    return [total // 3, total - total // 3]


# ----------------------------------------------------------------------------- torch.export
EXPORT_CASES = {  # layer, input shape, op the graph calls, dim
    "linear_out": (lambda: nn.Linear(6, 8), (3, 6), "linear", 0),
    "linear_in": (lambda: nn.Linear(6, 8), (3, 6), "linear", 1),
    "linear_3d_no_bias": (lambda: nn.Linear(5, 7, bias=False), (2, 3, 5), "linear", 1),
    "conv": (lambda: nn.Conv2d(3, 5, 3, stride=2, padding=1, dilation=2), (2, 3, 9, 8),
             "conv2d", 0),
    "conv_same": (lambda: nn.Conv2d(2, 4, 3, padding="same", bias=False), (2, 2, 6, 6),
                  "conv2d", 0),
    "embedding": (lambda: nn.Embedding(9, 4, padding_idx=2), None, "embedding", 0),
}


@pytest.mark.parametrize("case", sorted(EXPORT_CASES))
def test_export_layer_splits(case: str) -> None:
    make, shape, op, dim = EXPORT_CASES[case]
    torch.manual_seed(0)
    model = Exported(make())
    x = torch.randint(9, (2, 5)) if shape is None else torch.randn(shape).requires_grad_(dim == 1)
    graph = exported(model, (x,))
    name = f"layer.{op}"
    assert splittable_names(graph) == [name]
    check_split(model, (x,), name, halves(extent(graph, graph.by_name()[name], dim)), dim, graph)


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("bias", [True, False])
def test_core_aten_addmm_and_mm_over_a_transposed_weight(bias: bool, dim: int, monkeypatch) -> None:
    torch.manual_seed(0)
    model = Exported(nn.Linear(6, 8, bias=bias))
    x = torch.randn(3, 6)
    graph = decomposed(model, (x,), monkeypatch)
    op = "addmm" if bias else "mm"
    assert named(graph, "permute") and splittable_names(graph) == named(graph, op)
    check_split(model, (x,), named(graph, op)[0], halves(8 if dim == 0 else 6), dim, graph)
    assert not named(graph, "permute")  # the weight's transpose went with the call


def test_core_aten_convolution(monkeypatch) -> None:
    torch.manual_seed(0)
    model = Exported(nn.Conv2d(3, 6, 3, padding=1))
    x = torch.randn(2, 3, 5, 5)
    graph = decomposed(model, (x,), monkeypatch)
    (name,) = named(graph, "convolution")
    assert splittable_names(graph) == [name]
    with pytest.raises(ValueError, match=f"along dim 1: convolution call {name!r} splits along "
                                         r"dims \(0,\)"):
        split_node(graph, name, [1, 2], 1)
    with pytest.raises(ValueError, match=f"summing to 6 \\(out_channels of {name!r}\\)"):
        split_node(graph, name, [1, 2], 0)
    check_split(model, (x,), name, [1, 2, 3], 0, graph)


class Functional(nn.Module):
    """Parameters used through calls, not modules (fx records these as get_attr + call)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 4))   # stored [in, out]: x @ w
        self.v = nn.Parameter(torch.randn(5, 4))   # stored [out, in]: x @ v.T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ self.w)
        return torch.matmul(h, self.v.t())


@pytest.mark.parametrize("name,dim", [("matmul", 0), ("matmul", 1), ("matmul_1", 0),
                                      ("matmul_1", 1)])
def test_fx_matmul_over_parameters(name: str, dim: int) -> None:
    """x @ w over a raw [in, out] parameter becomes call shards; over its transpose, module
    shards (fx graphs too)."""
    torch.manual_seed(0)
    model, x = Functional(), torch.randn(3, 6)
    graph = driver.analyze_module(model, (x,), debug=True)
    assert graph.source == "fx" and splittable_names(graph) == ["matmul", "matmul_1"]
    check_split(model, (x,), name, halves(extent(graph, graph.by_name()[name], dim)), dim, graph)


# ----------------------------------------------------------------------------- ONNX
def _export_onnx(model: nn.Module, inputs: tuple, path: Path, optimize: bool = False) -> Path:
    dyn = tuple({0: torch.export.Dim("batch")} for _ in inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, inputs, str(path), dynamo=True, optimize=optimize,
                          dynamic_shapes=dyn, verbose=False)
    return path


@pytest.fixture(scope="module")
def zoo_onnx(tmp_path_factory) -> dict[str, tuple[nn.Module, tuple, Path]]:
    """The zoo's MLP (ONNX Gemm) and CNN (ONNX Conv, then Gemm), exported as test_onnx does."""
    out = {}
    for name in ("mlp", "tiny_cnn"):
        zoo = zoo_module(name)
        torch.manual_seed(0)
        model = zoo.build_model(**zoo.TINY).eval()
        inputs = zoo.example_inputs(2, **zoo.TINY)
        path = _export_onnx(model, inputs, tmp_path_factory.mktemp(name) / "m.onnx")
        out[name] = model, inputs, path
    return out


def imported(path: Path) -> AnnotatedGraph:
    graph = driver.analyze(path, batch_size=2, debug=True).graph
    assert graph.source == "onnx" and "B" in graph.symbols
    return graph


ONNX_CASES = [("mlp", "gemm", 0, 0), ("mlp", "gemm", 1, 0), ("mlp", "gemm", 1, 1),
              ("mlp", "gemm", 2, 1), ("tiny_cnn", "convolution", 0, 0),
              ("tiny_cnn", "convolution", 2, 0), ("tiny_cnn", "gemm", 0, 0),
              ("tiny_cnn", "gemm", 0, 1)]


@pytest.mark.parametrize("name,op,index,dim", ONNX_CASES)
def test_onnx_layer_splits(name: str, op: str, index: int, dim: int, zoo_onnx) -> None:
    model, inputs, path = zoo_onnx[name]
    graph = imported(path)
    layers = named(graph, op)
    assert splittable_names(graph) == [n.meta[META_NAME] for n in graph.compute_nodes()
                                       if n.meta[META_OP] in ("gemm", "convolution")]
    torch.testing.assert_close(graph.gm(*inputs), model(*inputs), rtol=1e-4, atol=1e-5)
    total = extent(graph, graph.by_name()[layers[index]], dim)
    check_split(graph.gm, inputs, layers[index], halves(total), dim, graph)
    torch.testing.assert_close(graph.gm(*inputs), model(*inputs), rtol=1e-4, atol=1e-5)


class Tokens(nn.Module):
    """A linear over [batch, tokens, features]: torch.onnx writes MatMul(x, Transpose(W)) + Add;
    optimised, it folds the transpose into an [in, out] initializer."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x))


@pytest.fixture(scope="module")
def tokens_onnx(tmp_path_factory) -> dict[bool, Path]:
    torch.manual_seed(0)
    model, folder = Tokens(), tmp_path_factory.mktemp("tokens")
    return {optimize: _export_onnx(model, (torch.randn(2, 3, 6),), folder / f"{optimize}.onnx",
                                   optimize) for optimize in (False, True)}


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("optimize", [False, True])
def test_onnx_matmul_over_a_transposed_or_folded_weight(optimize: bool, dim: int,
                                                        tokens_onnx) -> None:
    graph = imported(tokens_onnx[optimize])
    (name,) = named(graph, "matmul")
    assert splittable_names(graph) == [name]
    assert (recognise(graph, graph.by_name()[name]).parent is None) == optimize  # call shards
    check_split(graph.gm, (torch.randn(2, 3, 6),), name,
                halves(extent(graph, graph.by_name()[name], dim)), dim, graph)
    assert not named(graph, "permute")  # unoptimised: the Transpose went with the MatMul


def onnx_file(path: Path, nodes: list, inits: dict[str, np.ndarray],
              inputs: dict[str, tuple[int, list]], outputs: dict[str, list]) -> Path:
    """An ONNX file of `nodes`; inputs and outputs: name -> (element type,) shape after N."""
    def info(name: str, elem: int, shape: list):
        return helper.make_tensor_value_info(name, elem, ["N", *shape])
    graph = helper.make_graph(
        nodes, path.stem, [info(k, elem, shape) for k, (elem, shape) in inputs.items()],
        [info(k, TensorProto.FLOAT, shape) for k, shape in outputs.items()],
        initializer=[numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def raw_weights(tmp_path: Path) -> Path:
    """Weights stored [in, out], as optimised exports fold them: MatMul, Gemm transB=0."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
             helper.make_node("Tanh", ["h"], ["t"], name="tanh"),
             helper.make_node("Gemm", ["t", "W2", "B2"], ["y"], name="gemm")]
    return onnx_file(tmp_path / "raw.onnx", nodes, {"W": rng.normal(size=(6, 8)),
                     "W2": rng.normal(size=(8, 5)), "B2": rng.normal(size=5)},
                     {"x": (TensorProto.FLOAT, [6])}, {"y": [5]})


@pytest.mark.parametrize("name,dim", [("mm", 0), ("mm", 1), ("gemm", 0), ("gemm", 1)])
def test_onnx_weights_stored_in_out_split_as_calls(name: str, dim: int, tmp_path: Path) -> None:
    graph = imported(raw_weights(tmp_path))
    assert splittable_names(graph) == ["mm", "gemm"]
    total = extent(graph, graph.by_name()[name], dim)
    check_split(graph.gm, (torch.randn(2, 6),), name, [1, 2, total - 3], dim, graph)


# ----------------------------------------------------------------------------- planning
DOMINANT = '''
import torch
from torch import nn


class Dominant(nn.Module):
    """Three linears; the middle one does 85% of the work."""

    def __init__(self, traceable: bool = True) -> None:
        super().__init__()
        self.traceable = traceable
        self.a, self.big, self.c = nn.Linear(512, 512), nn.Linear(512, 4096), nn.Linear(4096, 16)

    def forward(self, x):
        if not self.traceable and x.shape[-1] == 0:  # beyond torch.fx: captured with torch.export
            raise ValueError("no features")
        return self.c(torch.relu(self.big(torch.relu(self.a(x)))))


def build_model(traceable=1, **_):
    torch.manual_seed(0)
    return Dominant(bool(int(traceable)))


def example_inputs(batch_size=256, **_):
    return (torch.randn(batch_size, 512, generator=torch.Generator().manual_seed(0)),)
'''


BIG = {"fx": "big", "export": "big.linear", "onnx": "node_linear_1"}  # its name in each graph


@pytest.fixture(scope="module")
def dominant(tmp_path_factory) -> dict[str, Path]:
    """The same model as a model file (fx), a model file torch.fx cannot trace, an ONNX file."""
    folder = tmp_path_factory.mktemp("dominant")
    (folder / "dominant.py").write_text(DOMINANT)
    spec = load_model_file(folder / "dominant.py", {}, batch_size=256)
    onnx_path = _export_onnx(spec.model, spec.example_inputs, folder / "dominant.onnx")
    return {"fx": folder / "dominant.py", "export": folder / "dominant.py", "onnx": onnx_path}


def _analyse(frontend: str, path: Path) -> AnnotatedGraph:
    args = {"traceable": 0} if frontend == "export" else None
    graph = driver.analyze(path, model_args=args, batch_size=256, debug=True).graph
    assert graph.source == frontend
    return graph


def test_plan_splits_the_dominant_layer_in_every_frontend(dominant) -> None:
    spec = load_model_file(dominant["fx"], {}, batch_size=256)
    ref = spec.model(*spec.example_inputs).detach()
    for frontend in ("fx", "export", "onnx"):
        plan, graph = driver.plan(_analyse(frontend, dominant[frontend]), "2xcpu", debug=True)
        (split,) = plan.split_layers
        assert split.node == BIG[frontend]
        assert split.parts >= 2 and sum(split.sizes) == 4096 and split.dim == 0
        assert {n for st in plan.stages for n in st.nodes} >= set(split.shards)
        verify(graph, costed=True)
        torch.testing.assert_close(graph.gm(*spec.example_inputs), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("frontend", ["export", "onnx"])
def test_pipecc_plan_cli_splits(frontend: str, dominant) -> None:
    extra = ["--model-arg=traceable=0"] if frontend == "export" else []
    r = pipecc_here("plan", str(dominant[frontend]), "-b", "256", "--devices", "2xcpu", "--replicas", "1", "--json",
                    *extra)
    assert r.returncode == 0, r.stderr
    split = json.loads(r.stdout)["split_layers"]
    assert [s["node"] for s in split] == [BIG[frontend]]


# ----------------------------------------------------------------------------- stage files
def test_export_shards_in_stage_files(tmp_path: Path) -> None:
    """Module shards over an exported graph's parameters: each stage file holds its slices."""
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.conv, self.head = nn.Linear(6, 8), nn.Conv2d(3, 4, 3), nn.Linear(8, 5)

        def forward(self, x: torch.Tensor, img: torch.Tensor) -> torch.Tensor:
            if x.shape[-1] > 0:
                x = self.head(torch.tanh(self.fc(x)))
            return x + self.conv(img).mean((2, 3)).sum(1, keepdim=True)

    torch.manual_seed(0)
    model, inputs = Net(), (torch.randn(2, 6), torch.randn(2, 3, 5, 5))
    graph = exported(model, inputs)
    split_node(graph, "fc.linear", [3, 5])
    split_node(graph, "head.linear", [2, 6], dim=1)
    split_node(graph, "conv.conv2d", [1, 3])
    order = [n.meta[META_NAME] for n in placeable(graph)]
    stages = cut_stages(graph, stage_of_at(graph, [order.index("fc.linear.shard1"),
                                                   order.index("head.linear.shard1.in")]))
    modules = check_generated(tmp_path, model, inputs, graph, stages, lambda out: out.sum())
    shards = [v for m in modules for v in getattr(type(m), "SHARDS", {}).values()]
    assert ("fc.weight", 0, 3, 5) in shards and ("head.weight", 1, 0, 2) in shards
    assert all(not s.tied for s in stages)


def test_onnx_call_shards_in_stage_files(tmp_path: Path) -> None:
    """Call shards read the whole [in, out] weight: stages holding shards of it tie it, and
    their gradients sum to the weight's."""
    graph = imported(raw_weights(tmp_path))
    x = torch.randn(2, 6)
    ref = graph.gm(x)
    ref.sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in graph.gm.named_parameters()}
    graph.gm.zero_grad(set_to_none=True)
    split_node(graph, "mm", [3, 5])
    split_node(graph, "gemm", [2, 6], dim=1)
    order = [n.meta[META_NAME] for n in placeable(graph)]
    stages = cut_stages(graph, stage_of_at(graph, [order.index("mm.shard1.weight")]))
    assert [s.tied for s in stages] == [["W"], ["W"]]
    loaded = [load_stage(write_stage(tmp_path / f"stage_{s.index}", s, model_name="raw",
                                     num_stages=len(stages))) for s in stages]
    out = run_loaded(loaded, graph, (x,))
    torch.testing.assert_close(out, ref.detach())
    out.sum().backward()
    grads: dict[str, torch.Tensor] = {}
    for module, _ in loaded:
        for attr, name in type(module).PARAM_NAMES.items():
            grad = getattr(module, attr).grad
            grads[name] = grads[name] + grad if name in grads else grad
    assert grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, msg=name)


# ----------------------------------------------------------------------------- refusals
def check_refusals(graph: AnnotatedGraph, cases: dict[str, str]) -> None:
    """Each node is not splittable and split_node names it and the reason; nothing changes."""
    before = graph.gm.code
    for name, why in cases.items():
        assert splittable(graph, graph.by_name()[name]) == (), name
        with pytest.raises(ValueError, match=f"cannot split {name!r}: .*{why}"):
            split_node(graph, name, [1, 1])
    assert graph.gm.code == before
    verify(graph, costed=True)


def test_export_refusals() -> None:
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared = nn.Linear(4, 4)
            self.w = nn.Parameter(torch.randn(4, 3))  # [in, out], used transposed as [out, in]
            self.up = nn.ConvTranspose2d(4, 2, 2)
            self.grouped = nn.Conv2d(4, 4, 1, groups=2)
            self.conv1d = nn.Conv1d(4, 2, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[-1] > 0:
                x = self.shared(self.shared(x))
            img = x[:, :, None, None]
            return (F.linear(x, self.w.t()).sum() + self.up(img).sum() + self.grouped(img).sum()
                    + self.conv1d(x[:, :, None]).sum())

    graph = exported(Odd(), (torch.randn(2, 4),))
    check_refusals(graph, {
        "shared.linear": "read by another node too", "shared.linear_1": "read by another node too",
        "linear": r"transpose of a parameter stored \[in, out\]",
        "up.conv_transpose2d": "call of conv_transpose2d", "grouped.conv2d": r"groups=2",
        "conv1d.conv1d": "call of conv1d", "sum": "call of sum"})


def test_core_aten_transposed_convolution_is_refused(monkeypatch) -> None:
    graph = decomposed(Exported(nn.ConvTranspose2d(3, 2, 2)), (torch.randn(2, 3, 4, 4),),
                       monkeypatch)
    check_refusals(graph, {named(graph, "convolution")[0]: "transposed convolution"})


def test_onnx_refusals(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    w, conv_w = rng.normal(size=(4, 6)), rng.normal(size=(4, 3, 3, 3))
    nodes = [
        helper.make_node("Transpose", ["x"], ["xt"], name="transpose"),
        helper.make_node("Gemm", ["x", "W", "B"], ["y1"], name="scaled", alpha=2.0, transB=1),
        helper.make_node("Gemm", ["xt", "W", "B"], ["y2"], name="trans_a", transA=1, transB=1),
        helper.make_node("Gemm", ["x", "W3", "B2d"], ["y3"], name="bias_2d", transB=1),
        helper.make_node("MatMul", ["x", "xt"], ["y4"], name="activations"),
        helper.make_node("Conv", ["img", "CW"], ["y5"], name="asymmetric", pads=[1, 1, 0, 0]),
        helper.make_node("Conv", ["img", "CW"], ["y6"], name="auto_pad", auto_pad="SAME_UPPER"),
        helper.make_node("Conv", ["img6", "GW"], ["y7"], name="grouped", group=2),
        helper.make_node("Gather", ["T", "ids"], ["y8"], name="lookup"),
    ]
    inits = {"W": w, "W3": w, "B": rng.normal(size=4), "B2d": rng.normal(size=(1, 4)), "CW": conv_w,
             "GW": rng.normal(size=(4, 3, 1, 1)), "T": rng.normal(size=(7, 3))}
    f32 = TensorProto.FLOAT
    path = onnx_file(tmp_path / "odd.onnx", nodes, inits,
                     {"x": (f32, [6]), "img": (f32, [3, 5, 5]), "img6": (f32, [6, 5, 5]),
                      "ids": (TensorProto.INT64, [2])},
                     {"y1": [4], "y2": [4], "y3": [4], "y4": ["N"], "y5": [4, 4, 4],
                      "y6": [4, 5, 5], "y7": [4, 5, 5], "y8": [2, 3]})
    check_refusals(driver.analyze(path, batch_size=2, debug=True).graph, {
        "scaled": "alpha=2.0", "trans_a": "transA=1", "bias_2d": r"bias has shape \[1, 4\]",
        "activations": "weight is not a parameter", "asymmetric": "not the same at both ends",
        "auto_pad": "auto_pad=SAME_UPPER", "grouped": "group=2", "lookup": "call of gather_rows"})
