"""Each technique's one rule (`pipecc.techniques.<t>.requires`) gives the same answer
wherever it is asked: the planner (an error or a decision line naming the same reason), the
plan verifier (`verify_plan`: an IRError with the line), compile (a PipeccError with the line,
nothing written) and the folder loader (`pipecc run` on a compiled folder whose plan.json was
edited into the case: exit 1 and the same line). And docs/techniques.md's composition matrix is
the rules' (`pipecc.techniques.matrix`)."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest

from helpers import ROOT, run_cli, zoo_path
from pipecc import driver
from pipecc.errors import PipeccError
from pipecc import techniques
from pipecc.ir.graph import IRError
from pipecc.ir.plan import Plan
from pipecc.techniques import matrix
from pipecc.ir.verify import verify_plan
from pipecc.runtime.admit import check_folder_plan

MLP = str(zoo_path("mlp"))


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[Any, Plan, Any, Path]:
    """The mlp planned on two CPUs under 1f1b (4 micro-batches of 2), and its compiled folder."""
    analysis = driver.analyze(MLP, batch_size=8)
    plan, graph = driver.plan(analysis, "cpu,cpu", microbatches=4, schedule="1f1b", replicas=1,
                              split_layers=False, activation_balancing="off")
    out = tmp_path_factory.mktemp("techniques") / "out"
    driver.compile(analysis, plan, graph, out)
    return analysis, plan, graph, out


def _copy(plan: Plan) -> Plan:
    return Plan.from_json(json.loads(plan.dumps()))


def _bpipe(p: Plan) -> None:
    p.schedule = "gpipe"
    p.activation_balancing = [{"evictor": 0, "acceptor": 1, "threshold": 1, "policy": "jit"}]


def _umpipe(p: Plan) -> None:
    p.schedule, p.microbatches, p.microbatch_sizes = "zb-h1", 3, [[1, 3, 4], [2, 2, 4]]


def _bipartition(p: Plan) -> None:
    p.schedule, p.bipartition_mode = "zb-h1", "ship"
    first, second = p.stages
    first.backward_nodes, second.backward_nodes = first.nodes[:-1], first.nodes[-1:] + second.nodes


def _recompute(p: Plan) -> None:
    p.schedule, p.options["training"] = "inference", False
    p.stages[0].recompute = True


def _fpga(p: Plan, index: int) -> None:
    p.devices[index] = {**p.devices[index], "name": "u250", "kind": "fpga"}


def _replicas(p: Plan) -> None:  # 4 devices, stage j on [2j, 2j+1], device 0 an FPGA card
    p.devices = [dict(p.devices[0]) for _ in range(4)]
    _fpga(p, 0)
    p.replicas = 2
    for j, s in enumerate(p.stages):
        s.device, s.replica_devices = 2 * j, [2 * j, 2 * j + 1]


def _zero_bubble(p: Plan) -> None:
    p.schedule = "zb-h1"
    _fpga(p, 1)


def _planner_error(**kwargs: Any) -> Callable[[Any], str]:
    """The planner's one-line refusal for these options."""
    def ask(analysis: Any) -> str:
        with pytest.raises(PipeccError) as caught:
            driver.plan(analysis, **{"devices": "cpu,cpu", "microbatches": 4, "split_layers": False, **kwargs})
        return str(caught.value)
    return ask


def _planner_decision(**kwargs: Any) -> Callable[[Any], str]:
    """The planner's decision lines for these options (a technique "auto" does not try)."""
    def ask(analysis: Any) -> str:
        plan, _ = driver.plan(analysis, **{"devices": "cpu,cpu", "microbatches": 4, "split_layers": False,
                                           **kwargs})
        return "\n".join(plan.decisions)
    return ask


# technique -> (edit of the base plan into a case its rule refuses, the planner asked the same)
CASES = {
    techniques.bpipe: (_bpipe, _planner_error(schedule="gpipe", activation_balancing="on")),
    techniques.umpipe: (_umpipe, _planner_error(schedule="zb-h1", microbatch_sizes="1,3,4")),
    techniques.bipartition: (_bipartition, _planner_decision(schedule="zb-h1", replicas=1, bipartition="auto",
                                                             activation_balancing="off")),
    techniques.recompute: (_recompute, _planner_error(training=False, recompute="full")),
    techniques.replicas: (_replicas, _planner_error(devices="cpu,u250", replicas=2)),
    techniques.zero_bubble: (_zero_bubble, _planner_error(devices="cpu,u250", schedule="zb-h1")),
}


def test_every_technique_has_a_case() -> None:
    assert set(CASES) == set(techniques.TECHNIQUES)


@pytest.mark.parametrize("technique", list(CASES), ids=lambda t: t.NAME)
def test_one_answer_in_planner_verifier_compile_and_loader(base, tmp_path: Path, capsys, technique) -> None:
    analysis, plan, graph, out = base
    edit, planner = CASES[technique]
    bad = _copy(plan)
    edit(bad)
    reason = technique.requires(bad, techniques.COMPILED)
    assert reason is not None and reason.startswith(technique.TAG) and "\n" not in reason
    assert techniques.requires(bad) == reason  # the first rule the plan's techniques break
    # the planner, asked for the same thing, gives the same reason (after the option it names)
    assert reason in planner(analysis)
    # the verifier
    with pytest.raises(IRError) as caught:
        verify_plan(graph, bad)
    assert str(caught.value) == reason
    # compile: the line, nothing written
    target = tmp_path / "out"
    with pytest.raises(PipeccError) as caught:
        driver.compile(analysis, bad, graph, target)
    assert str(caught.value) == reason and not target.exists()
    # the loader: the compiled folder with this plan.json
    folder = tmp_path / "edited"
    shutil.copytree(out, folder)
    (folder / "plan.json").write_text(bad.dumps())
    marker = json.loads((folder / "pipecc.json").read_text())
    with pytest.raises(PipeccError) as caught:  # the loader's own check, as every rank asks it
        check_folder_plan(marker, json.loads(bad.dumps()), None)
    assert str(caught.value) == reason
    code, stdout, err = run_cli(["run", str(folder), "--print-command"], capsys)
    counts = ("replicas", "batch_size", "microbatches")
    if all(getattr(bad, k) == getattr(plan, k) for k in counts):
        assert (code, stdout, err) == (1, "", f"pipecc: error: {reason}\n")
    else:  # pipecc.json's counts no longer match the edited plan.json: that line comes first
        assert (code, stdout) == (1, "") and err.startswith("pipecc: error: ") and err.count("\n") == 1, err
        assert "was compiled with" in err, err


def test_the_unedited_folder_is_admitted(base, capsys) -> None:
    analysis, plan, graph, out = base
    assert techniques.requires(plan) is None
    code, stdout, err = run_cli(["run", str(out), "--print-command"], capsys)
    assert code == 0 and err == "" and "torch.distributed.run" in stdout


def test_a_run_schedule_the_folder_cannot_take_names_it(base, tmp_path: Path, capsys) -> None:
    """pipecc.json's BPipe pairs under `--schedule gpipe`: BPipe's line, after the option."""
    analysis, plan, graph, out = base
    folder = tmp_path / "bp"
    shutil.copytree(out, folder)
    marker = json.loads((folder / "pipecc.json").read_text())
    marker["activation_balancing"] = [{"evictor": 0, "acceptor": 1, "threshold": 1, "policy": "jit"}]
    (folder / "pipecc.json").write_text(json.dumps(marker))
    code, _, err = run_cli(["run", str(folder), "--print-command", "--schedule", "gpipe"], capsys)
    with_pairs = dataclasses.replace(_copy(plan), schedule="gpipe", activation_balancing=marker["activation_balancing"])
    assert code == 2 and err == (f"pipecc: error: --schedule gpipe: {techniques.bpipe.requires(with_pairs, techniques.COMPILED)}"
                                 " (or drop --schedule)\n")


def test_the_drop_in_module_lacks_stash_transfer(base) -> None:
    """BPipe needs a process per rank: the drop-in module's capabilities refuse it, in one line."""
    analysis, plan, graph, out = base
    paired = _copy(plan)
    paired.activation_balancing = [{"evictor": 0, "acceptor": 1, "threshold": 1, "policy": "jit"}]
    reason = techniques.bpipe.requires(paired, techniques.DROP_IN)
    assert reason is not None and "drop-in module" in reason and techniques.requires(paired) is None
    with pytest.raises(PipeccError) as caught:
        driver.compile_module(analysis.spec.model, graph, paired, analysis.spec.example_inputs)
    assert str(caught.value) == reason


def test_docs_matrix_is_the_rules() -> None:
    """docs/techniques.md between its markers is `matrix.markdown()` (regenerate with
    `python -m pipecc.techniques.matrix`)."""
    text = (ROOT / "docs" / "techniques.md").read_text()
    begin, end = "<!-- matrix:begin -->\n", "<!-- matrix:end -->"
    shown = text[text.index(begin) + len(begin):text.index(end)]
    assert shown == matrix.markdown(), "docs/techniques.md is stale: python -m pipecc.techniques.matrix"


def test_the_matrix_is_symmetric_in_what_composes() -> None:
    names = list(matrix.TURN_ON)
    for a in names:
        assert techniques.requires(matrix.with_on(a)) is None  # every technique alone is admitted
        for b in names:
            if a != b:
                assert (matrix.pair(a, b) is None) == (matrix.pair(b, a) is None), (a, b)


def test_every_technique_lowers_and_leaves_a_plan_without_it_alone() -> None:
    """Each technique has one `lower`, applied in LOWERING order by `schedule_of`; on a plan that
    does not use it, it returns the schedule it was given (the same object)."""
    from pipecc.ir.schedule import one_f_one_b
    assert set(techniques.LOWERING) == set(techniques.TECHNIQUES)
    plain = matrix.base()
    base = one_f_one_b(len(plain.stages), plain.microbatches)
    assert techniques.schedule_of(plain) == base
    for technique in techniques.TECHNIQUES:
        assert technique.lower(plain, base) is base, technique.NAME
    used = _copy(plain)
    used.replicas = 2
    matrix.place(used)
    assert techniques.replicas.lower(used, base) != base  # REDUCE actions added


def _lowered(plan: Plan, order: tuple) -> Any:
    from pipecc.ir.schedule.registry import VIRTUAL, schedule_for
    n = len(plan.stages)
    v = max(plan.virtual_stages, 1) if plan.schedule in VIRTUAL else 1
    schedule = schedule_for(plan.schedule, n, plan.microbatches, num_ranks=n // v)
    for technique in order:
        schedule = technique.lower(plan, schedule)
    return schedule


def test_lowering_is_ordered_by_the_packages_phases() -> None:
    """LOWERING comes from each package's `LOWERS` (by `PHASES`, then TECHNIQUES order), and gives
    the schedules the hand-written order gave before (zero-bubble, recompute, UMPIPE, BPipe,
    replicas, Bi-Partition) on every plan of the matrix: each technique alone and every pair."""
    assert all(t.LOWERS in techniques.PHASES for t in techniques.TECHNIQUES)
    phases = [techniques.PHASES.index(t.LOWERS) for t in techniques.LOWERING]
    assert phases == sorted(phases)
    t = techniques
    before = (t.zero_bubble, t.recompute, t.umpipe, t.bpipe, t.replicas, t.bipartition)
    names = list(matrix.TURN_ON)
    for a in names:
        for b in names:
            plan = matrix.with_on(a) if a == b else matrix.with_on(a, b)
            try:
                want = _lowered(plan, before)
            except ValueError:
                continue  # not buildable either way (a refused pair)
            assert _lowered(plan, techniques.LOWERING) == want, (a, b)


def test_techniques_of_one_phase_commute_or_never_meet() -> None:
    """Two techniques whose `lower` shares a phase (not "unchanged"): on the matrix's plan with
    both on, a rule refuses the plan, or their lowerings in either order give one schedule."""
    by_name = {t.NAME: t for t in techniques.TECHNIQUES}
    for a in techniques.TECHNIQUES:
        for b in techniques.TECHNIQUES:
            if a is b or a.LOWERS != b.LOWERS or a.LOWERS == "unchanged":
                continue
            for order in ((a.NAME, b.NAME), (b.NAME, a.NAME)):
                plan = matrix.with_on(*order)
                if not (a.uses(plan) and b.uses(plan)):
                    continue
                assert techniques.requires(plan) is not None or (
                    _lowered(plan, (a, b)) == _lowered(plan, (b, a))), order
    assert by_name["replicas"].LOWERS == by_name["Bi-Partition"].LOWERS == "collectives"


def test_plan_options_fields_are_the_packages_switches_and_settings() -> None:
    """`PlanOptions` is `BaseOptions` plus a field per technique switch (`OPTIONS`: its `dest`,
    with the Python API's default) and per technique setting (`SETTINGS`)."""
    from pipecc.passes.plan_options import BaseOptions, PlanOptions
    fields = {f.name: f.default for f in dataclasses.fields(PlanOptions)}
    base = {f.name for f in dataclasses.fields(BaseOptions)}
    declared = {o.dest: o.planner_default for t in techniques.TECHNIQUES for o in getattr(t, "OPTIONS", ())}
    declared |= {s.dest: s.default for t in techniques.TECHNIQUES for s in getattr(t, "SETTINGS", ())}
    assert {k: v for k, v in fields.items() if k not in base} == declared
    assert PlanOptions().activation_balancing == "off" and techniques.bpipe.OPTIONS[0].default == "auto"
