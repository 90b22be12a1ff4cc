"""The balance pass on FPGA cards: stage times from the FPGA model of estimates.json, one-tensor
stage boundaries, on-chip memory, and a lower bound that no placement beats."""
from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from pipecc import driver
from pipecc.targets import fpga_model
from pipecc.backends.fpga.pipeline import check_boundary
from pipecc.backends.torch import cut_stages
from pipecc.targets.devices import parse_devices
from pipecc.errors import PipeccError
from pipecc.passes.plan_options import PlanOptions
from pipecc.passes.plan_search import Planner
from pipecc.targets.timing import CANNOT_RUN_S


class ResidualMLP(nn.Module):
    """Blocks y = x + fc2(relu(fc1(x))): inside a block the skip x crosses every cut."""

    def __init__(self, width: int = 64, blocks: int = 3, classes: int = 10) -> None:
        super().__init__()
        self.fc1 = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))
        self.fc2 = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for f1, f2 in zip(self.fc1, self.fc2):
            x = x + f2(torch.relu(f1(x)))
        return self.head(x)


class SkipToEnd(nn.Module):
    """The model input is used by the last op, so every cut carries two tensors."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))) + x


class BigFirst(nn.Module):
    """A Linear(4096, 4096) (512 Mbit of fp32 weights) cannot sit in a u250's 81 Mbit BRAM."""

    def __init__(self) -> None:
        super().__init__()
        self.big, self.small = nn.Linear(4096, 4096), nn.Linear(4096, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.small(torch.relu(self.big(x)))


def _graph(model: nn.Module, batch: int = 4, width: int = 64):
    torch.manual_seed(0)
    return driver.analyze_module(model.eval(), (torch.randn(batch, width),))


def test_fpga_stage_time_is_the_fpga_model_time_of_the_whole_stage():
    graph = _graph(ResidualMLP())
    plan, graph = driver.plan(graph, "cpu,u250,cpu", training=False, microbatches=1)
    (k, stage), = [(s.index, s) for s in plan.stages if plan.devices[s.device]["kind"] == "fpga"]
    nodes = [n for n in graph.gm.graph.nodes if n.meta.get("pipecc.name") in set(stage.nodes)
             and n.op != "get_attr"]
    est = fpga_model.stage_estimate(fpga_model.plan_layers(graph.gm, nodes, graph.point), "u250")
    mb = plan.batch_size // plan.microbatches
    want = (est["latency_cycles"] + (mb - 1) * est["interval_cycles"]) / est["clock_hz"]
    assert stage.forward_s == pytest.approx(want, rel=1e-12)
    assert stage.forward_s == pytest.approx(
        fpga_model.stage_time_s(nodes, "u250", "float", mb, gm=graph.gm, point=graph.point), rel=1e-12)
    assert plan.options["fpga_number"] == "float"
    # forward-only: transfers stream overlapped with compute (passes/partition.py)
    assert plan.bottleneck_s >= max(s.forward_s for s in plan.stages) * (1 - 1e-12)


def test_fpga_stage_boundaries_carry_one_tensor():
    graph = _graph(ResidualMLP())
    bal = Planner(graph, parse_devices("cpu,u250,cpu"), PlanOptions(batch_size=4, training=False))
    ok = bal.tables.builder.one_tensor_cut
    names = [[n.name for n in g] for g in bal.tables.builder.groups]
    inside = [s for s in range(1, len(names)) if names[s - 1][-1].startswith(("fc1", "relu"))]
    assert inside and not ok[inside].any()   # the skip crosses every cut inside a block
    assert ok.sum() >= 3                     # between blocks and before the head: one tensor
    for devices in ("cpu,u250,cpu", "u250,cpu", "cpu,u250"):
        plan, g = driver.plan(_graph(ResidualMLP()), devices, training=False, microbatches=1)
        stages = cut_stages(g, plan.stage_of())
        for s in plan.stages:
            if plan.devices[s.device]["kind"] == "fpga":
                check_boundary(stages[s.index], "u250")   # raises on a multi-tensor boundary


def test_no_one_tensor_cut_is_a_clear_error():
    with pytest.raises(PipeccError, match="needs a stage boundary of one float32 tensor"):
        driver.plan(_graph(SkipToEnd(), width=32), "cpu,u250", training=False, microbatches=1)
    with pytest.raises(PipeccError, match="leave the FPGA out of --devices"):
        driver.plan(_graph(SkipToEnd(), width=32), "cpu,u250", training=False, microbatches=1,
                    choose_order=True)


def test_fpga_on_chip_memory_keeps_big_layers_off_the_card():
    plan, _ = driver.plan(_graph(BigFirst(), width=4096), "cpu,u250", training=False,
                          microbatches=1, choose_order=True)
    fpga = next(s for s in plan.stages if plan.devices[s.device]["kind"] == "fpga")
    assert "big" not in fpga.nodes and fpga.peak_memory_bytes <= 4608 * 2304
    with pytest.raises(PipeccError, match=r"u250, on-chip BRAM.*--fpga-number"):
        driver.plan(_graph(BigFirst(), width=4096), "u250,cpu", training=False, microbatches=1,
                    split_layers=False)


@pytest.mark.parametrize("training", [False, True])
def test_lower_bound_holds_against_every_placement_on_an_fpga(training):
    """Exhaustive over the cuts of a small residual model on cpu,u250,cpu: the plan is the best
    placement once FPGA stages are re-costed to within the additive model's error, and no
    placement beats the planner's lower bound."""
    graph = _graph(ResidualMLP(blocks=2))
    cluster = parse_devices("cpu,u250,cpu")
    opts = PlanOptions(batch_size=4, microbatches=2, schedule="gpipe" if training else "auto",
                       training=training, split_layers=False)
    bal = Planner(graph, cluster, opts)
    plan, cand = bal.run()
    mb = 2
    prob = cand.raw
    n = len(bal.tables.builder.groups)
    best = min(bal.tables.recost(prob, (0, a, b, n), (0, 1, 2), mb)[1].bottleneck
               for a, b in itertools.combinations(range(1, n), 2))
    assert best < CANNOT_RUN_S
    assert plan.lower_bound_s <= best * (1 + 1e-12)
    assert plan.bottleneck_s <= 1.5 * best   # additive unit times steer the partitioner


def test_cli_plan_costs_fpga_stages_in_the_chosen_number_format(capsys):
    import json

    from helpers import ROOT
    from pipecc import cli
    args = ["plan", str(ROOT / "models" / "mlp.py"), "-b", "2", "--inference", "-q", "--json",
            "--devices", "cpu,u250,cpu", "--model-arg=in_features=64", "--model-arg=hidden=256",
            "--model-arg=depth=6", "--microbatches", "1"]
    times = {}
    for number in ("float", "ap_fixed<16,6>"):
        assert cli.main(args + ["--fpga-number", number]) == 0
        plan = json.loads(capsys.readouterr().out)
        assert plan["options"]["fpga_number"] == number
        times[number] = [s["forward_s"] for s in plan["stages"]
                         if plan["devices"][s["device"]]["kind"] == "fpga"]
    assert times["float"] and times["ap_fixed<16,6>"] and times["float"] != times["ap_fixed<16,6>"]
    assert cli.main(args + ["--fpga-number", "ap_fixed<99,3>"]) == 1
    assert "number format" in capsys.readouterr().err


class NormFirst(nn.Module):
    """A LayerNorm (no FPGA op) after the first Linear: the FPGA can only take the tail."""

    def __init__(self) -> None:
        super().__init__()
        self.fc0, self.norm = nn.Linear(64, 256), nn.LayerNorm(256)
        self.fc1, self.head = nn.Linear(256, 256), nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc1(self.norm(self.fc0(x)))))


def test_memory_short_elsewhere_is_blamed_on_memory_not_the_fpga(tmp_path):
    """The CPU holds fc0 (66.6 kB) but not fc0 + norm (68.6 kB; 90% of 75 kB usable), and the
    FPGA cannot take the norm: the error names memory, not the FPGA's ops."""
    (tmp_path / "c.toml").write_text(
        'devices = ["smallcpu", "u250"]\n'
        '[device.smallcpu]\nbase = "cpu"\nmemory_bytes = 75e3\nsource = "test"\n')
    spec = f"@{tmp_path / 'c.toml'}"
    plan, _ = driver.plan(_graph(NormFirst()), "cpu,u250", training=False, microbatches=1,
                          split_layers=False)
    assert "norm" in plan.stages[0].nodes and "norm" not in plan.stages[1].nodes
    with pytest.raises(PipeccError, match=r"no placement fits memory.*smallcpu.*more memory"):
        driver.plan(_graph(NormFirst()), spec, training=False, microbatches=1, split_layers=False)
