"""The pass contract (`pipecc.passes.contract`): every step the driver runs declares what it reads,
what it produces and whether it changes its input; the two plan passes that used to edit the
Plan they were given (`umpipe_plan.apply`, `bipartition_plan.apply`) leave it as it was;
`recost` is a step like the others (verified, dumped); and `debug` holds a step to its contract."""
from __future__ import annotations

import ast
import copy
import dataclasses
import importlib

import pytest

from helpers import ROOT, zoo_path
from pipecc import driver
from pipecc.instruments import Instruments, State, Step
from pipecc.ir.graph import IRError
from pipecc.models import mlp
from pipecc import techniques
from pipecc.passes.contract import CONTRACTS, PRODUCIBLE, READABLE, Contract
from pipecc.passes.plan_options import PlanOptions
from pipecc.targets.devices import parse_devices

WIDE = dict(in_features=256, hidden=1024, depth=3, num_classes=256)  # Bi-Partition pays (test_bipartition_run)


def _driver_step_names() -> set[str]:
    """The names of the `Step(...)`s pipecc/driver.py builds (its first argument, a literal)."""
    tree = ast.parse((ROOT / "pipecc" / "driver.py").read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "Step"]
    # NOTE: a technique's step is named by its own contract (`technique_step.contract.name`)
    own = [c for c in calls if ast.unparse(c.args[0]) == "technique_step.contract.name"]
    assert calls and len(own) == 1 and all(isinstance(c.args[0], ast.Constant) for c in calls if c not in own)
    return {c.args[0].value for c in calls if c not in own}


def _technique_contracts() -> dict[str, Contract]:
    """The techniques' planning steps (`plan.STEP` of a technique package), by name."""
    steps = [getattr(part, "STEP", None) for part in techniques.parts("plan")]
    return {s.contract.name: s.contract for s in steps if s is not None}


def test_every_step_the_driver_runs_declares_its_contract() -> None:
    names = _driver_step_names()
    assert names == set(CONTRACTS), (names ^ set(CONTRACTS))  # none undeclared, none stale
    assert "recost" in names
    own = _technique_contracts()
    assert {"unequal micro-batches", "bipartition"} <= set(own) and not set(own) & set(CONTRACTS)
    for contract in [*CONTRACTS.values(), *own.values()]:
        assert set(contract.reads) <= set(READABLE) and set(contract.produces) <= set(PRODUCIBLE)
        module, _, attr = contract.implementation.partition(":")
        target = importlib.import_module(module)
        for part in attr.split("."):
            target = getattr(target, part)
        assert callable(target), contract


def test_only_an_annotation_changes_its_input() -> None:
    changing = sorted(c.name for c in CONTRACTS.values() if c.changes_input)
    assert changing == ["costs", "recost"]
    assert all(CONTRACTS[n].produces == ("costs",) for n in changing)
    with pytest.raises(ValueError, match="only an annotation"):
        Contract("edit the plan", ("plan",), ("plan",), "x:y", changes_input=True)
    with pytest.raises(ValueError, match="unknown part"):
        Contract("read the weather", ("weather",), ("plan",), "x:y")
    with pytest.raises(KeyError, match="declares no contract"):
        Step("an undeclared step", lambda state: None)


@pytest.fixture(scope="module")
def wide():
    analysis = driver.analyze(zoo_path("mlp"), model_args=WIDE, batch_size=32)
    fixed = dict(microbatches=8, replicas=1, split_layers=False)
    cluster = parse_devices("2xcpu")
    options, cluster = driver.resolve_options(PlanOptions.of(**fixed, schedule="1f1b"), analysis, cluster)
    plan, graph = driver.plan(analysis, cluster, options)
    return plan, graph, driver._evaluator(graph, cluster, options)


def test_bipartition_apply_leaves_its_plan_unchanged(wide) -> None:
    from pipecc.techniques.bipartition import plan as bipartition_plan
    plan, graph, ev = wide
    before = plan.dumps()
    result = bipartition_plan.apply(plan, ev, graph)
    assert plan.dumps() == before and not plan.is_bipartition()
    assert result is not plan and result.is_bipartition()  # it pays here: a new plan with the cut pair
    assert result.decisions[-1].startswith("Bi-Partition: ") and not any(
        d.startswith("Bi-Partition") for d in plan.decisions)


@pytest.mark.parametrize("mode", [[4, 4, 8, 16], "auto"])
def test_umpipe_apply_leaves_its_plan_unchanged(wide, mode) -> None:
    from pipecc.techniques.umpipe import plan as umpipe_plan
    plan, _, ev = wide
    before = plan.dumps()
    result = umpipe_plan.apply(plan, ev, mode, budget_s=0.5)
    assert plan.dumps() == before and plan.microbatch_sizes is None
    assert result is not plan and len(result.decisions) == len(plan.decisions) + 1
    if mode != "auto":
        assert result.microbatch_sizes == [mode, mode] and result.microbatches == 4


def test_recost_is_a_step_verified_and_dumped(tmp_path) -> None:
    dump = tmp_path / "ir"
    analysis = driver.analyze(zoo_path("mlp"), model_args=dict(mlp.TINY), batch_size=4, dump_ir=dump)
    driver.plan(analysis, "2xcpu", split_layers=False, flash_attention=True, precision="bf16", debug=True,
                dump_ir=dump)
    names = sorted(p.name for p in dump.iterdir())
    assert names == ["000_build.txt", "001_capture.txt", "002_costs.txt", "003_recost.txt", "004_balance.txt"]
    assert "fwd 1056*B FLOPs" in (dump / "003_recost.txt").read_text()  # the costed graph, as after costs


@pytest.fixture(scope="module")
def planned():
    analysis = driver.analyze(zoo_path("mlp"), model_args=dict(mlp.TINY), batch_size=4)
    return driver.plan(analysis, "2xcpu", split_layers=False)


def _run(step_fn, reads: str, produces: str, planned, debug: bool = True) -> State:
    plan, graph = planned
    state = State(graph=graph, costed=True, plan=copy.deepcopy(plan))
    contract = Contract("a test step", tuple(reads.split()), tuple(produces.split()), "tests:none")
    return Instruments(debug=debug).run([Step("a test step", step_fn, contract=contract)], state)


def test_debug_holds_a_step_to_its_contract(planned) -> None:
    def in_place(state: State) -> None:
        state.plan.decisions.append("edited in place")

    def as_a_copy(state: State) -> None:
        state.plan = dataclasses.replace(state.plan, decisions=[*state.plan.decisions, "a new plan"])

    def new_graph(state: State) -> None:
        state.graph = dataclasses.replace(state.graph)

    with pytest.raises(IRError, match="changed the plan it read in place"):
        _run(in_place, "graph plan", "plan", planned)
    _run(in_place, "graph plan", "plan", planned, debug=False)  # unchecked without debug
    assert _run(as_a_copy, "graph plan", "plan", planned).plan.decisions[-1] == "a new plan"
    with pytest.raises(IRError, match="replaced the state's plan, which its contract does not produce"):
        _run(as_a_copy, "graph plan", "", planned)
    with pytest.raises(IRError, match="replaced the state's graph"):
        _run(new_graph, "graph", "plan", planned)


def test_the_plan_choosers_leave_their_plans_unchanged(planned) -> None:
    """`device_count.remap` and `replicas.faster_of` (the driver's choice between a plan over
    every device and one over fewer) return new plans."""
    from pipecc.passes import device_count
    from pipecc.techniques.replicas import search as replicas
    plan, graph = planned
    before = plan.dumps()
    moved = device_count.remap(plan, [2, 3])
    assert plan.dumps() == before
    assert [d["given_index"] for d in moved.devices] == [[2, 3][d.get("given_index", 0)] for d in plan.devices]
    other = dataclasses.replace(moved, predicted_iteration_s=plan.predicted_iteration_s * 2)
    kept, _ = replicas.faster_of((plan, graph), (other, graph), [0, 1], [], "")
    assert plan.dumps() == before and kept is not plan and kept.decisions[:-1] == plan.decisions
