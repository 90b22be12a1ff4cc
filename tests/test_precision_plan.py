"""Mixed precision declared once, at compile: the plan counts the bytes autocast holds and sends and
the devices' peak for the dtype (pipecc.cost_precision), the folder records it, and `pipecc run`,
`pipecc.distributed.load` and `pipecc.load` run it without being told again."""
from __future__ import annotations

import json
import textwrap

import pytest
import torch
import torch.fx as fx
from torch import nn

from helpers import ROOT, run_cli, zoo_module
from pipecc import cost, driver
from pipecc.cost_precision import autocast_device, autocast_low
from pipecc.errors import UsageError
from pipecc.ir.graph import META_COST, META_VALUE, tensors_in
from pipecc.passes.plan_options import PlanOptions
from pipecc.targets.devices import parse_devices


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.n, self.b = nn.Linear(64, 128), nn.LayerNorm(128), nn.Linear(128, 32)

    def forward(self, x):
        return self.b(self.n(torch.relu(self.a(x)))) * 2.0


def _costs(graph, precision: str, device: str) -> dict[str, dict[str, int]]:
    cost.annotate(graph, precision=precision, autocast_device=device)
    return {n.name: n.meta[META_COST].values for n in graph.gm.graph.nodes}


def test_bytes_under_autocast_follow_each_op():
    graph = driver.analyze_module(Block(), (torch.randn(8, 64),), model_name="Block")
    fp32 = _costs(graph, "fp32", "")
    bf16 = _costs(graph, "bf16", "cuda")
    # every message travels in bf16: half of every float32 output
    for name in ("x", "a", "relu", "n", "b", "mul"):
        assert bf16[name]["output_bytes"] * 2 == fp32[name]["output_bytes"], name
    # held (pipecc.cost_saved, what each backward keeps; cost_precision.kept_casts): linear `a`
    # keeps the bf16 copy autocast makes of its float32 input, and no weight copy (its input takes
    # no gradient); its output nobody keeps (relu keeps its own, bf16)
    assert bf16["a"]["stash_bytes"] == 8 * 64 * 2
    assert bf16["relu"]["stash_bytes"] == 8 * 128 * 2
    # CUDA's autocast runs layer_norm in float32: it keeps a float32 copy of relu's bf16 output,
    # plus mean and rstd; in fp32 it keeps nothing of its own but its output is kept by `b`
    assert bf16["n"]["stash_bytes"] == fp32["n"]["stash_bytes"] == 8 * 128 * 4 + 2 * 8 * 4
    # `b` keeps the bf16 copy of n's float32 output and of its weight (its input takes a gradient)
    assert bf16["b"]["stash_bytes"] == 8 * 128 * 2 + 128 * 32 * 2
    # weights, gradients and optimizer state stay float32
    assert all(bf16[k]["param_bytes"] == fp32[k]["param_bytes"] for k in fp32)
    # the CPU's autocast runs layer_norm in bf16: it keeps relu's bf16 output as it is (relu's
    # charge), mean and rstd; `b` keeps n's bf16 output (tests/test_cost_saved.py: exact on the CPU)
    cpu = _costs(graph, "bf16", "cpu")
    assert cpu["n"]["stash_bytes"] == 8 * 128 * 2 + 2 * 8 * 4


def _autocast_dtypes(gm: fx.GraphModule, inputs: tuple) -> dict[fx.Node, torch.dtype]:
    got: dict[fx.Node, torch.dtype] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if isinstance(out, torch.Tensor):
                got[n] = out.dtype
            return out

    with torch.autocast("cpu", dtype=torch.bfloat16):
        Recorder(gm).run(*inputs)
    return got


@pytest.mark.parametrize("name", ["gpt", "bert", "resnet50", "gnmt", "chargpt"])
def test_cpu_rules_give_the_dtype_torch_autocast_gives(name):
    """The rule tables against what torch.autocast really does, node by node, on the CPU."""
    mod = zoo_module(name)
    model = mod.build_model(**getattr(mod, "TINY", {}))
    inputs = mod.example_inputs(2, **getattr(mod, "TINY", {}))
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    graph = driver.analyze_module(model, inputs, model_name=name)
    low = autocast_low(graph.gm, "cpu")
    checked = 0
    for node, dtype in _autocast_dtypes(graph.gm, inputs).items():
        traced = list(tensors_in(node.meta.get(META_VALUE)))
        if node.op in ("placeholder", "get_attr", "output") or not traced or traced[0].dtype != torch.float32:
            continue
        assert (dtype == torch.bfloat16) == (node in low), (node.name, dtype)
        checked += 1
    assert checked > 5


def test_a_mixed_plan_is_faster_on_tensor_cores_and_holds_less(tmp_path):
    # NOTE: at a large batch; at a small one autocast's weight copies (one set per micro-batch in
    # flight) outweigh the halved activations, and a bf16 stage may hold more than an fp32 one
    graph = driver.analyze_module(Block(), (torch.randn(2048, 64),), model_name="Block")
    cluster = parse_devices("2xa100")
    fixed = dict(microbatches=4, schedule="1f1b", use_all_devices=True, split_layers=False)
    fp32, _ = driver.plan(graph, cluster, PlanOptions(**fixed))
    bf16, _ = driver.plan(graph, cluster, PlanOptions(precision="bf16", **fixed))
    assert (fp32.dtype, bf16.dtype) == ("fp32", "bf16")
    assert bf16.options["precision"] == "bf16" and any("precision bf16" in d for d in bf16.decisions)
    # the A100's bf16 tensor cores (312 TFLOP/s) against its fp32 CUDA cores (19.5 TFLOP/s)
    assert sum(s.forward_s for s in bf16.stages) < sum(s.forward_s for s in fp32.stages)
    assert sum(s.peak_memory_bytes for s in bf16.stages) < sum(s.peak_memory_bytes for s in fp32.stages)
    # the graph went back to float32 costs when planned in float32 again
    again, _ = driver.plan(graph, cluster, PlanOptions(**fixed))
    assert [s.peak_memory_bytes for s in again.stages] == [s.peak_memory_bytes for s in fp32.stages]


def test_autocast_device_is_cpu_only_for_all_cpu_clusters():
    assert autocast_device(["cpu", "cpu"]) == "cpu"
    assert autocast_device(["gpu", "cpu"]) == "cuda"


MODEL = textwrap.dedent('''
    import torch
    import torch.nn.functional as F
    from torch import nn

    def build_model(**_):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 32),
                             nn.ReLU(), nn.Linear(32, 10))

    def example_inputs(batch_size=1, **_):
        return (torch.randn(batch_size, 16),)

    def example_target(batch_size=1, **_):
        return torch.randint(0, 10, (batch_size,))

    def loss_fn(outputs, target):
        return F.cross_entropy(outputs.float(), target)
''')


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("precision")
    model = root / "m.py"
    model.write_text(MODEL, encoding="utf-8")
    out = root / "out"
    from pipecc import cli
    code = cli.main(["compile", str(model), "-b", "8", "--devices", "2xcpu", "--replicas", "1", "-m", "2",
                     "--use-all-devices", "--schedule", "1f1b", "--precision", "bf16", "-o", str(out), "-q"])
    assert code == 0
    return model, out


def test_the_folder_keeps_the_precision_and_every_loader_uses_it(bf16_folder):
    import pipecc
    import pipecc.distributed
    model_file, out = bf16_folder
    assert json.loads((out / "pipecc.json").read_text())["precision"] == "bf16"
    assert json.loads((out / "plan.json").read_text())["dtype"] == "bf16"
    ns: dict = {}
    exec(compile(model_file.read_text(), str(model_file), "exec"), ns)
    (x,), y = ns["example_inputs"](8), ns["example_target"](8)

    pm = pipecc.load(out)
    assert "bfloat16 autocast" in repr(pm)
    pipe = pipecc.distributed.load(out)
    assert pipe.runtime.ctx.amp_dtype is torch.bfloat16
    # the same weights, run by hand in one module under autocast
    ref = ns["build_model"]()
    ref.load_state_dict(pipe.full_state_dict())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        halves = [ref(part) for part in x.chunk(2)]
        expected = sum(ns["loss_fn"](h, t) for h, t in zip(halves, y.chunk(2))) / 2
    loss = pipe.step(x, target=y)
    torch.testing.assert_close(torch.as_tensor(float(loss)), expected.detach().float(), rtol=2e-2, atol=1e-3)
    pipe.close()
    assert pipecc.distributed.load(out, precision="fp32").runtime.ctx.amp_dtype is None


def test_drop_in_runs_each_stage_under_autocast():
    import pipecc
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    x = torch.randn(8, 16)
    pm = pipecc.compile(model, (x,), "2xcpu", microbatches=1, precision="bf16")
    out = pm(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x)
    assert out.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected)


def test_verify_runs_a_mixed_folder_in_float32(tmp_path):
    import argparse
    from pipecc.runtime.rank import run_precision
    ns = argparse.Namespace(out=tmp_path, precision=None, verify=True, verify_stages_only=False)
    assert run_precision(ns, {"precision": "bf16"}) is None
    ns.verify = False
    assert run_precision(ns, {"precision": "bf16"}) == "bf16"
    ns.precision = "fp32"
    assert run_precision(ns, {"precision": "bf16"}) is None
    ns.precision = "fp16"
    assert run_precision(ns, {}) == "fp16"


@pytest.mark.parametrize("argv, message", [
    (["--precision", "bf16", "--bipartition", "auto"], "does not run Bi-Partition"),
    (["--precision", "bf16", "--devices", "cpu,u250"], "FPGA"),
])
def test_bad_precision_requests_are_one_line(argv, message, capsys, tmp_path):
    devices = [] if "--devices" in argv else ["--devices", "2xcpu"]
    code, out, err = run_cli(["plan", str(ROOT / "models" / "mlp.py"), "-b", "8", *devices, *argv], capsys)
    assert code in (1, 2) and message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


def test_unknown_precision_is_a_usage_error():
    with pytest.raises(UsageError, match="--precision 'fp8'"):
        PlanOptions(precision="fp8")
