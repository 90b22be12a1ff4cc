"""The planner in pieces (issue 18, item 5): `PlanOptions` is the one definition of the plan
options (the CLI, `driver.plan` and `pipecc.compile` build it; a bad value or an unknown name is
one line), and the technique passes ask the typed `Evaluator` for problems, timelines and
candidates, whose timeline is what the evaluator's `simulate` gives for the same cuts."""
from __future__ import annotations

import ast
import dataclasses
import re

import pytest
import torch

from helpers import ROOT
from pipecc import driver
from pipecc.cli.app import build_parser
from pipecc.cli.plan import options_from_args
from pipecc.errors import UsageError
from pipecc.ir.schedule.registry import TRAINING_SCHEDULES
from pipecc.models import mlp
from pipecc.passes.plan_emit import lower_bound
from pipecc.passes.plan_options import PlanOptions
from pipecc.passes.plan_search import Planner
from pipecc.targets.devices import parse_devices

MLP = ROOT / "models" / "mlp.py"


@pytest.fixture(scope="module")
def graph():
    return driver.analyze(MLP, model_args=dict(mlp.TINY), batch_size=8).graph


@pytest.mark.parametrize("field,value,words", [
    ("schedule", "pipedream", "--schedule 'pipedream': choose auto, " + ", ".join(TRAINING_SCHEDULES[:-1])),
    ("recompute", "some", "--recompute 'some': choose none, full or auto"),
    ("replicas", 0, "--replicas 0: use auto or a positive integer"),
    ("replicas", True, "--replicas True: use auto or a positive integer"),
    ("bipartition", "on", "--bipartition 'on': choose off or auto"),
    ("activation_balancing", "yes", "--activation-balancing 'yes': choose auto, on or off"),
])
def test_a_bad_option_is_one_line_wherever_it_comes_from(graph, field, value, words):
    with pytest.raises(UsageError) as exc:
        PlanOptions(**{field: value})
    assert words in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(UsageError, match="^" + re.escape(words)):
        driver.plan(graph, "2xcpu", **{field: value})


def test_an_unknown_option_names_the_known_ones(graph):
    with pytest.raises(UsageError, match="unknown plan option 'micro_batches'; the plan options are .*microbatches"):
        driver.plan(graph, "2xcpu", micro_batches=2)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    with pytest.raises(UsageError, match="unknown plan option 'replica'"):
        import pipecc
        pipecc.compile(model, torch.randn(2, 4), "2xcpu", replica=1)


def test_options_or_keywords_make_the_same_plan(graph):
    opts = PlanOptions(microbatches=2, schedule="gpipe", split_layers=False)
    by_options, _ = driver.plan(graph, "2xcpu", opts)
    by_keywords, _ = driver.plan(graph, "2xcpu", microbatches=2, schedule="gpipe", split_layers=False)
    overridden, _ = driver.plan(graph, "2xcpu", opts, schedule="1f1b")
    assert by_options.to_json() == by_keywords.to_json()
    assert (by_options.schedule, overridden.schedule, overridden.microbatches) == ("gpipe", "1f1b", 2)


def test_the_command_line_converts_every_plan_flag_once():
    """Every `add_plan_args` flag lands in its PlanOptions field; the fields the CLI has no flag
    for keep the defaults (batch_size comes from -b through the analysis)."""
    args = build_parser().parse_args([
        "plan", str(MLP), "--devices", "2xcpu", "-m", "4", "--schedule", "zb-h1", "--replicas", "2",
        "--microbatch-sizes", "auto", "--bipartition", "auto", "--coarse", "--choose-order",
        "--no-split-layers", "--recompute", "auto", "--activation-balancing", "off",
        "--flash-attention", "--fpga-number", "ap_fixed<16,6>", "--compare", "--use-all-devices",
        "--precision", "fp32"])
    got = options_from_args(args, profile=None)
    want = dict(microbatches=4, schedule="zb-h1", replicas=2, microbatch_sizes="auto",
                bipartition="auto", coarse=True, choose_order=True, split_layers=False,
                recompute="auto", activation_balancing="off", flash_attention=True,
                fpga_number="ap_fixed<16,6>", compare=True, training=True, profile=None, calibrate=None,
                use_all_devices=True, precision="fp32")
    assert {k: getattr(got, k) for k in want} == want
    mixed = build_parser().parse_args(["plan", str(MLP), "--devices", "2xcpu", "--precision", "bf16"])
    assert options_from_args(mixed, profile=None).precision == "bf16"
    untouched = {f.name for f in dataclasses.fields(PlanOptions)} - set(want)
    assert untouched == {"batch_size", "optimizer_states", "dtype", "virtual_stages",
                         "umpipe_budget_s", "bipartition_window"}
    assert all(getattr(got, k) == getattr(PlanOptions(), k) for k in untouched)
    inference = options_from_args(build_parser().parse_args(
        ["plan", str(MLP), "--devices", "2xcpu", "--inference"]))
    assert inference.training is False and inference.replicas == "auto"  # the CLI's own default
    assert inference.use_all_devices is False  # the CLI may use fewer devices


def test_the_evaluators_timeline_is_its_simulation_of_the_same_cuts(graph):
    planner = Planner(graph, parse_devices("2xcpu,a100"), PlanOptions(batch_size=8, replicas="auto"))
    plan, best = planner.run()
    ev = planner.evaluator
    assert len({c.replicas for c in planner.results}) == 2  # 1 and 3: the search tried both
    for cand in planner.results:
        if cand.thresholds:
            continue
        again = ev.simulate(cand.part, cand.problem, cand.schedule, cand.microbatches, cand.virtual,
                            order=cand.order, allreduce=cand.allreduce or None)
        assert again.iteration_s == cand.timeline.iteration_s
        assert lower_bound(ev, cand) <= cand.part.bottleneck * (1 + 1e-9)
    fresh = ev.evaluate(best.schedule, best.microbatches, d=best.replicas)  # --recompute none: the same
    assert (fresh.part.bounds, fresh.timeline.iteration_s) == (best.part.bounds, best.timeline.iteration_s)
    assert plan.predicted_iteration_s == best.timeline.iteration_s


TECHNIQUES = ["pipecc/techniques/bpipe/search.py", "pipecc/techniques/recompute/search.py",
              "pipecc/techniques/replicas/search.py", "pipecc/techniques/umpipe/plan.py",
              "pipecc/techniques/bipartition/plan.py", "split_search", "split_layers", "split_forms"]


@pytest.mark.parametrize("name", TECHNIQUES)
def test_technique_passes_ask_the_typed_evaluator(name):
    """No technique pass takes an untyped balancer or reaches into a private simulator: a
    parameter typed `Any` named like one, `._simulate(` or `.opt.` is a regression."""
    source = (ROOT / name if "/" in name else ROOT / "passes" / f"{name}.py").read_text()
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for arg in node.args.args:
                assert arg.arg not in ("bal", "balancer"), (name, node.name)
        if isinstance(node, ast.Attribute):
            assert node.attr not in ("_simulate", "opt", "evaluate_candidate"), (name, node.lineno)
