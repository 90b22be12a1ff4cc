"""ONNX frontend: the same annotated graph as the PyTorch model it was exported from."""
from __future__ import annotations

import warnings

import pytest
import torch

from helpers import zoo_module
from pipecc import cost, driver
from pipecc.errors import PipeccError
from pipecc.frontend.onnx_import import from_onnx

# The models whose export exercises every frontend path: convolutions and BatchNorm, LSTMs
# and attention, SDPA decomposed into matmuls, explicit attention.
MODELS = ["mlp", "tiny_cnn", "resnet50", "gpt", "bert", "gnmt", "vgg16"]


def _export(name: str, tmp_path, dynamic: bool = True):
    zoo = zoo_module(name)
    torch.manual_seed(0)
    model = zoo.build_model(**zoo.TINY).eval()
    inputs = zoo.example_inputs(2, **zoo.TINY)
    path = tmp_path / f"{name}.onnx"
    dyn = tuple({0: torch.export.Dim("batch")} for _ in inputs) if dynamic else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, inputs, str(path), dynamo=True, optimize=False,
                          dynamic_shapes=dyn, verbose=False)
    return model, inputs, path


@pytest.mark.parametrize("name", MODELS)
def test_onnx_totals_match_pytorch_and_graph_runs(name, tmp_path):
    model, inputs, path = _export(name, tmp_path)
    torch_graph = driver.analyze_module(model, inputs)
    onnx_graph = driver.analyze(path, batch_size=2, debug=True).graph
    assert onnx_graph.source == "onnx" and "B" in onnx_graph.symbols
    t, o = cost.totals(torch_graph), cost.totals(onnx_graph)
    assert o["forward_flops_matmul"] == t["forward_flops_matmul"]
    assert o["backward_flops_matmul"] == t["backward_flops_matmul"]
    for key in ("forward_flops", "backward_flops", "param_bytes"):
        assert o[key] == pytest.approx(t[key], rel=0.01), key
    # the imported graph executes, with the ONNX weights, to the model's outputs
    torch.testing.assert_close(onnx_graph.gm(*inputs), model(*inputs), rtol=1e-4, atol=1e-5)
    # symbolic batch: the matmul total is linear in B
    sym = cost.totals(onnx_graph, symbolic=True)["forward_flops_matmul"]
    assert int(sym.subs(onnx_graph.symbols["B"], 5)) == 5 * t["forward_flops_matmul"] // 2


def test_activation_bytes_match_when_nothing_is_decomposed(tmp_path):
    """Activation bytes agree where the exporter keeps ops whole. (It decomposes SDPA into
    explicit score tensors and Linear on 3-D inputs into MatMul + Add, which really stash
    more; those models differ there, and only there.)"""
    for name in ["mlp", "tiny_cnn", "vgg16"]:
        model, inputs, path = _export(name, tmp_path)
        t = cost.totals(driver.analyze_module(model, inputs))["activation_bytes"]
        o = cost.totals(driver.analyze(path, batch_size=2).graph)["activation_bytes"]
        assert o == pytest.approx(t, rel=0.01), name


def test_fixed_batch_file_has_numeric_costs_and_says_so(tmp_path):
    _, _, path = _export("mlp", tmp_path, dynamic=False)
    graph = from_onnx(path, batch_size=4)
    cost.annotate(graph)
    assert "B" not in graph.symbols
    assert any("fixed batch size" in w for w in graph.warnings)


def test_corrupt_and_unsupported_onnx_files(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x00\x01not a protobuf at all")
    with pytest.raises(PipeccError, match="not a readable ONNX file|fails the ONNX checker"):
        from_onnx(bad)
    import onnx
    from onnx import helper, TensorProto
    node = helper.make_node("NoSuchOp", ["x"], ["y"], domain="")
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    weird = tmp_path / "weird.onnx"
    onnx.save(helper.make_model(g), str(weird))
    with pytest.raises(PipeccError, match="ONNX"):
        from_onnx(weird)
    with pytest.raises(PipeccError, match="does not exist"):
        from_onnx(tmp_path / "missing.onnx")
