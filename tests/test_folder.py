"""The compiled folder's one reader (`pipecc.runtime.folder.CompiledFolder`): a damaged or edited
pipecc.json is one line naming the fix, each fact has its one default, and the inference-only
rule (FPGA stages, `--inference`) refuses training in the words `pipecc run` uses."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pipecc.errors import PipeccError, UsageError
from pipecc.runtime.folder import (DEFAULT_MICROBATCHES, DEFAULT_PRECISION, DEFAULT_SCHEDULE, CompiledFolder,
                                   find_stage_dirs)

SUMS = {"sha256": {"stage_0/stage.py": "0" * 64}}  # a record (folder_sums.require), no run_stage.py to check


def _folder(tmp_path: Path, stages: int = 2, **fields) -> Path:
    for i in range(stages):
        (tmp_path / f"stage_{i}").mkdir()
    marker = {"format": "pipecc-compile", "version": 1, "num_stages": stages, **SUMS, **fields}
    (tmp_path / "pipecc.json").write_text(json.dumps(marker))
    return tmp_path


def test_open_reads_the_facts(tmp_path: Path) -> None:
    out = _folder(tmp_path, batch_size=8, microbatches=2, schedule="gpipe", replicas=1, precision="bf16",
                  devices=[{"kind": "cpu", "name": "cpu"}, {"kind": "fpga", "name": "u250"}],
                  microbatch_sizes=[[4, 4], [2, 6]], activation_balancing=[{"evictor": 0, "acceptor": 1}])
    folder = CompiledFolder.open(out)
    assert folder.num_stages == 2 and folder.stage_dirs == [out / "stage_0", out / "stage_1"]
    assert (folder.microbatches, folder.batch_size, folder.schedule, folder.precision) == (2, 8, "gpipe", "bf16")
    assert folder.run_microbatches(None) == 2 and folder.run_microbatches(4) == 4
    assert folder.batch([]) == 8
    assert folder.replicas == 1 and folder.compiled_device == "cpu"
    assert [d["name"] for d in folder.devices] == ["cpu", "u250"]
    assert folder.has_sizes and folder.microbatch_sizes == [[4, 4], [2, 6]]
    with pytest.raises(UsageError, match="--microbatches 3: this folder splits the batch unequally"):
        folder.sizes_for(3)
    assert folder.activation_balancing == [{"evictor": 0, "acceptor": 1}]
    assert folder.plan == {} and folder.lengths is None


def test_the_defaults(tmp_path: Path) -> None:
    folder = CompiledFolder(tmp_path, {})
    assert folder.microbatches == DEFAULT_MICROBATCHES == 4  # `pipecc run`'s default, now also pipecc.load's
    assert folder.schedule == DEFAULT_SCHEDULE == "1f1b" and folder.precision == DEFAULT_PRECISION == "fp32"
    assert folder.replicas == 1 and folder.batch_size == 0 and folder.devices == []
    assert folder.compiled_device is None and not folder.has_sizes and folder.microbatch_sizes is None
    assert folder.activation_balancing is None
    assert not folder.never_trains and not folder.inference_compiled and folder.why == ""
    assert not folder.forward_only(None, "adam", 0.1) and not folder.forward_only("gpipe")
    assert folder.forward_only("inference")


def test_a_gpu_device_runs_on_the_runtime_default(tmp_path: Path) -> None:
    folder = CompiledFolder(tmp_path, {"devices": [{"kind": "cpu"}, {"kind": "gpu", "name": "h100"}]})
    assert folder.compiled_device is None


@pytest.mark.parametrize("text, words", [
    ("{", "pipecc.json is not valid JSON"),
    ("[1, 2]", "pipecc.json is not a pipecc marker; compile again"),
    ("[" * 100000, "pipecc.json (nests too deeply to read|is not valid JSON)"),
])
def test_a_damaged_marker_is_one_line(tmp_path: Path, text: str, words: str) -> None:
    (tmp_path / "pipecc.json").write_text(text)
    with pytest.raises(PipeccError, match=words) as info:
        CompiledFolder.open(tmp_path)
    assert "\n" not in str(info.value)


def test_a_missing_marker(tmp_path: Path) -> None:
    assert CompiledFolder.find(tmp_path) is None
    with pytest.raises(PipeccError, match=r"is not a compiled folder \(no pipecc.json\); run `pipecc compile"):
        CompiledFolder.open(tmp_path)
    with pytest.raises(PipeccError, match=r"^the caller's words$"):  # pipecc.load says "not a folder written by"
        CompiledFolder.open(tmp_path, "the caller's words")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_marker_that_is_a_fifo_is_not_read(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipecc.json")  # reading it would hang
    with pytest.raises(PipeccError, match="is not a regular file; compile again"):
        CompiledFolder.open(tmp_path)


@pytest.mark.parametrize("fields, words", [
    ({"num_stages": "2"}, r"pipecc.json: num_stages is '2', not a positive whole number; it was edited"),
    ({"batch_size": 0}, r"batch_size is 0, not a positive whole number"),
    ({"replicas": True}, r"replicas is True, not a positive whole number"),
    ({"batch_size": 8, "microbatches": 3}, r"microbatches 3 does not divide batch_size 8"),
    ({"devices": []}, r"devices is \[\], not the list of the plan's devices"),
    ({"version": 99}, r"pipecc.json is format version 99, this pipecc reads version 1"),
    ({"sha256": {}}, r"records no sha256 of the stage code and weights"),
])
def test_an_edited_field_is_refused_on_open(tmp_path: Path, fields: dict, words: str) -> None:
    with pytest.raises(PipeccError, match=words):
        CompiledFolder.open(_folder(tmp_path, **fields))


def test_replicas_null_is_refused(tmp_path: Path) -> None:
    """`pipecc run`'s check (the ranks read null as 1 before the folder had one reader)."""
    folder = CompiledFolder.open(_folder(tmp_path, replicas=None))
    with pytest.raises(PipeccError, match=r"pipecc.json says replicas None; compile again"):
        _ = folder.replicas


def test_num_stages_is_required(tmp_path: Path) -> None:
    with pytest.raises(PipeccError, match="pipecc.json has no num_stages; compile again"):
        _ = CompiledFolder(tmp_path, {}).num_stages


def test_stage_folders(tmp_path: Path) -> None:
    with pytest.raises(PipeccError, match=r"holds no stage_<i>/ folders; run `pipecc compile` first"):
        find_stage_dirs(tmp_path)
    (tmp_path / "stage_0").mkdir()
    (tmp_path / "stage_2").mkdir()
    with pytest.raises(PipeccError, match=r"stage folders \['stage_0', 'stage_2'\] are not stage_0 .. stage_1"):
        find_stage_dirs(tmp_path)


def test_bad_sizes_and_pairs(tmp_path: Path) -> None:
    with pytest.raises(PipeccError, match=r"pipecc.json says microbatch_sizes \[\[0\]\]; compile again"):
        _ = CompiledFolder(tmp_path, {"microbatch_sizes": [[0]]}).microbatch_sizes
    with pytest.raises(PipeccError, match=r"pipecc.json says activation_balancing \[1\]; compile again"):
        _ = CompiledFolder(tmp_path, {"activation_balancing": [1]}).activation_balancing


def test_fpga_stages_never_train(tmp_path: Path) -> None:
    out = _folder(tmp_path, devices=[{"kind": "cpu"}, {"kind": "fpga"}])
    (out / "stage_1" / "hls").mkdir()
    folder = CompiledFolder.open(out)
    assert folder.fpga_stages == [1] and folder.never_trains and folder.why == "FPGA stages: [1]"
    assert folder.forward_only(None) and folder.forward_only("inference")
    with pytest.raises(UsageError, match=r"is an inference-only pipeline \(FPGA stages: \[1\]; FPGA stages have no "
                                         r"backward pass\): `pipecc run` runs forward passes only; --schedule 1f1b "
                                         r"would train it"):
        folder.forward_only("1f1b")
    with pytest.raises(UsageError, match=r"\(FPGA stages: \[1\].*so --optimizer and --lr do not apply$"):
        folder.forward_only(None, "adam", 0.1)


def test_marked_inference_only(tmp_path: Path) -> None:
    folder = CompiledFolder(tmp_path, {"inference_only": True, "fpga_stages": {"2": "u250"}})
    assert folder.fpga_stages == [2] and folder.why == "FPGA stages: [2]"
    folder = CompiledFolder(tmp_path, {"inference_only": True})
    assert folder.never_trains and folder.why == "compiled so"  # `pipecc run`'s words (the ranks said "compiled inference-only")
    folder = CompiledFolder(tmp_path, {"inference_only": True, "inference_only_reason": "a reason"})
    assert folder.why == "a reason"


def test_compiled_with_inference_trains_when_asked(tmp_path: Path) -> None:
    folder = CompiledFolder(tmp_path, {"schedule": "inference"})
    assert folder.inference_compiled and not folder.never_trains and folder.why == "compiled with --inference"
    assert folder.forward_only(None) and not folder.forward_only("gpipe")
    with pytest.raises(UsageError, match=r"\(compiled with --inference\): `pipecc run` runs forward passes only, so "
                                         r"--lr does not apply; give --schedule gpipe or 1f1b to train it"):
        folder.forward_only(None, None, 0.1)


def test_schedule_inference_with_an_optimizer(tmp_path: Path) -> None:
    """A training folder run with --schedule inference: forward only, and --optimizer refused (the
    ranks refused it; `pipecc run` now does before starting them)."""
    with pytest.raises(UsageError, match=r"\(--schedule inference\): .*so --optimizer does not apply$"):
        CompiledFolder(tmp_path, {}).forward_only("inference", "adam")


# ---------------------------------------------------------------------------- the micro-batch count's copies
# pipecc.json's `microbatches` is the fact; plan.json and schedule.txt repeat it (compile writes all
# three, unchanged); a hand edit that makes a copy disagree is one line, in `run` and in `inspect`.

def test_plan_jsons_copy_must_agree(tmp_path: Path) -> None:
    out = _folder(tmp_path, batch_size=8, microbatches=4)
    (out / "plan.json").write_text(json.dumps({"microbatches": 8, "batch_size": 8}))
    with pytest.raises(PipeccError) as info:
        CompiledFolder.open(out)
    assert str(info.value) == (f"{out / 'pipecc.json'}: microbatches is 4, but the folder was compiled with 8 "
                               "(plan.json); it was edited or is damaged: compile the folder again")
    (out / "plan.json").write_text(json.dumps({"microbatches": 4, "batch_size": 8}))
    assert CompiledFolder.open(out).microbatches == 4


def test_a_marker_without_the_count_takes_plan_jsons(tmp_path: Path) -> None:
    """An older marker without `microbatches`: plan.json's copy is the count (every reader's), else the default."""
    assert CompiledFolder(tmp_path, {}).microbatches == DEFAULT_MICROBATCHES
    (tmp_path / "plan.json").write_text(json.dumps({"microbatches": 8}))
    assert CompiledFolder(tmp_path, {}).microbatches == 8
    assert CompiledFolder(tmp_path, {"microbatches": 2}).microbatches == 2  # the marker's, when it has one


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_plan_json_that_is_a_fifo_is_not_read(tmp_path: Path) -> None:
    out = _folder(tmp_path, microbatches=2)
    os.mkfifo(out / "plan.json")  # reading it would hang; `pipecc run` refuses it by name later
    assert CompiledFolder.open(out).plan == {}


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pipecc: error: "), err
    return lines[0]


@pytest.mark.parametrize("edit, words", [
    (lambda out: _edit_json(out / "plan.json", microbatches=4),
     "pipecc.json: microbatches is 2, but the folder was compiled with 4 (plan.json); it was edited"),
    (lambda out: _edit_json(out / "pipecc.json", microbatches=1),
     "pipecc.json: microbatches is 1, but the folder was compiled with 2 (plan.json); it was edited"),
    (lambda out: (out / "schedule.txt").write_text("rank 0: 0F0 1F0 1B0 0B0\n", encoding="utf-8"),
     "schedule.txt does not match the folder: it has 1 micro-batches, the folder 2; fix it or compile again"),
])
def test_disagreeing_copies_are_one_line_in_run_and_inspect(mlp_copy: Path, capsys, edit, words: str) -> None:
    from helpers import run_cli
    edit(mlp_copy)
    for argv in (["run", str(mlp_copy), "--print-command"], ["inspect", str(mlp_copy)],
                 ["inspect", str(mlp_copy), "--format", "json"]):
        code, stdout, err = run_cli(argv, capsys)
        assert (code, stdout) == (1, ""), (argv, err)
        assert words in _one_line(err), (argv, err)


def _edit_json(path: Path, **fields) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    path.write_text(json.dumps({**data, **fields}, indent=1), encoding="utf-8")


def test_inspect_reads_through_the_compiled_folder(mlp_folder: Path) -> None:
    """`pipecc inspect`'s view is a CompiledFolder's (CompiledFolder.show): each fact read there, once."""
    from pipecc.report.compiled import load_compiled, summary_json
    c = load_compiled(mlp_folder)
    folder = c.folder
    assert isinstance(folder, CompiledFolder) and c.path == folder.path == mlp_folder
    assert c.marker is folder.marker and c.plan is folder.typed_plan and c.schedule is folder.saved_schedule
    assert c.ports is folder.stage_ports and c.graph is folder.graph and c.timeline is folder.timeline
    assert c.microbatches == folder.microbatches == c.plan.microbatches == folder.saved_schedule.num_microbatches == 2
    data = summary_json(c)
    assert (data["microbatches"], data["microbatch_size"]) == (2, 4)
    assert [p["name"] for p in c.ports[0]["receives"]] == data["stages"][0]["receives"]


def test_show_refuses_what_inspect_refused(tmp_path: Path) -> None:
    with pytest.raises(PipeccError, match=r"no such folder \(compile one with `pipecc compile MODEL -o"):
        CompiledFolder.show(tmp_path / "none")
    with pytest.raises(PipeccError, match=r"is not a folder written by `pipecc compile` \(no pipecc.json\)$"):
        CompiledFolder.show(tmp_path)
    (tmp_path / "pipecc.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(PipeccError, match=r"pipecc.json is not a pipecc compile marker$"):
        CompiledFolder.show(tmp_path)


def test_run_data_draws_the_folders_batch(mlp_copy: Path) -> None:
    """RunData's batch is the folder's (CompiledFolder.batch): pipecc.json's, else stage 0's ports'."""
    from pipecc.runtime.rundata import RunData
    from pipecc.runtime.stagefile import check_folder
    folder = CompiledFolder.open(mlp_copy)
    specs = check_folder(mlp_copy, folder.num_stages, files=False)
    assert folder.batch(specs) == 8 and RunData.load(folder, specs, 0).inputs[0].shape[0] == 8
    marker = {k: v for k, v in folder.marker.items() if k != "batch_size"}
    folder = CompiledFolder(mlp_copy, marker)
    assert folder.batch(specs) == 8 and RunData.load(folder, specs, 0).inputs[0].shape[0] == 8
    assert RunData.load(None, specs, 0).note is None  # no folder: seeded random inputs at the ports' shapes


def test_a_rank_refuses_disagreeing_copies_in_one_line(mlp_copy: Path, capsys) -> None:
    """The runtime itself (one process, as run_stage.py starts it) opens the folder the same way."""
    from pipecc.runtime import dist
    _edit_json(mlp_copy / "plan.json", microbatches=4)
    assert dist.main([str(mlp_copy), "--steps", "1"]) == 1
    assert "microbatches is 2, but the folder was compiled with 4 (plan.json)" in _one_line(capsys.readouterr().err)
