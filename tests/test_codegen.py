"""Generated stage files: readable, standalone, safe against hostile names, and computing the
same outputs and gradients as the model; the compiled folder is written atomically.

Golden snapshots of mlp and gpt stages live in tests/golden/; after an intended codegen change,
rewrite them with `PIPECC_UPDATE_GOLDEN=1 pytest tests/test_codegen.py` and review the diff.
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

from helpers import ZOO
from pipecc import driver
from pipecc.backends import names
from pipecc.frontend import torch_capture as frontend
from pipecc.backends.torch import codegen, compile as torch_compile
from pipecc.backends.torch import names as torch_names
from pipecc.backends.torch.codegen import emit_stage_source, load_stage, write_stage
from pipecc.backends.torch.stages import Stage, cut_stages
from pipecc.errors import PipeccError
from pipecc.ir.graph import META_NAME, META_OP, AnnotatedGraph
from pipecc.ir.plan import Plan, StagePlan
from test_torch_stages import (analysed, one_thread, placeable, random_stage_of,  # noqa: F401
                               stage_of_at, stage_of_fractions, tiny)

GOLDEN = Path(__file__).parent / "golden"
HOSTILE = 'a"; import os; os.system("x") #\n'


# ----------------------------------------------------------------------------- helpers
def assert_safe_source(source: str, onnx: bool = False) -> None:
    """Imports torch only (and pipecc's ONNX operators for ONNX graphs); no name from a hostile
    string ever became code."""
    tree = ast.parse(source)
    imports = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert imports == ["import torch", "import torch.nn.functional as F"] + \
        (["from pipecc.frontend import onnx_ops"] if onnx else [])
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert not names & {"os", "system", "os_system", "__import__", "eval", "exec", "open"}
    assert len([n for n in tree.body if isinstance(n, ast.ClassDef)]) == 1


def run_loaded(loaded: list[tuple[nn.Module, dict]], graph: AnnotatedGraph, inputs: tuple) -> Any:
    env = {n.name: v for n, v in zip([n for n in graph.gm.graph.nodes if n.op == "placeholder"], inputs)}
    for module, ports in loaded:
        outputs = module(*[env[p["name"]] for p in ports["receives"]])
        env = dict(zip([p["name"] for p in ports["sends"]], outputs))
    return env[loaded[-1][1]["model_output"]["port"]]


def _get(module: nn.Module, dotted: str) -> torch.Tensor:
    for part in dotted.split("."):
        module = getattr(module, part)
    return module  # type: ignore[return-value]


def check_generated(tmp: Path, model: nn.Module, inputs: tuple, graph: AnnotatedGraph,
                    stages: list[Stage], loss: Callable[[Any], torch.Tensor]) -> list[nn.Module]:
    """Write, load and run the stage files; outputs, gradients and buffers equal the model's."""
    dirs = [write_stage(tmp / f"stage_{s.index}", s, model_name=graph.model_name,
                        num_stages=len(stages)) for s in stages]
    for d in dirs:
        assert_safe_source((d / "stage.py").read_text(), onnx=graph.source == "onnx")
    loaded = [load_stage(d) for d in dirs]
    model.zero_grad(set_to_none=True)
    expected = model(*inputs)
    loss(expected).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    state = model.state_dict()
    model.zero_grad(set_to_none=True)
    out = run_loaded(loaded, graph, inputs)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    loss(out).backward()
    seen = set()
    for module, _ in loaded:
        for attr, name in type(module).PARAM_NAMES.items():
            t, seen = _get(module, attr), seen | {name}
            if isinstance(t, nn.Parameter):
                torch.testing.assert_close(t.grad, grads[name], rtol=1e-4, atol=1e-6, msg=name)
            elif name in state:  # buffers after the forward: BatchNorm statistics included
                torch.testing.assert_close(t, state[name], msg=name)
        for attr, (name, dim, start, size) in getattr(type(module), "SHARDS", {}).items():
            seen.add(name)
            torch.testing.assert_close(_get(module, attr).grad, grads[name].narrow(dim, start, size))
    assert seen >= set(grads), f"parameters in no stage file: {set(grads) - seen}"
    return [m for m, _ in loaded]


def zoo_loss(name: str) -> Callable[[Any], torch.Tensor]:
    zoo, _, _ = tiny(name)
    target = zoo.example_target(2, **zoo.TINY)
    return lambda out: zoo.loss_fn(out, target)


# ----------------------------------------------------------------------------- golden snapshots
@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_golden_stage_files(name: str) -> None:
    _, _, graph = analysed(name)
    stages = cut_stages(graph, stage_of_fractions(graph, [0.5]))
    for stage in stages:
        source = emit_stage_source(stage, name, stage.index, "cpu (cpu)", len(stages))
        path = GOLDEN / f"{name}_stage{stage.index}.py"
        if os.environ.get("PIPECC_UPDATE_GOLDEN") == "1":
            path.parent.mkdir(exist_ok=True)
            path.write_text(source)
        assert path.exists(), f"missing {path}; create it with PIPECC_UPDATE_GOLDEN=1"
        assert source == path.read_text(), f"{path} changed; review, then PIPECC_UPDATE_GOLDEN=1"


# ----------------------------------------------------------------------------- names
def forward_lines(source: str) -> list[tuple[str, str]]:
    """(variable, human name in its comment) for each statement of forward."""
    return re.findall(r"^        (\w+) = .*  # (\S+)", source, flags=re.M)


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_locals_follow_human_names(name: str) -> None:
    """`blocks.0.add` is `blocks_0_add`, not fx's `add_1`; a digit-only name is led by its op
    (`linear_0`, not `_0`); a stage receiving a value calls it what the sending stage does."""
    _, _, graph = analysed(name)
    stages = cut_stages(graph, stage_of_fractions(graph, [0.5]))
    sources = [emit_stage_source(s, name, s.index, "cpu", len(stages)) for s in stages]
    ops = {n.meta[META_NAME]: n.meta[META_OP] for n in graph.gm.graph.nodes}
    for source in sources:
        lines = forward_lines(source)
        assert lines
        for var, human in lines:
            spelled = human.replace(".", "_")
            expected = f"{ops[human]}_{spelled}" if spelled[0].isdigit() else spelled
            assert var in (expected, f"{expected}_"), (var, human)  # `_`: a builtin (getattr)
    sent = re.findall(r"return \((.*)\)", sources[0])[0].rstrip(",").split(", ")
    received = re.findall(r"def forward\(self, (.*)\) -> tuple", sources[1])[0]
    assert [a.split(":")[0] for a in received.split(", ")] == sent
    if name == "mlp":
        assert ("linear_0", "0") in forward_lines(sources[0]) and "self.linear_0_weight" in sources[0]
    else:
        assert ("blocks_0_add", "blocks.0.add") in forward_lines(sources[0])


def test_identifier_rule() -> None:
    assert names.identifier("blocks.0.attn.proj") == "blocks_0_attn_proj"
    assert names.identifier("0", "linear") == "linear_0"
    assert names.identifier("3.shard0", "linear") == "linear_3_shard0"
    assert names.identifier("7", "onnx.Relu") == "Relu_7"  # an op's last part leads
    assert names.identifier("", "relu") == "relu" and names.identifier("ü€", "x::conv") == "conv"
    assert names.identifier("2", "7up") == "v_2"  # a prefix that is no identifier either
    long = "model.decoder.layers.11.encoder_attn.scaled_dot_product_attention"
    assert names.identifier(long) == "layers_11_encoder_attn_scaled_dot_product_attention"
    assert names.identifier("a" * 50 + ".layers.11.proj") == "layers_11_proj"  # index kept
    assert len(names.identifier("x" * 500)) == names.MAX_LENGTH
    python = torch_names.Identifiers()
    got = [python.fresh(raw, "add") for raw in ("input", "input", "self", "if", "F", "a.b", "a_b",
                                                 "match", HOSTILE)]
    assert got == ["input_", "input_1", "self_", "if_", "F_", "a_b", "a_b_1", "match_",
                   "a_import_os_os_system_x"]
    c = names.Identifiers()
    assert c.fresh("x_0") == "x_0" and c.fresh("x", also=["_0", "_1"]) == "x_1"
    assert c.fresh("x_1_0") == "x_1_0_1"  # taken with the clone x_1's outputs
    assert all(i.isidentifier() and i.isascii() for i in got)


# ----------------------------------------------------------------------------- the zoo
@pytest.mark.parametrize("num_stages", [2, 3])
@pytest.mark.parametrize("name", ZOO)
def test_generated_stages_compute_the_model(name: str, num_stages: int, tmp_path: Path) -> None:
    model, inputs, graph = analysed(name)
    stages = cut_stages(graph, random_stage_of(graph, num_stages, seed=num_stages))
    check_generated(tmp_path, model, inputs, graph, stages, zoo_loss(name))


def test_generated_stage_train_and_eval_mode(tmp_path: Path) -> None:
    """BatchNorm follows the stage module's training flag, as the original module does."""
    model, inputs, graph = analysed("tiny_cnn")
    stages = cut_stages(graph, stage_of_fractions(graph, [0.5]))
    modules = check_generated(tmp_path, model, inputs, graph, stages, lambda o: o.sum())
    model.eval()
    try:
        for m in modules:
            m.eval()
        loaded = list(zip(modules, [load_stage(tmp_path / f"stage_{i}")[1] for i in range(2)]))
        with torch.no_grad():
            torch.testing.assert_close(run_loaded(loaded, graph, inputs), model(*inputs))
    finally:
        model.train()


# ----------------------------------------------------------------------------- split layers
def split_graph(name: str, splits: list[tuple[str, list[int], int]]) -> tuple[nn.Module, tuple, AnnotatedGraph]:
    from pipecc.passes.split_layers import split_node
    _, model, inputs = tiny(name)
    graph = driver.analyze_module(model, inputs, model_name=name, debug=True)
    for node, sizes, dim in splits:
        split_node(graph, node, sizes, dim)
    return model, inputs, graph


def between_shards(graph: AnnotatedGraph, *shard_names: str) -> list[int]:
    """Cut points that put each listed shard's successor in the next stage."""
    index = {n.meta[META_NAME]: i for i, n in enumerate(placeable(graph))}
    return sorted(index[s] + 1 for s in shard_names)


@pytest.mark.parametrize("name,splits,cut_after", [
    ("mlp", [("2", [16, 16], 0), ("4", [20, 12], 1)], ["2.shard0", "4.shard0"]),
    ("gpt", [("wte", [50, 51], 0)], ["wte.shard0"]),
    ("tiny_cnn", [("conv1", [3, 5], 0)], ["conv1.shard0"]),
])
def test_split_layer_shards(name: str, splits: list, cut_after: list[str], tmp_path: Path) -> None:
    model, inputs, graph = split_graph(name, splits)
    stages = cut_stages(graph, stage_of_at(graph, between_shards(graph, *cut_after)))
    modules = check_generated(tmp_path, model, inputs, graph, stages, zoo_loss(name))
    assert any(getattr(type(m), "SHARDS", {}) for m in modules)


# ----------------------------------------------------------------------------- hostile names
class Hostile(nn.Module):
    """Module paths and tensor names that would be code if pasted into a file.

    (torch.fx itself cannot trace names holding a double quote, a backslash or a newline; those
    reach codegen through human names, the model name and the device text, tested below.)"""

    def __init__(self) -> None:
        super().__init__()
        self.add_module("lin; import os; os_system(1) #", nn.Linear(4, 4))
        self.add_module("ü€ 2", nn.LayerNorm(4))
        self.register_parameter("w'q", nn.Parameter(torch.randn(4)))
        self.register_buffer("b c", torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = getattr(self, "lin; import os; os_system(1) #")(x) * getattr(self, "w'q")
        return getattr(self, "ü€ 2")(torch.relu(y)) + getattr(self, "b c")


def hostile_names(graph: AnnotatedGraph) -> None:
    for i, node in enumerate(graph.gm.graph.nodes):
        node.meta[META_NAME] = f"{HOSTILE}{i}'''\"\"\"\\"


def test_hostile_module_paths_and_names(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x = Hostile(), torch.randn(3, 4)
    graph = driver.analyze_module(model, (x,), model_name=HOSTILE, debug=True)
    hostile_names(graph)
    stages = cut_stages(graph, stage_of_fractions(graph, [0.5]))
    for s in stages:
        source = emit_stage_source(s, HOSTILE, s.index, HOSTILE, 2)
        assert_safe_source(source)
        assert "os.system" in ast.get_docstring(ast.parse(source))  # shown, as text
    check_generated(tmp_path, model, (x,), graph, stages, lambda o: o.square().sum())


def test_hand_built_graph_with_hostile_node_names(tmp_path: Path) -> None:
    g = fx.Graph()
    x = g.create_node("placeholder", "x", name=HOSTILE)
    h = g.create_node("call_module", "lin", (x,), name=HOSTILE)
    r = g.create_node("call_function", torch.relu, (h,), name=HOSTILE + "relu")
    m = g.create_node("call_method", "mul", (r, 2.0), name=HOSTILE + "mul")
    s = g.create_node("call_function", torch.sum, (m,), {"dim": -1}, name="import os")
    g.output(s)
    torch.manual_seed(0)
    root = nn.Module()
    root.lin = nn.Linear(4, 4)
    gm = fx.GraphModule(root, g)
    inputs = (torch.randn(3, 4),)
    symbols, point, _ = frontend.propagate_shapes(gm, inputs, [frontend.SymbolSpec("B", (0,), 0)])
    frontend.annotate_ops_and_names(gm)
    graph = AnnotatedGraph(gm, symbols, point, "fx", model_name=HOSTILE)
    hostile_names(graph)
    stages = cut_stages(graph, stage_of_fractions(graph, [0.5]))
    check_generated(tmp_path, gm, inputs, graph, stages, lambda o: o.square().sum())


def test_hostile_onnx_names(tmp_path: Path) -> None:
    """ONNX tensor and node names are free text; the imported graph's stages stay safe."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    def tensor(name: str) -> Any:
        return helper.make_tensor_value_info(HOSTILE + name, TensorProto.FLOAT, ["B", 4])

    weight = numpy_helper.from_array(torch.randn(4, 4).numpy(), name=HOSTILE + "w")
    nodes = [helper.make_node("Gemm", [HOSTILE + "in", HOSTILE + "w"], [HOSTILE + "h"],
                              name=HOSTILE + "gemm", transB=1),
             helper.make_node("Relu", [HOSTILE + "h"], [HOSTILE + "r"], name=HOSTILE + "relu"),
             helper.make_node("Tanh", [HOSTILE + "r"], [HOSTILE + "out"], name="'''\\")]
    model = helper.make_model(helper.make_graph(nodes, HOSTILE, [tensor("in")], [tensor("out")], [weight]),
                              opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(tmp_path / "h.onnx"))
    graph = driver.analyze(tmp_path / "h.onnx", batch_size=2).graph
    stages = cut_stages(graph, stage_of_fractions(graph, [0.5]))
    check_generated(tmp_path, graph.gm, (torch.randn(2, 4),), graph, stages, lambda o: o.sum())


# ----------------------------------------------------------------------------- compiled folder
def make_plan(stages: list[Stage], model: str = "mlp") -> Plan:
    return Plan(model=model, batch_size=2, microbatches=2, schedule="1f1b",
                devices=[{"name": "cpu", "kind": "cpu"} for _ in stages],
                stages=[StagePlan(s.index, s.index, list(s.nodes)) for s in stages], split_layers=[],
                bottleneck_s=1.0, lower_bound_s=1.0, predicted_iteration_s=2.0, bubble_fraction=0.2)


def mlp_stages() -> tuple[AnnotatedGraph, list[Stage]]:
    _, _, graph = analysed("mlp")
    return graph, cut_stages(graph, stage_of_fractions(graph, [0.5]))


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".pipecc-" in p.name]


def test_write_output_layout_and_entry(tmp_path: Path) -> None:
    graph, stages = mlp_stages()
    out = torch_compile.write_output(tmp_path / "out", graph, make_plan(stages), stages,
                                     extra_files={"report.html": "<html></html>"})
    names = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert names == ["pipecc.json", "plan.json", "report.html", "run_stage.py", "schedule.txt",
                     "stage_0/ports.json", "stage_0/stage.py", "stage_0/weights.safetensors",
                     "stage_1/ports.json", "stage_1/stage.py", "stage_1/weights.safetensors"]
    assert Plan.from_json(__import__("json").loads((out / "plan.json").read_text())).model == "mlp"
    assert leftovers(tmp_path) == []
    done = subprocess.run([sys.executable, str(out / "run_stage.py"), "--help"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "--steps" in done.stdout, done.stderr


def test_write_output_refuses_foreign_folders(tmp_path: Path) -> None:
    """A folder pipecc did not write needs --force; even then its files are kept (the ones in
    the way replaced); a pipecc folder is rewritten freely, keeping the user's files too."""
    graph, stages = mlp_stages()
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    with pytest.raises(PipeccError, match="not written by pipecc; use --force"):
        torch_compile.write_output(out, graph, make_plan(stages), stages)
    assert (out / "mine.txt").read_text() == "keep" and leftovers(tmp_path) == []
    torch_compile.write_output(out, graph, make_plan(stages), stages, force=True)
    assert (out / "mine.txt").read_text() == "keep" and (out / "pipecc.json").exists()
    torch_compile.write_output(out, graph, make_plan(stages), stages)  # ours now: no --force
    assert (out / "mine.txt").read_text() == "keep" and leftovers(tmp_path) == []
    files = __import__("json").loads((out / "pipecc.json").read_text())["files"]
    assert "mine.txt" not in files and "stage_1/stage.py" in files and "pipecc.json" in files


def test_failed_compile_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    graph, stages = mlp_stages()

    def failing(out_dir: Path, stage: Stage, **kwargs: Any) -> Path:
        codegen.write_stage(out_dir, stage, **kwargs)
        if stage.index == 1:
            raise RuntimeError("injected failure")
        return out_dir

    monkeypatch.setattr(torch_compile, "write_stage", failing)
    with pytest.raises(RuntimeError, match="injected"):
        torch_compile.write_output(tmp_path / "out", graph, make_plan(stages), stages)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    out = torch_compile.write_output(tmp_path / "out", graph, make_plan(stages), stages)
    before = (out / "stage_0" / "stage.py").read_text()
    monkeypatch.setattr(torch_compile, "write_stage", failing)
    with pytest.raises(RuntimeError, match="injected"):
        torch_compile.write_output(out, graph, make_plan(stages), stages)
    assert (out / "stage_0" / "stage.py").read_text() == before  # the old output, untouched
    assert leftovers(tmp_path) == []


def test_a_stage_releases_what_no_later_line_reads(tmp_path: Path) -> None:
    """The generated forward deletes each tensor after its last reader (`del`), so a Linear's
    output that only a ReLU reads is gone before the next layer runs, as the plan's memory
    counts it; before, every local lived to the return. Measured: the forward's peak of live
    tensor bytes (`runtime.memory.LiveTensorBytes`) is the kept ReLU outputs plus two layers'
    transients, not every Linear output."""
    from pipecc.runtime.memory import LiveTensorBytes
    width, batch, depth = 64, 16, 6
    model = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())])
    x = torch.randn(batch, width)
    graph = driver.analyze_module(model, (x,), model_name="chain")
    (stage,) = cut_stages(graph, {n.meta[META_NAME]: 0 for n in graph.compute_nodes() if n.op != "get_attr"})
    source = write_stage(tmp_path / "s", stage, model_name="chain", num_stages=1)
    text = (source / "stage.py").read_text()
    assert re.search(r"^        del \w+$", text, flags=re.M), text
    module, _ = load_stage(source)
    layer = batch * width * 4
    mode = LiveTensorBytes()
    with mode:
        mode.track([*module.parameters(), x])
        before = mode.live_bytes
        out = module(x)
    kept = depth * layer  # each ReLU's output (its backward, and the next Linear's, keep it)
    assert out[0].shape == (batch, width)
    # every Linear output held to the return would make it 2 * depth layers
    assert mode.peak_bytes - before <= kept + 2 * layer, (mode.peak_bytes - before, kept)
