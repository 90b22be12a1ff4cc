"""ONNX operators of MobileNetV3 and detection heads (HardSwish, HardSigmoid, CumSum, IsNaN,
LessOrEqual, GatherElements): costed by their kind, computing what onnxruntime computes, and a
MobileNetV3-style block compiles to stage files that do too. Graphs are built with onnx.helper."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from helpers import pipecc_here
from pipecc import cost
from pipecc.frontend.onnx_import import from_onnx

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

FLOAT, INT64, BOOL = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL


def _save(tmp_path: Path, name: str, nodes: list, inputs: list, outputs: list, inits: list = ()) -> Path:
    graph = helper.make_graph(nodes, name, inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / f"{name}.onnx"
    onnx.save(model, str(path))
    return path


def _ort(path: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _pipecc(path: Path, feeds: dict[str, np.ndarray], batch: int) -> tuple[Any, list[str]]:
    graph = from_onnx(path, batch_size=batch)
    notes = cost.annotate(graph)
    out = graph.gm(*[torch.from_numpy(v) for v in feeds.values()])
    return out, graph.warnings + notes


def _check(path: Path, feeds: dict[str, np.ndarray], batch: int, kind_of: dict[str, str]) -> None:
    expected = _ort(path, feeds)
    out, warnings = _pipecc(path, feeds, batch)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    assert len(outs) == len(expected)
    for got, want in zip(outs, expected):
        np.testing.assert_allclose(got.detach().numpy(), want, rtol=1e-5, atol=1e-6)
    assert not [w for w in warnings if "no cost formula" in w or "implementation" in w], warnings
    graph = from_onnx(path, batch_size=batch)
    kinds = {n.meta["pipecc.op"]: n.meta["pipecc.kind"] for n in graph.gm.graph.nodes}
    for op, kind in kind_of.items():
        assert kinds[op] == kind, (op, kinds)


def _vi(name: str, elem: int, shape: list) -> Any:
    return helper.make_tensor_value_info(name, elem, shape)


def test_hard_activations(tmp_path: Path) -> None:
    """HardSwish; HardSigmoid with ONNX's default slope (0.2) and with torch's (1/6)."""
    nodes = [helper.make_node("HardSwish", ["x"], ["a"]),
             helper.make_node("HardSigmoid", ["x"], ["b"]),
             helper.make_node("HardSigmoid", ["x"], ["c"], alpha=1 / 6, beta=0.5)]
    path = _save(tmp_path, "hard", nodes, [_vi("x", FLOAT, ["B", 40])],
                 [_vi(n, FLOAT, ["B", 40]) for n in "abc"])
    x = np.linspace(-6, 6, 3 * 40, dtype=np.float32).reshape(3, 40)
    _check(path, {"x": x}, 3, {"hardswish": "activation", "hardsigmoid": "activation"})
    graph = from_onnx(path, batch_size=3)
    cost.annotate(graph)
    swish = next(n for n in graph.gm.graph.nodes if n.meta["pipecc.op"] == "hardswish")
    assert swish.meta["pipecc.cost"].value("forward_flops") == 3 * 3 * 40


@pytest.mark.parametrize("exclusive, reverse", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_cumsum(tmp_path: Path, exclusive: int, reverse: int) -> None:
    axis = numpy_helper.from_array(np.array(1, dtype=np.int64), "axis")
    nodes = [helper.make_node("CumSum", ["x", "axis"], ["y"], exclusive=exclusive, reverse=reverse)]
    path = _save(tmp_path, "cumsum", nodes, [_vi("x", FLOAT, ["B", 7])], [_vi("y", FLOAT, ["B", 7])], [axis])
    x = np.random.default_rng(0).standard_normal((2, 7)).astype(np.float32)
    _check(path, {"x": x}, 2, {"cumsum": "elementwise"})


def test_isnan_and_less_or_equal(tmp_path: Path) -> None:
    """A detection head's masking: zero the NaNs, keep the scores at most a threshold."""
    zero = numpy_helper.from_array(np.zeros((1,), dtype=np.float32), "zero")
    limit = numpy_helper.from_array(np.array([0.5], dtype=np.float32), "limit")
    nodes = [helper.make_node("IsNaN", ["x"], ["nan"]),
             helper.make_node("Where", ["nan", "zero", "x"], ["clean"]),
             helper.make_node("LessOrEqual", ["clean", "limit"], ["keep"]),
             helper.make_node("Cast", ["keep"], ["keepf"], to=FLOAT),
             helper.make_node("Mul", ["clean", "keepf"], ["y"])]
    path = _save(tmp_path, "mask", nodes, [_vi("x", FLOAT, ["B", 9])],
                 [_vi("y", FLOAT, ["B", 9]), _vi("keep", BOOL, ["B", 9])], [zero, limit])
    x = np.random.default_rng(1).standard_normal((4, 9)).astype(np.float32)
    x[0, 3] = x[2, 0] = np.nan
    x[1, 1] = 0.5  # equal to the threshold: kept
    _check(path, {"x": x}, 4, {"isnan": "elementwise", "le": "elementwise"})


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_gather_elements(tmp_path: Path, axis: int) -> None:
    rng = np.random.default_rng(2)
    index = rng.integers(-5, 5, size=(5, 5)).astype(np.int64)  # negative indices count from the end
    indices = numpy_helper.from_array(index, "indices")
    nodes = [helper.make_node("GatherElements", ["x", "indices"], ["y"], axis=axis)]
    path = _save(tmp_path, "gather", nodes, [_vi("x", FLOAT, [5, 5])], [_vi("y", FLOAT, [5, 5])], [indices])
    _check(path, {"x": rng.standard_normal((5, 5)).astype(np.float32)}, 5, {"gather": "shape"})


def test_mobilenet_v3_block_compiles_and_matches_onnxruntime(tmp_path: Path) -> None:
    """Conv, HardSwish, squeeze-excitation gated by HardSigmoid: compiled for 2xcpu, the stage
    files chained give onnxruntime's output."""
    rng = np.random.default_rng(3)

    def init(name: str, *shape: int) -> Any:
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)

    inits = [init("w1", 8, 3, 3, 3), init("b1", 8), init("w2", 4, 8, 1, 1), init("b2", 4),
             init("w3", 8, 4, 1, 1), init("b3", 8), init("w4", 8, 8, 1, 1), init("b4", 8)]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("HardSwish", ["c1"], ["h1"]),
             helper.make_node("GlobalAveragePool", ["h1"], ["p"]),
             helper.make_node("Conv", ["p", "w2", "b2"], ["s1"]),
             helper.make_node("Relu", ["s1"], ["s2"]),
             helper.make_node("Conv", ["s2", "w3", "b3"], ["s3"]),
             helper.make_node("HardSigmoid", ["s3"], ["gate"], alpha=1 / 6, beta=0.5),
             helper.make_node("Mul", ["h1", "gate"], ["se"]),
             helper.make_node("Conv", ["se", "w4", "b4"], ["c2"]),
             helper.make_node("HardSwish", ["c2"], ["y"])]
    path = _save(tmp_path, "mbv3", nodes, [_vi("x", FLOAT, ["B", 3, 8, 8])], [_vi("y", FLOAT, ["B", 8, 8, 8])],
                 inits)
    out = tmp_path / "out"
    done = pipecc_here("compile", str(path), "--devices", "2xcpu", "--replicas", "1", "--use-all-devices", "--batch-size", "2",
                       "-o", str(out))
    assert done.returncode == 0, done.stderr
    import pipecc
    pm = pipecc.load(out).eval()
    x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    got = pm(torch.from_numpy(x))
    np.testing.assert_allclose(got.detach().numpy(), _ort(path, {"x": x})[0], rtol=1e-4, atol=1e-5)
