"""Per-device cost models (`pipecc.targets.timing`, `pipecc.targets.fpga_timing`): each answers
what the roofline and FPGA formulas say, the balance pass picks one per device, and a model
that refuses a unit keeps the partitioner off that device for it."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from pipecc import driver
from pipecc.passes.plan_options import PlanOptions
from pipecc.passes.plan_search import Planner
from pipecc.targets import fpga_model
from pipecc.targets.devices import load_catalog, parse_devices
from pipecc.targets.fpga_timing import BRAM18_BYTES, FpgaCosts
from pipecc.targets.timing import CANNOT_RUN_S, MEMORY_HEADROOM, RooflineCosts


def _graph(width: int = 32, batch: int = 4):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width),
                          nn.Softmax(dim=-1), nn.Linear(width, 8))
    return driver.analyze_module(model.eval(), (torch.randn(batch, width),))


def test_roofline_costs_are_the_device_roofline():
    bal = Planner(_graph(), parse_devices("a100"), PlanOptions(batch_size=4))
    units = bal.tables.builder.at(2)
    dev = load_catalog().device("a100")
    v = units.values
    for training in (True, False):
        costs = RooflineCosts(dev, dtype="fp32", training=training, optimizer_states=2)
        fwd, bwd = costs.unit_times(units, 2)
        for u in range(units.n):
            assert fwd[u] == dev.compute_time(v["forward_flops"][u], v["forward_flops_matmul"][u],
                                              v["bytes_moved"][u], "fp32")
            want = dev.compute_time(v["backward_flops"][u], v["backward_flops_matmul"][u],
                                    2 * v["bytes_moved"][u], "fp32") if training else 0.0
            assert bwd[u] == want
        mem = costs.memory(units, 2)
        assert np.array_equal(mem.static, units.param_bytes * (4 if training else 1))
        assert np.array_equal(mem.act, v["stash_bytes"] if training else np.zeros(units.n))
        assert mem.cap == dev.memory_bytes * MEMORY_HEADROOM / 2 and mem.inflight is None
        assert costs.floor_times(2) is None and costs.stage_times(range(2), fwd[:2], 2) is None
        assert not costs.one_tensor_boundaries and costs.plan_options() == {}


def test_fpga_costs_are_the_fpga_model():
    graph = _graph()
    bal = Planner(graph, parse_devices("cpu,u250"), PlanOptions(batch_size=4, training=False))
    costs = bal.tables.costs[1]
    assert isinstance(costs, FpgaCosts) and isinstance(bal.tables.costs[0], RooflineCosts)
    units, mb = bal.tables.builder.at(4), 4
    fwd, bwd = costs.unit_times(units, mb)
    assert not bwd.any()
    refused = [u for u, g in enumerate(bal.tables.builder.groups)
               if not all(fpga_model.supported(n) for n in g)]
    assert refused and all(fwd[u] == CANNOT_RUN_S for u in refused)     # the softmax
    for u, g in enumerate(bal.tables.builder.groups):
        if u in refused:
            continue
        nodes = [n for n in g if n.op != "get_attr"]
        lat, ii, floor, clock, bram = fpga_model.unit_cycles(nodes, "u250", "fp32", gm=graph.gm,
                                                             point=graph.point)
        assert fwd[u] == (lat + (mb - 1) * ii) / clock
        assert costs.floor_times(mb)[0][u] == mb * floor / clock <= fwd[u]
        assert costs.memory(units, 1).static[u] == bram * BRAM18_BYTES
    mem = costs.memory(units, 1)
    assert mem.inflight == 0 and mem.what == "on-chip BRAM" and not mem.act.any()
    assert costs.one_tensor_boundaries and costs.plan_options() == {"fpga_number": "float"}
    assert [n.meta["pipecc.op"] for n in costs.unsupported_nodes()] == ["softmax"]


def test_devices_of_one_type_share_one_model():
    bal = Planner(_graph(), parse_devices("cpu,u250,cpu,u250"), PlanOptions(batch_size=4))
    assert bal.tables.costs[0] is bal.tables.costs[2] and bal.tables.costs[1] is bal.tables.costs[3]
    assert bal.tables.costs[0] is not bal.tables.costs[1]


class _Refuses(RooflineCosts):
    """A roofline device that cannot run the units in `refused`."""

    def __init__(self, base: RooflineCosts, refused: set[int]) -> None:
        super().__init__(base.device, base.dtype, base.training, base.optimizer_states)
        self.refused = refused

    def unit_times(self, units, mb):
        fwd, bwd = super().unit_times(units, mb)
        for u in self.refused:
            fwd[u] = bwd[u] = CANNOT_RUN_S
        return fwd, bwd


@pytest.mark.parametrize("device, refused", [(0, {1}), (1, {3})])
def test_the_balancer_asks_each_device_model(device, refused):
    """Swap one device's model: the plan keeps the refused unit off that device (here that
    forces the cut next to it), with a lower bound that knows it cannot run there."""
    opts = PlanOptions(batch_size=4, microbatches=1, training=False, split_layers=False)
    bal = Planner(_graph(), parse_devices("cpu,cpu"), opts)
    bal.tables.costs[device] = _Refuses(bal.tables.costs[device], refused)
    plan, cand = bal.run()
    names = bal.tables.builder.at(4).names
    held = {nm for s in plan.stages if s.device == device for nm in s.nodes}
    assert not any(nm in held for u in refused for nm in names[u])
    assert plan.bottleneck_s < CANNOT_RUN_S and plan.lower_bound_s <= plan.bottleneck_s
