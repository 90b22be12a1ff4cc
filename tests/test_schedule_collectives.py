"""The schedule's collectives: the replica groups' gradient all-reduce (REDUCE) and Bi-Partition's
weight refresh (REFRESH) are actions of the schedule IR, inserted by a transform when the plan has
replicas or misplaced segments, written to schedule.txt and executed from it by the runtime.

In process: the text form round-trips them, the transforms put them right after a stage's last
gradient action (last F), the validator refuses misplaced or doubled ones, the plan's schedule
carries them and the simulator's view drops them (timelines unchanged). One launch proves the
runtime takes REDUCE from the file: a replicated folder whose schedule.txt moves every REDUCE to
the end of its row still passes --verify, and one without them is refused in one line.
"""

from __future__ import annotations

import pytest

from helpers import MLP_TINY, model_args, pipecc_here, run_cli
from pipecc import cli
from pipecc.ir.schedule import (Action, ActionKind, ScheduleError, format, forward_only, gradient_reduce,
                                interleaved_1f1b, lower, one_f_one_b, parse, validate, weight_refresh,
                                with_collectives, without_collectives, zb_h1)

R, F = ActionKind.REDUCE, ActionKind.REFRESH


def _index(row, kind: ActionKind, stage: int) -> int:
    return next(i for i, a in enumerate(row) if a.kind is kind and a.stage == stage)


@pytest.mark.parametrize("base", [one_f_one_b(3, 4), zb_h1(2, 3), interleaved_1f1b(2, 4, 2)])
def test_gradient_reduce_follows_each_stages_last_gradient_action(base) -> None:
    s = gradient_reduce(base)
    validate(s)
    for r, row in enumerate(s.actions):
        for stage in s.stages_of(r):
            last = max(i for i, a in enumerate(row) if a.stage == stage and a.kind.frees_stash)
            assert row[last + 1] == Action(R, stage, row[last].microbatch)
    assert without_collectives(s) == base
    assert gradient_reduce(s) == s  # idempotent
    assert parse(format(s)) == s and format(parse(format(s))) == format(s)
    assert forward_only(s) == forward_only(base)
    assert s.stash_profile() == base.stash_profile()


def test_weight_refresh_follows_the_stages_last_forward() -> None:
    base = one_f_one_b(3, 4)
    s = weight_refresh(base, [0, 1])
    validate(s)
    assert {a for row in s.actions for a in row if a.kind.is_collective} == {Action(F, 0, 3), Action(F, 1, 3)}
    for stage in (0, 1):
        row = s.actions[stage]
        assert row[_index(row, F, stage) - 1] == Action(ActionKind.F, stage, 3)
    assert without_collectives(s) == base and weight_refresh(s, [0, 1]) == s
    assert with_collectives(base, 1, []) == base
    both = with_collectives(base, 2, [1])
    assert parse(str(both)) == both and len([a for row in both.actions for a in row if a.kind.is_collective]) == 4


@pytest.mark.parametrize("base", [one_f_one_b(3, 4), zb_h1(2, 3), interleaved_1f1b(2, 4, 2)])
def test_a_lowered_schedule_lowers_to_itself(base) -> None:
    """The one lowering (compile's schedule.txt, the runtime's schedule built by name): REDUCE,
    then REFRESH, as ``with_collectives``; on a lowered schedule (a compiled schedule.txt, or one
    whose REDUCE sits later than the lowering puts it) it returns the same object, so the runtime
    executes the file as written."""
    lowered = lower(base, replicas=2, refresh_stages=[1])
    assert lowered == with_collectives(base, 2, [1]) == weight_refresh(gradient_reduce(base), [1])
    assert lower(lowered, replicas=2, refresh_stages=[1]) is lowered
    assert lower(base) is base and lower(base, replicas=1, refresh_stages=[]) is base
    assert lower(forward_only(base), replicas=2, refresh_stages=[0]) == forward_only(base)
    rows = [[a for a in row if a.kind is not R] + [a for a in row if a.kind is R] for row in lowered.actions]
    moved = parse("\n".join(f"rank {r}: " + " ".join(str(a) for a in row) for r, row in enumerate(rows)))
    assert lower(moved, replicas=2, refresh_stages=[1]) is moved


def test_a_rank_validates_its_schedule_once(monkeypatch) -> None:
    """The schedule a rank reads (schedule.txt) is checked against the run by ``build_schedule``
    in the loader and again in the executor: the same object, validated once."""
    import sys

    from pipecc.runtime.engine import build_schedule

    text = format(gradient_reduce(one_f_one_b(2, 3)))
    module = sys.modules["pipecc.ir.schedule.validate"]
    checked = []
    monkeypatch.setattr(module, "_check", lambda s, run=module._check: (checked.append(s), run(s)))
    schedule = parse(text)
    validate(schedule)
    assert build_schedule(schedule, 2, 3) is schedule and build_schedule(schedule, 2, 3) is schedule
    assert lower(schedule, replicas=2) is schedule
    assert checked == [schedule]
    broken = parse("rank 0: 0F0 0REDUCE0 0B0")
    for _ in range(2):  # a schedule that fails is checked again (and fails again)
        with pytest.raises(ScheduleError):
            validate(broken)
    assert len(checked) == 3


@pytest.mark.parametrize("text,words", [
    ("rank 0: 0F0 0REDUCE0 0B0", "0REDUCE0 runs before 0B0"),
    ("rank 0: 0F0 0B0 0REDUCE0 0REDUCE0", "appears twice"),
    ("rank 0: 0F0 0F1 0B0 0B1 0REDUCE0 0REDUCE1", "second REDUCE"),
    ("rank 0: 0F0 0REFRESH0", "in a forward-only schedule"),
    ("rank 0: 0F0 0REFRESH0 0F1 0B0 0B1", "0REFRESH0 runs before 0F1"),
    ("rank 0: 0F0 0REDUCE0", "0REDUCE0 in a forward-only schedule"),
])
def test_misplaced_collectives_are_refused(text: str, words: str) -> None:
    with pytest.raises(ScheduleError) as e:
        validate(parse(text))
    assert words in e.value.summary, e.value.summary


@pytest.fixture(scope="module")
def replicated(tmp_path_factory):
    out = tmp_path_factory.mktemp("collectives") / "mlp_2x2"
    argv = ["compile", "models/mlp.py", "--devices", "4xcpu", "--replicas", "2", "-o", str(out), "-b", "8",
            "-m", "2", "--schedule", "1f1b", "-q"]
    for arg in model_args(MLP_TINY):
        argv += ["--model-arg", arg]
    assert cli.main(argv) == 0
    return out


def test_a_replicated_folders_schedule_txt_carries_its_reduce(replicated) -> None:
    from pipecc.techniques import schedule_of
    from pipecc.report.compiled import load_compiled, timeline_of

    schedule = parse((replicated / "schedule.txt").read_text())
    assert {a for row in schedule.actions for a in row if a.kind is R} == {Action(R, 0, 1), Action(R, 1, 1)}
    c = load_compiled(replicated)
    assert schedule == schedule_of(c.plan) and without_collectives(schedule) == one_f_one_b(2, 2)
    assert timeline_of(c) == c.timeline  # the simulator times the same actions as before


def test_without_its_reduce_a_replicated_folder_is_refused(replicated, tmp_path, capsys) -> None:
    import shutil

    folder = shutil.copytree(replicated, tmp_path / "out")
    path = folder / "schedule.txt"
    path.write_text(path.read_text().replace(" 1REDUCE1", ""))
    code, _, err = run_cli(["run", str(folder), "--steps", "1"], capsys)
    assert code == 1
    assert "stage 1 has no REDUCE action" in err and "compile again" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow  # a torchrun launch of four processes
def test_the_runtime_takes_reduce_from_the_file(replicated, tmp_path) -> None:
    """Every REDUCE moved to the end of its row (valid: after the stage's last B, later than the
    transform puts it): the all-reduce still runs, so the replicas' gradients match."""
    import shutil

    folder = shutil.copytree(replicated, tmp_path / "moved")
    schedule = parse((folder / "schedule.txt").read_text())
    rows = [[a for a in row if a.kind is not R] + [a for a in row if a.kind is R] for row in schedule.actions]
    moved = "\n".join(f"rank {r}: " + " ".join(str(a) for a in row) for r, row in enumerate(rows))
    assert moved != format(schedule)
    (folder / "schedule.txt").write_text(moved + "\n")
    run = pipecc_here("run", str(folder), "--steps", "1", "--verify", "--timeout", "60")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "verify: outputs, loss and 12 gradients match the single-process run" in run.stdout + run.stderr


def test_a_bipartition_plans_schedule_refreshes_its_replica_holders(tmp_path) -> None:
    """The cuts of tests/test_bipartition_run.py: the segment of boundary 1 runs forward on stage 0
    (owned by 1), that of boundary 2 forward on stage 2 (owned by 1): stages 0 and 2 hold
    replicas, so their rows REFRESH after their last F; stage 1, the owner, does not."""
    from test_bipartition_run import _analysis, _bipartition

    from pipecc.techniques import schedule_of

    _, plan, _ = _analysis(tmp_path)
    bip = _bipartition(plan)
    schedule = schedule_of(bip)
    refresh = {a for row in schedule.actions for a in row if a.kind.is_collective}
    assert refresh == {Action(F, 0, 2), Action(F, 2, 2)}
    assert without_collectives(schedule) == schedule_of(plan) == one_f_one_b(3, 3)
