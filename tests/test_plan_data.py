"""A technique's side data in the plan (`pipecc.ir.plan_data`): typed by its package, kept in
plan.json's "options" where it always was (byte-identical), typed on reading whatever the
process imported before, and a value its type cannot write back as read stays an option."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import ROOT
from pipecc import techniques
from pipecc.ir import plan_data
from pipecc.ir.plan import Plan
from pipecc.techniques.bipartition.data import BipartitionCosts, BipartitionSearch
from pipecc.techniques.umpipe.data import UmpipeChunkCosts, UmpipeSearch

SEARCH = UmpipeSearch(generations=3, seconds=0.5, stopped="budget", edp_s=1.25, edp_sizes=[4, 4],
                      baselines={"local-greedy": {"sizes": [[3, 5]], "iteration_s": 1.5}})
CHUNKS = UmpipeChunkCosts(stage_figures_microbatch=4, forward_s=[[0.1, 0.2]], backward_s=[[0.2, 0.4]],
                          send_forward_s=[[0.0, 0.0]], send_backward_s=[[0.0, 0.0]],
                          activation_bytes=[[8.0, 16.0]], static_bytes=[64.0], tail_s=[0.01])
BI = BipartitionSearch(used=False, window=8, mode="ship", single_iteration_s=1.0, single_bottleneck_s=0.5,
                       recompute_bottleneck_s=None, recompute_iteration_s=1.0, best_ship_bottleneck_s=0.5)
BI_COSTS = BipartitionCosts((0.1, 0.0), (0.0, 0.1), (0.2, 0.3))


def _plan(*values) -> Plan:
    plan = techniques.sketch(schedule="gpipe", devices=[{"kind": "cpu", "name": "cpu"}] * 2)
    plan.options["devices_given"] = 2
    return plan.with_data(*values)


def test_the_kinds_are_the_packages_data_in_techniques_order() -> None:
    assert plan_data.kinds() == tuple(k for t in techniques.TECHNIQUES for k in getattr(t, "DATA", ()))
    assert plan_data.kinds() == (UmpipeSearch, UmpipeChunkCosts, BipartitionSearch, BipartitionCosts)


def test_plan_json_keeps_the_data_in_options_in_one_order_whatever_order_it_was_added() -> None:
    plan = _plan(BI_COSTS, CHUNKS, BI, SEARCH)
    data = json.loads(plan.dumps())
    assert list(data["options"]) == ["training", "umpipe", "umpipe_chunk_costs", "bipartition",
                                     "bipartition_costs", "devices_given"]
    assert "technique_data" not in data and data["options"]["umpipe_chunk_costs"]["tail_s"] == [0.01]
    again = Plan.from_json(json.loads(plan.dumps()))
    assert again == plan and again.dumps() == plan.dumps()
    assert [again.data(k) for k in (UmpipeSearch, UmpipeChunkCosts, BipartitionSearch, BipartitionCosts)] == [
        SEARCH, CHUNKS, BI, BI_COSTS]
    assert _plan().data(UmpipeSearch) is None and plan.with_data(BI).data(BipartitionSearch) is BI


def test_with_data_leaves_the_plan_it_copies_alone() -> None:
    plan = _plan(SEARCH)
    other = plan.with_data(BI)
    assert plan.data(BipartitionSearch) is None and other.data(UmpipeSearch) is SEARCH


@pytest.mark.parametrize("tail", ["saved", "none", "absent"])
def test_umpipe_chunk_costs_round_trip_with_and_without_tails(tail: str) -> None:
    """A plan without tails writes `"tail_s": null`; one from before the one cost model has no
    `tail_s` at all: each reads back typed and writes out as it was."""
    data = json.loads(_plan(CHUNKS).dumps())
    raw = data["options"]["umpipe_chunk_costs"]
    if tail == "none":
        raw["tail_s"] = None
    elif tail == "absent":
        del raw["tail_s"]
    plan = Plan.from_json(json.loads(json.dumps(data)))
    saved = plan.data(UmpipeChunkCosts)
    assert saved is not None and "umpipe_chunk_costs" not in plan.options
    assert saved.has_tail == (tail != "absent") and ("tail_s" in saved.costs()) == saved.has_tail
    assert plan.dumps() == json.dumps(data, indent=1)


@pytest.mark.parametrize("edit", [{"umpipe": 7}, {"umpipe": None}, {"umpipe_chunk_costs": {"has_tail": False}},
                                  {"bipartition_costs": [1, 2]}, {"bipartition": {"used": True}}])
def test_a_hand_edited_value_stays_an_option(edit: dict) -> None:
    data = json.loads(_plan(SEARCH, CHUNKS, BI, BI_COSTS).dumps())
    for key, value in edit.items():
        if isinstance(value, dict) and key == "umpipe_chunk_costs":
            data["options"][key].update(value)
        else:
            data["options"][key] = value
    plan = Plan.from_json(json.loads(json.dumps(data)))
    (key,) = edit
    assert key not in plan.technique_data and key in plan.options
    assert len(plan.technique_data) == 3 and plan.dumps() == json.dumps(data, indent=1)


READ = textwrap.dedent("""
    import json, sys
    {imports}
    text = open(sys.argv[1]).read()
    plan = {read}
    names = sorted(type(v).__module__ + "." + type(v).__name__ for v in plan.technique_data.values())
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("sympy", "torch", "numpy")
                    or m.startswith(("pipecc.passes", "pipecc.backends", "pipecc.driver")))
    print(json.dumps({{"names": names, "same": plan.dumps() == text, "loaded": loaded}}))
""")


@pytest.mark.parametrize("imports,read", [
    ("from pipecc.ir.plan import Plan", "Plan.from_json(json.loads(text))"),
    ("from pipecc.runtime.folder_data import read_typed_plan",
     "read_typed_plan(sys.argv[2])"),
], ids=["ir-only", "runtime-loader"])
def test_a_fresh_process_reads_the_data_typed(tmp_path: Path, imports: str, read: str) -> None:
    """Nothing of the techniques imported before the read (a fresh process that imports only the
    plan, or the runtime's folder reader, which imports no compiler): the data is typed, the
    plan writes back byte-identical, and no compiler module or heavy library came with it."""
    path = tmp_path / "plan.json"
    path.write_text(_plan(SEARCH, CHUNKS, BI, BI_COSTS).dumps())
    script = READ.format(imports=imports, read=read)
    done = subprocess.run([sys.executable, "-c", script, str(path), str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["names"] == sorted(f"{k.__module__}.{k.__name__}" for k in plan_data.kinds())
    assert got["same"] and got["loaded"] == [], got
