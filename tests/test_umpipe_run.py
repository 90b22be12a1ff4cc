"""UMPIPE (unequal micro-batches per stage), the IR and runtime half: the schedule IR's sizes
(``gpipe_uneven``, ``validate``, text form), the runtime's re-slicing inbox, and one torchrun
launch of a compiled folder with unequal sizes checked by ``pipecc run --verify``."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers import MLP_TINY, pipecc_here, run_cli
from pipecc.errors import PipeccError, UsageError
from pipecc.ir.schedule import (
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    format,
    gpipe,
    overlapping,
    parse,
    validate,
)
from pipecc.runtime.engine import PipelineRuntime, RunConfig, build_schedule
from pipecc.runtime.wire import check_fifo
from pipecc.techniques.umpipe.schedule import gpipe_uneven

pytestmark = pytest.mark.xdist_group(name="umpipe_run")

ROOT = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------- IR

UNEVEN_2 = (
    "sizes: 1 3 4 | 4 4\n"
    "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0F2 0SEND_F2 0RECV_B0 0B0 0RECV_B1 0B1 0RECV_B2 0B2\n"
    "rank 1: 1RECV_F0 1RECV_F1 1F0 1RECV_F2 1F1 1B0 1SEND_B0 1SEND_B1 1B1 1SEND_B2"
)


def test_golden_uneven_text_round_trips() -> None:
    s = gpipe_uneven([[1, 3, 4], [4, 4]])
    assert format(s) == UNEVEN_2
    assert parse(UNEVEN_2) == s
    assert s.microbatch_sizes == ((1, 3, 4), (4, 4))
    assert s.num_microbatches == 3 and s.chunks(0) == 3 and s.chunks(1) == 2
    validate(s)


def test_equal_lists_give_gpipes_rows_and_plain_text_has_no_sizes() -> None:
    assert gpipe_uneven([[2, 2], [2, 2], [2, 2]]).actions == gpipe(3, 2).actions
    assert "sizes" not in format(gpipe(2, 2))
    assert parse(format(gpipe(2, 2))).microbatch_sizes is None


def test_overlapping() -> None:
    assert overlapping([1, 3, 4], [4, 4]) == [[0, 1], [2]]
    assert overlapping([4, 4], [1, 3, 4]) == [[0], [0], [1]]
    assert overlapping([2, 2], [1, 1, 2]) == [[0], [0], [1]]
    assert overlapping([3, 3], [2, 2, 2]) == [[0], [0, 1], [1]]
    with pytest.raises(ValueError, match="different batches"):
        overlapping([1, 2], [4])


def test_stash_counts_chunks_and_samples() -> None:
    s = gpipe_uneven([[2, 2], [1, 1, 2], [4]])
    assert s.stash_profile() == [2, 3, 1]
    assert s.stash_sample_profile() == [4, 4, 4]
    with pytest.raises(ValueError, match="needs microbatch_sizes"):
        gpipe(2, 2).stash_sample_profile()


@pytest.mark.parametrize("sizes, match", [
    ([[1, 3], [3]], "same batch"),
    ([[0, 4], [4]], "positive"),
    ([[4], []], "non-empty"),
    ([], "non-empty"),
])
def test_bad_sizes(sizes: list[list[int]], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        gpipe_uneven(sizes)


def test_bad_sizes_line() -> None:
    with pytest.raises(ValueError, match="not a sizes line"):
        parse("sizes: 1 x | 2\nrank 0: 0F0")
    with pytest.raises(ValueError, match="must come first"):
        parse("rank 0: 0F0\nsizes: 1")


def _rows(s: Schedule) -> list[list[Action]]:
    return [list(r) for r in s.actions]


def test_validate_catches_uneven_mistakes() -> None:
    s = gpipe_uneven([[1, 3, 4], [4, 4]])
    # F(1, 0) needs producer chunks 0 and 1: move 1RECV_F1 after 1F0
    rows = _rows(s)
    rows[1].remove(Action(ActionKind.RECV_F, 1, 1))
    rows[1].insert(2, Action(ActionKind.RECV_F, 1, 1))
    with pytest.raises(ScheduleError, match=r"1F0 runs before 1RECV_F1 \(its input\)"):
        validate(Schedule.from_actions(rows, s.microbatch_sizes))
    # the gradient of producer chunk 1 (samples 1..3) is complete only after 1B0: send it earlier
    rows = _rows(s)
    rows[1].remove(Action(ActionKind.SEND_B, 1, 1))
    rows[1].insert(5, Action(ActionKind.SEND_B, 1, 1))
    with pytest.raises(ScheduleError, match=r"1SEND_B1 runs before 1B0"):
        validate(Schedule.from_actions(rows, s.microbatch_sizes))
    # a chunk index beyond the stage's count (stage 1 has 2 chunks)
    rows = _rows(s)
    rows[1].append(Action(ActionKind.F, 1, 2))
    with pytest.raises(ScheduleError, match="out of range"):
        validate(Schedule.from_actions(rows, s.microbatch_sizes))
    # a stage's chunk never runs its backward
    rows = _rows(s)
    rows[0].remove(Action(ActionKind.B, 0, 2))
    rows[0].remove(Action(ActionKind.RECV_B, 0, 2))
    rows[1].remove(Action(ActionKind.SEND_B, 1, 2))
    with pytest.raises(ScheduleError, match="missing 0B2"):
        validate(Schedule.from_actions(rows, s.microbatch_sizes))
    # receiving producer chunks in the wrong order against sends that wait on them: deadlock
    rows = [[Action(ActionKind.RECV_B, 0, 0), Action(ActionKind.F, 0, 0), Action(ActionKind.SEND_F, 0, 0),
             Action(ActionKind.B, 0, 0)],
            [Action(ActionKind.RECV_F, 1, 0), Action(ActionKind.F, 1, 0), Action(ActionKind.F, 1, 1),
             Action(ActionKind.B, 1, 0), Action(ActionKind.B, 1, 1), Action(ActionKind.SEND_B, 1, 0)]]
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(Schedule.from_actions(rows, [[4], [2, 2]]))


def test_schedule_rejects_inconsistent_sizes() -> None:
    s = gpipe_uneven([[1, 3], [4]])
    with pytest.raises(ValueError, match="stage lists"):
        Schedule(s.num_ranks, s.num_stages, s.num_microbatches, s.stage_to_rank, s.actions, ((4,),))
    with pytest.raises(ValueError, match="longest size list"):
        Schedule(s.num_ranks, s.num_stages, 5, s.stage_to_rank, s.actions, s.microbatch_sizes)


def _random_split(rng: random.Random, batch: int) -> list[int]:
    cuts = sorted(rng.sample(range(1, batch), rng.randint(0, min(batch - 1, 6))))
    return [b - a for a, b in zip([0] + cuts, cuts + [batch])]


def test_random_sizes_are_valid_and_deadlock_free() -> None:
    rng = random.Random(12)
    for _ in range(300):
        batch = rng.randint(1, 24)
        sizes = [_random_split(rng, batch) for _ in range(rng.randint(1, 5))]
        s = gpipe_uneven(sizes)
        validate(s)
        check_fifo(s)  # NCCL matches messages by order: every link receives in the order it sends
        assert parse(format(s)) == s
        assert s.stash_sample_profile() == [batch] * len(sizes)
        # every boundary moves each upstream chunk once each way
        for st in range(len(sizes) - 1):
            sends_f = [a.microbatch for a in s.actions[st] if a.kind is ActionKind.SEND_F]
            recvs_b = [a.microbatch for a in s.actions[st] if a.kind is ActionKind.RECV_B]
            sends_b = [a.microbatch for a in s.actions[st + 1] if a.kind is ActionKind.SEND_B]
            assert sends_f == recvs_b == sends_b == list(range(len(sizes[st])))


def test_sends_are_released_by_later_receives() -> None:
    # rank 1 sends its first gradient after receiving all three upstream chunks, so rank 0's
    # three sends are certainly complete once that gradient arrives
    s = gpipe_uneven([[1, 3, 4], [4, 4]])
    released = s.send_release(0)
    assert released[Action(ActionKind.RECV_B, 0, 0)] == [Action(ActionKind.SEND_F, 0, k) for k in range(3)]


def test_gpipe_uneven_on_fewer_ranks() -> None:
    sizes = [[1, 3], [2, 2], [4], [1, 1, 2]]
    for ranks in (1, 2, 4):
        s = gpipe_uneven(sizes, ranks)
        validate(s)
        assert s.num_ranks == ranks and s.stage_to_rank == tuple(i % ranks for i in range(4))
    one = gpipe_uneven(sizes, 1)
    assert not any(a.kind.is_send or a.kind.is_recv for a in one.actions[0])
    with pytest.raises(ValueError, match="do not divide"):
        gpipe_uneven(sizes, 3)


# ---------------------------------------------------------------------------- re-slicing, one process

B = 4


class _First(nn.Module):
    """x [B, 3] -> h [B, 4], its [2B, 2] view (2 rows per sample) and an unbatched scale."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.scale = nn.Parameter(torch.tensor([1.5, -0.5]))

    def forward(self, x: torch.Tensor) -> tuple:
        h = torch.tanh(self.lin(x))
        return h, (h * 2).reshape(-1, 2), self.scale * 1.0


class _Middle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, h: torch.Tensor, pairs: torch.Tensor, scale: torch.Tensor) -> tuple:
        return torch.tanh(self.lin(h)), (pairs * scale).sin(), scale * 2.0


class _Last(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, h: torch.Tensor, pairs: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.lin(h) + (pairs * scale).reshape(-1, 4)[:, :2]


def _t(name: str, shape: list[int], grad: bool = True, batched: bool = True, expr: str = "B") -> dict:
    port = {"name": name, "kind": "tensor", "shape": shape, "dtype": "float32", "requires_grad": grad,
            "batch_dim": 0 if batched else None}
    if batched:
        port["shape_expr"] = [expr] + [str(n) for n in shape[1:]]
    return port


_BOUNDARY = [_t("h", [B, 4]), _t("pairs", [2 * B, 2], expr="2*B"), _t("scale", [2], batched=False)]
_PORTS = {
    "first": {"receives": [_t("x", [B, 3], grad=False)], "sends": _BOUNDARY},
    "middle": {"receives": _BOUNDARY, "sends": _BOUNDARY},
    "last": {"receives": _BOUNDARY, "sends": [_t("y", [B, 2])]},
}


def _chain(stages: int) -> tuple[list[nn.Module], list[dict]]:
    torch.manual_seed(0)
    kinds = ["first"] + ["middle"] * (stages - 2) + ["last"]
    modules = [{"first": _First, "middle": _Middle, "last": _Last}[k]() for k in kinds]
    return modules, [_PORTS[k] for k in kinds]


def _reference(modules: list[nn.Module], x: torch.Tensor, target: torch.Tensor) -> tuple[float, list]:
    values: tuple = (x,)
    for m in modules:
        out = m(*values)
        values = out if isinstance(out, tuple) else (out,)
    loss = nn.functional.mse_loss(values[0], target)
    loss.backward()
    grads = [p.grad.clone() for m in modules for p in m.parameters()]
    for m in modules:
        m.zero_grad()
    return loss.item(), grads, values[0].detach()


@pytest.mark.parametrize("sizes", [
    [[1, 3], [4]],
    [[2, 2], [1, 1, 2]],
    [[1, 3], [2, 2], [1, 1, 2]],
    [[4], [1, 2, 1], [3, 1]],
    [[2, 2], [2, 2]],
])
def test_resliced_pipeline_matches_one_process(sizes: list[list[int]]) -> None:
    modules, ports = _chain(len(sizes))
    x, target = torch.randn(B, 3), torch.randn(B, 2)
    loss_ref, grads_ref, out_ref = _reference(modules, x, target)
    config = RunConfig("gpipe", len(sizes[0]), microbatch_sizes=sizes, device="cpu")
    runtime = PipelineRuntime(modules, ports, 0, 1, config, loss_fn=nn.functional.mse_loss)
    assert runtime.schedule.microbatch_sizes == tuple(map(tuple, sizes))
    runtime.keep_outputs = True
    loss = runtime.step((x,), target)
    torch.testing.assert_close(loss, loss_ref)
    torch.testing.assert_close(runtime.last_outputs(), out_ref)
    for got, want in zip([p.grad for m in modules for p in m.parameters()], grads_ref):
        torch.testing.assert_close(got, want)
    with torch.no_grad():
        torch.testing.assert_close(runtime.infer((x,)), out_ref)


def test_random_sizes_match_one_process() -> None:
    rng = random.Random(7)
    modules, ports = _chain(3)
    x, target = torch.randn(B, 3), torch.randn(B, 2)
    loss_ref, grads_ref, _ = _reference(modules, x, target)
    for _ in range(8):
        sizes = [_random_split(rng, B) for _ in range(3)]
        config = RunConfig("gpipe", len(sizes[0]), microbatch_sizes=sizes, device="cpu")
        runtime = PipelineRuntime(modules, ports, 0, 1, config, loss_fn=nn.functional.mse_loss)
        torch.testing.assert_close(runtime.step((x,), target), loss_ref)
        for got, want in zip([p.grad for m in modules for p in m.parameters()], grads_ref):
            torch.testing.assert_close(got, want, msg=lambda text: f"sizes {sizes}: {text}")
        for m in modules:
            m.zero_grad()


def test_unequal_sizes_bad_input() -> None:
    modules, ports = _chain(2)
    with pytest.raises(UsageError, match="gpipe or 1f1b schedule only, not 'zb-h1'"):
        PipelineRuntime(modules, ports, 0, 1, RunConfig("zb-h1", 2, microbatch_sizes=[[1, 3], [4]], device="cpu"))
    with pytest.raises(PipeccError, match="sum to 5, the batch is 4"):
        PipelineRuntime(modules, ports, 0, 1, RunConfig("gpipe", 2, microbatch_sizes=[[2, 3], [5]], device="cpu"))
    with pytest.raises(PipeccError, match=r"holds stages \[0, 1, 2\] in this schedule but got 2 modules"):
        PipelineRuntime(modules, ports, 0, 1, RunConfig("gpipe", 2, microbatch_sizes=[[4], [4], [4]], device="cpu"))
    with pytest.raises(PipeccError, match="microbatch_sizes: .*positive"):
        build_schedule("gpipe", 1, 2, 2, [[0, 4], [4]])
    assert build_schedule(UNEVEN_2, 2, 3) == gpipe_uneven([[1, 3, 4], [4, 4]])  # schedule text with sizes
    with pytest.raises(PipeccError, match="schedule has 2 ranks, the run 1"):
        build_schedule(UNEVEN_2, 1, 3)


# ---------------------------------------------------------------------------- a compiled folder
SIZES = [[1, 3, 4], [4, 4]]  # the folder's: stage 0 in chunks of 1, 3, 4 rows, stage 1 in 4, 4


@pytest.fixture(scope="module")
def mlp_plan():
    """models/mlp.py on 2xcpu, -b 8 -m 2, gpipe, replicas 1: (analysis, plan, graph)."""
    from pipecc import driver
    model = str(ROOT / "models" / "mlp.py")
    analysis = driver.analyze(model, model_args=MLP_TINY, batch_size=8)
    plan, graph = driver.plan(analysis, "2xcpu", batch_size=8, microbatches=2, schedule="gpipe", replicas=1)
    plan = dataclasses.replace(plan, model_path=model, model_args=dict(MLP_TINY))
    return analysis, plan, graph


@pytest.fixture(scope="module")
def unequal_out(mlp_plan, tmp_path_factory) -> Path:
    """The folder compiled with stage 0 in chunks of 1, 3, 4 rows and stage 1 in 4, 4 (set
    through the python API: `--microbatch-sizes` gives every stage the same list)."""
    from pipecc import driver
    analysis, plan, graph = mlp_plan
    plan = dataclasses.replace(plan, microbatches=len(SIZES[0]), microbatch_sizes=SIZES)
    out = tmp_path_factory.mktemp("umpipe") / "mlp"
    driver.compile(analysis, plan, graph, out)
    return out


def test_compiled_folder_records_the_sizes(unequal_out: Path) -> None:
    marker = json.loads((unequal_out / "pipecc.json").read_text())
    assert marker["microbatch_sizes"] == SIZES and marker["schedule"] == "gpipe"


@pytest.mark.slow  # a torchrun launch of several processes (make test-fast leaves it out)
def test_torchrun_unequal_folder_verifies(unequal_out: Path) -> None:
    result = pipecc_here("run", str(unequal_out), "--verify", "--steps", "2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "verify: outputs, loss and 6 gradients match the single-process run" in result.stdout
    assert "step 1: loss" in result.stdout


def test_one_process_runs_the_unequal_folder(unequal_out: Path, capsys) -> None:
    from pipecc.runtime import dist
    assert dist.main([str(unequal_out), "--verify", "--steps", "1"]) == 0
    assert "gradients match the single-process run" in capsys.readouterr().out


@pytest.mark.parametrize("flags, error", [
    (["--schedule", "zb-h1"], "--schedule zb-h1: unequal micro-batches (UMPIPE) run under the gpipe or 1f1b schedule "
                              "only, not zb-h1: use --schedule 1f1b, or --microbatch-sizes equal (or drop --schedule)"),
    (["-m", "2"], "--microbatches 2: this folder splits the batch unequally per stage"),
])
def test_run_refuses_overrides(unequal_out: Path, capsys, flags: list[str], error: str) -> None:
    code, _, err = run_cli(["run", str(unequal_out), *flags], capsys)
    assert code == 2 and err.count("\n") == 1 and error in err


def test_compile_refuses_what_cannot_run(mlp_plan, tmp_path: Path) -> None:
    from pipecc.techniques.umpipe.codegen import marker_sizes
    from pipecc import driver
    from pipecc import techniques
    analysis, plan, graph = mlp_plan
    unequal = dataclasses.replace(plan, microbatches=3, microbatch_sizes=SIZES)
    assert marker_sizes(unequal) == SIZES and techniques.requires(unequal) is None
    assert marker_sizes(dataclasses.replace(plan, microbatch_sizes=[[4, 4], [4, 4]])) is None
    for change, error in [  # UMPIPE's rule
        ({"schedule": "zb-h1"}, "run under the gpipe or 1f1b schedule only, not zb-h1"),
        ({"replicas": 2}, "need replicas 1, not 2"),
    ]:
        assert error in techniques.umpipe.requires(dataclasses.replace(unequal, **change), techniques.COMPILED)
    for change, error in [  # what the runtime cannot slice
        ({"microbatch_sizes": [[1, 3, 3], [4, 4]]}, "stage 0 sum to 7, the batch is 8 rows"),
        ({"microbatch_sizes": [[0, 8], [4, 4]]}, "stage 0 must be positive integers"),
        ({"microbatch_sizes": [[8]]}, "lists 1 stages, the pipeline has 2"),
    ]:
        with pytest.raises(PipeccError, match=error.replace("(", r"\(").replace("'", ".")):
            marker_sizes(dataclasses.replace(unequal, **change))
    with pytest.raises(PipeccError, match="gpipe or 1f1b schedule only"):
        driver.compile(analysis, dataclasses.replace(unequal, schedule="zb-h1"), graph, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
