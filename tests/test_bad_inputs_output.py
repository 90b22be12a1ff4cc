"""Bad inputs around what pipecc writes and shows (issue #14, items 1, 4, 7 and 10).

`ERRORS` is the table: each row is a bad input and the one `pipecc: error:` line (and exit
code) it must give, with no traceback and nothing left on disk. The tests after it check the
correct behaviour the issue asks for: files pipecc did not write survive every compile, a
killed compile's temporary folder is cleaned by the next one, hostile names never reach the
terminal raw, `pipecc.load(OUT).plan`, and an FPGA stage's memory shown against its BRAM.
Add a row for every new case.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from helpers import ROOT, run_cli, zoo_path
from pipecc import cli, driver, progress
from pipecc.backends.torch import compile as torch_compile
from pipecc.backends.torch import cut_stages
from pipecc.errors import PipeccError
from pipecc.ir.plan import Plan

MLP = str(zoo_path("mlp"))
LONG = "x" * 300


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def mlp_plan():
    analysis = driver.analyze(MLP, batch_size=2)
    plan, graph = driver.plan(analysis, "cpu,cpu", microbatches=1)
    return analysis, plan, graph


@pytest.fixture(scope="module")
def mlp_out(tmp_path_factory, mlp_plan) -> Path:
    """A folder as `pipecc compile` writes it (through the driver)."""
    analysis, plan, graph = mlp_plan
    out = tmp_path_factory.mktemp("compiled") / "out"
    driver.compile(analysis, plan, graph, out)
    return out


def write(out: Path, mlp_plan, stages_of: int = 2, **kwargs) -> Path:
    """write_output of the mlp cut into `stages_of` stages (a plan with that many)."""
    _, plan, graph = mlp_plan
    plan = Plan.from_json(json.loads(plan.dumps()))
    nodes = [n for s in plan.stages for n in s.nodes]
    k = -(-len(nodes) // stages_of)
    template = plan.stages[0]
    plan.stages = [type(template)(i, 0, nodes[i * k:(i + 1) * k]) for i in range(stages_of)]
    plan.devices = [plan.devices[0]] * stages_of
    for i, s in enumerate(plan.stages):
        s.device = i
    return torch_compile.write_output(out, graph, plan, cut_stages(graph, plan.stage_of()), **kwargs)


def snapshot(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".pipecc-" in p.name]


# ----------------------------------------------------------------------------- the table
def _file(tmp: Path) -> None:
    (tmp / "afile").write_text("a file")


def _folder(tmp: Path) -> None:
    (tmp / "adir").mkdir()


def _link(tmp: Path) -> None:
    (tmp / "target").mkdir()
    (tmp / "link").symlink_to(tmp / "target")


def _foreign(tmp: Path) -> None:
    (tmp / "theirs").mkdir()
    (tmp / "theirs" / "thesis.txt").write_text("years of work")


def _unwritable(tmp: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root writes anywhere")
    (tmp / "ro").mkdir()
    (tmp / "ro").chmod(0o500)


def _damaged(edit: Callable[[dict], None], name: str = "plan.json") -> Callable[[Path, Path], None]:
    def setup(tmp: Path, compiled: Path) -> None:
        shutil.copytree(compiled, tmp / "c")
        path = tmp / "c" / name
        data = json.loads(path.read_text())
        edit(data)
        path.write_text(json.dumps(data))
    return setup


def _set(*path_and_value):
    *keys, value = path_and_value

    def edit(data):
        for k in keys[:-1]:
            data = data[k]
        data[keys[-1]] = value
    return edit


def _nested(name: str, depth: int = 100000) -> Callable[[Path, Path], None]:
    def setup(tmp: Path, compiled: Path) -> None:
        shutil.copytree(compiled, tmp / "c")
        (tmp / "c" / name).write_text("[" * depth + "]" * depth)
    return setup


def _toml(text: str) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        (tmp / "c.toml").write_text(text)
    return setup


GPU = 'devices = ["g"]\n[device.g]\nbase = "a100"\n'
CARD = 'devices = ["cpu", "f"]\n[device.f]\nbase = "u250"\n'
CLUSTER = ["plan", MLP, "-d", "@{tmp}/c.toml"]
COMPILE = ["compile", MLP, "-d", "cpu,cpu"]
PLAN = ["plan", MLP, "-d", "cpu,cpu"]

# id, setup(tmp) or setup(tmp, compiled folder), argv ({tmp} is the test's folder), exit code,
# a piece of the one error line
ERRORS = [
    # the plan flags of replica groups, recomputation, unequal micro-batches and zero-bubble
    ("--replicas not dividing the devices", None, COMPILE + ["--replicas", "3", "-o", "{tmp}/out"], 2,
     "--replicas 3 does not divide the 2 devices"),
    ("--replicas 0", None, COMPILE + ["--replicas", "0", "-o", "{tmp}/out"], 2, "must be a positive integer"),
    ("--replicas beyond the micro-batch", None, COMPILE + ["-b", "2", "-m", "2", "--replicas", "2", "-o", "{tmp}/out"],
     2, "leaves a replica without samples"),
    ("--replicas with an FPGA", None, ["compile", MLP, "-d", "cpu,u250", "--replicas", "2", "-o", "{tmp}/out"], 2,
     "stage 0 (fpga u250) is never replicated"),
    ("--recompute bogus", None, COMPILE + ["--recompute", "bogus", "-o", "{tmp}/out"], 2, "invalid choice: 'bogus'"),
    ("--recompute full with an FPGA", None, ["compile", MLP, "-d", "cpu,u250", "--recompute", "full", "-o", "{tmp}/out"],
     2, "cannot recompute activations"),
    ("--microbatch-sizes not summing to the batch", None,
     COMPILE + ["-b", "8", "--microbatch-sizes", "3,3", "-o", "{tmp}/out"], 2, "sums to 6, not the batch size 8"),
    ("--microbatch-sizes with a 0", None, COMPILE + ["-b", "8", "--microbatch-sizes", "4,0,4", "-o", "{tmp}/out"], 2,
     "has a size of 0"),
    ("--microbatch-sizes with replicas", None,
     COMPILE + ["-b", "8", "--microbatch-sizes", "4,4", "--replicas", "2", "-o", "{tmp}/out"], 2, "need replicas 1"),
    # BPipe and Bi-Partition flags, and a compiled folder edited into an odd BPipe pairing
    ("--activation-balancing bogus", None, COMPILE + ["--activation-balancing", "bogus", "-o", "{tmp}/out"], 2,
     "invalid choice: 'bogus'"),
    ("--activation-balancing on under gpipe", None,
     COMPILE + ["--schedule", "gpipe", "--activation-balancing", "on", "-o", "{tmp}/out"], 2,
     "--activation-balancing on: activation balancing (BPipe) pairs stages under the 1f1b schedule only, not gpipe"),
    ("--activation-balancing on with an FPGA", None,
     ["compile", MLP, "-d", "cpu,u250", "--activation-balancing", "on", "-o", "{tmp}/out"], 2,
     "keeps no autograd stash to move"),
    ("--flash-attention with a value", None, COMPILE + ["--flash-attention=yes", "-o", "{tmp}/out"], 2,
     "ignored explicit argument 'yes'"),
    ("--bipartition always", None, COMPILE + ["--bipartition", "always", "-o", "{tmp}/out"], 2,
     "invalid choice: 'always'"),
    ("run a folder edited into an odd BPipe pairing",
     _damaged(lambda d: d.update(schedule="1f1b", activation_balancing=[
         {"evictor": 0, "acceptor": 0, "threshold": 1, "policy": "jit"}]), "pipecc.json"),
     ["run", "{tmp}/c", "--steps", "1"], 1, "activation balancing (BPipe): odd pairing (0, 0)"),
    ("--schedule zb-h1 with an FPGA", None, ["compile", MLP, "-d", "cpu,u250", "--schedule", "zb-h1", "-o", "{tmp}/out"],
     2, "which stage 1 (fpga u250) cannot run"),
    ("compile -o under a file", _file, COMPILE + ["-o", "{tmp}/afile/out"], 1, "afile is not a folder"),
    ("compile -o under /proc", None, COMPILE + ["-o", "/proc/pipecc-out"], 1, "cannot write in /proc"),
    ("compile -o under /proc/self", None, COMPILE + ["-o", "/proc/self/x/out"], 1, "cannot write"),
    ("compile -o name of 300 bytes", None, COMPILE + ["-o", "{tmp}/" + LONG], 1, "300 bytes, over the 255"),
    ("compile -o a file", _file, COMPILE + ["-o", "{tmp}/afile"], 1, "is not a folder; pipecc will not"),
    ("compile -o a file --force", _file, COMPILE + ["-o", "{tmp}/afile", "--force"], 1, "is not a folder"),
    ("compile -o a symlink", _link, COMPILE + ["-o", "{tmp}/link"], 1, "is a symbolic link"),
    ("compile -o foreign folder", _foreign, COMPILE + ["-o", "{tmp}/theirs"], 1,
     "was not written by pipecc; use --force"),
    ("compile -o unwritable folder", _unwritable, COMPILE + ["-o", "{tmp}/ro/out"], 1, "cannot write in"),
    ("compile -o under /sys", None, COMPILE + ["-o", "/sys/pipecc-out"], 1, "cannot write in /sys"),
    ("plan -o unwritable folder", _unwritable, PLAN + ["-o", "{tmp}/ro/plan.json"], 1, "cannot write in"),
    ("compile -m 1000", None, COMPILE + ["-o", "{tmp}/out", "-m", "1000"], 2, "must divide the batch size"),
    ("plan -m 1000", None, PLAN + ["-m", "1000"], 2, "must divide the batch size"),
    ("plan -o under a file", _file, PLAN + ["-o", "{tmp}/afile/plan.json"], 1, "afile is not a folder"),
    ("plan -o under /proc", None, PLAN + ["-o", "/proc/plan.json"], 1, "cannot write in /proc"),
    ("plan -o name of 300 bytes", None, PLAN + ["-o", "{tmp}/" + LONG + ".json"], 1, "over the 255"),
    ("plan -o a folder", _folder, PLAN + ["-o", "{tmp}/adir"], 1, "is a folder; give a file name"),
    ("inspect stage index out of range", _damaged(_set("stages", 1, "index", 5)), ["inspect", "{tmp}/c"], 1,
     "plan.json is damaged: stage 1 says index 5"),
    ("inspect no stages", _damaged(_set("stages", [])), ["inspect", "{tmp}/c", "--format", "json"], 1,
     "plan.json is damaged: it has no stages"),
    ("inspect device out of range", _damaged(_set("stages", 0, "device", 9)), ["inspect", "{tmp}/c"], 1,
     "stage 0 is on device 9, but the plan has devices 0..1"),
    ("inspect figure not a number", _damaged(_set("stages", 0, "forward_s", "fast")),
     ["inspect", "{tmp}/c", "--stage", "0"], 1, "forward_s is 'fast', not a number"),
    ("inspect zero micro-batches", _damaged(_set("microbatches", 0)), ["inspect", "{tmp}/c"], 1,
     "microbatches is 0, not a positive integer"),
    ("inspect plan.json nested 100000 deep", _nested("plan.json"), ["inspect", "{tmp}/c"], 1,
     "plan.json: the plan nests too deeply to read"),
    ("inspect damaged graph.json", _damaged(_set("nodes", [{"id": "x"}]), "graph.json"),
     ["inspect", "{tmp}/c", "--stage", "0"], 1, "is damaged or from another pipecc version"),
    ("inspect damaged ports.json", _damaged(_set("receives", 7), "stage_1/ports.json"),
     ["inspect", "{tmp}/c", "--stage", "1"], 1, "is damaged or from another pipecc version"),
    ("inspect --onnx onto a file", _file, ["inspect", "{compiled}", "--onnx", "{tmp}/afile"], 1,
     "it is a file, not a folder"),
    ("inspect --onnx under /proc", None, ["inspect", "{compiled}", "--onnx", "/proc/onnx"], 1,
     "cannot write in /proc"),
    ("plan --dump-ir onto a file", _file, PLAN + ["--dump-ir", "{tmp}/afile"], 2,
     "--dump-ir {tmp}/afile: cannot write dumps there (it is a file)"),
    ("compile --dump-ir inside -o", None, COMPILE + ["-o", "{tmp}/out", "--dump-ir", "{tmp}/out/ir"], 2,
     "--dump-ir {tmp}/out/ir is inside -o {tmp}/out, which pipecc replaces as a whole"),
    ("compile --dump-ir under /proc", None, COMPILE + ["-o", "{tmp}/out", "--dump-ir", "/proc/dumps"], 2,
     "--dump-ir /proc/dumps: cannot write dumps there"),
    # issue #22 item 6 and #24 items 7, 8: cluster files whose tables have the wrong types, and limits
    ("cluster sources a string", _toml(GPU + 'sources = "x"\n'), CLUSTER, 2,
     "[device.g] in {tmp}/c.toml: sources must be a table of strings"),
    ("cluster efficiency a string", _toml(GPU + 'efficiency = "fast"\n'), CLUSTER, 2,
     "efficiency must be a table (efficiency.FIELD = ...), got 'fast'"),
    ("cluster peak_flops a number", _toml(GPU + "peak_flops = 5\n"), CLUSTER, 2, "peak_flops must be a table"),
    ("cluster nvlink a list", _toml(GPU + "nvlink = [1]\n"), CLUSTER, 2, "nvlink must be a string, got [1]"),
    ("cluster device a string", _toml('devices = ["cpu"]\ndevice = "x"\n'), CLUSTER, 2,
     "device must be tables [device.NAME] of fields, got device = 'x'"),
    ("cluster device entry a list", _toml('devices = ["cpu"]\n[device]\ng = [1, 2]\n'), CLUSTER, 2,
     "got device = {'g': [1, 2]}"),
    ("cluster link a string", _toml('devices = ["cpu"]\nlink = "x"\n'), CLUSTER, 2,
     "link must be tables [link.NAME] of fields"),
    ("cluster link entry a list", _toml('devices = ["cpu"]\n[link]\nl = [1]\n'), CLUSTER, 2, "got link = {'l': [1]}"),
    ("cluster fpga dsp = 0.5", _toml(CARD + "fpga = {dsp = 0.5}\n"), CLUSTER, 2,
     "fpga.dsp counts blocks, a whole number >= 1, got 0.5"),
    ("cluster fpga bram18 = 0.3", _toml(CARD + "fpga = {bram18 = 0.3}\n"), CLUSTER, 2, "fpga.bram18 counts blocks"),
    ("cluster fpga a string", _toml(CARD + 'fpga = "big"\n'), CLUSTER, 2, "fpga must be a table"),
    ("cluster nested 3000 deep", _toml("devices = " + "[" * 3000 + "]" * 3000 + "\n"), CLUSTER, 2,
     "nests arrays or tables too deeply to read"),
    ("cluster tiny mem_bandwidth", _toml('devices = ["cpu", "g"]\n[device.g]\nbase = "cpu"\n'
                                         'mem_bandwidth = 1e-30\n'), CLUSTER + ["--use-all-devices"], 1,
     "every placement takes over 1e+09 s per micro-batch on device(s) cpu, g"),
    ("200 device tokens of 1024xcpu", None, ["plan", MLP, "-d", ",".join(["1024xcpu"] * 200)], 1,
     "204800 devices but only 7 units to place"),
    ("a hostile name in an error", None, ["cost", "{tmp}/\x1b[2J\r\x9bmodel.py"], 1,
     "\\x1b[2J\\r\\x9bmodel.py"),
]


@pytest.mark.parametrize("setup,argv,code,message", [r[1:] for r in ERRORS], ids=[r[0] for r in ERRORS])
def test_bad_input_gives_one_line_and_leaves_nothing(setup, argv, code, message, tmp_path, mlp_out,
                                                     capsys):
    if setup is not None:
        setup(*((tmp_path, mlp_out) if setup.__code__.co_argcount == 2 else (tmp_path,)))
    before, compiled_before = snapshot(tmp_path), snapshot(mlp_out)
    argv = [a.replace("{tmp}", str(tmp_path)).replace("{compiled}", str(mlp_out)) for a in argv]
    got, out, err = run_cli(argv, capsys)
    assert got == code, (out, err)
    assert out == "" and err.count("\n") == 1 and err.startswith("pipecc: error: "), err
    assert message.replace("{tmp}", str(tmp_path)) in err and err[:-1].isprintable(), err
    assert snapshot(tmp_path) == before and snapshot(mlp_out) == compiled_before
    assert not Path("/proc/pipecc-out").exists()


@pytest.mark.parametrize("where", [".", "sub/.."])
def test_compile_into_the_current_folder_is_refused(where, tmp_path, monkeypatch, capsys):
    """Issue #24 item 8: `-o . --force` failed "Device or resource busy" and left a
    `..pipecc-old-*` folder; now one line, and nothing written."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "notes.txt").write_text("mine")
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    code, out, err = run_cli(COMPILE + ["-o", where, "--force", "-q"], capsys)
    assert code == 1 and err.count("\n") == 1 and "is the folder you are in" in err, err
    assert snapshot(tmp_path) == before


def test_no_command_prints_the_usage_and_a_hint(capsys):
    code, out, err = run_cli([], capsys)
    assert code == 2 and out == ""
    assert err.splitlines() == ["usage: pipecc [-h] [--version] COMMAND ...",
                                "pipecc: error: no command given; try `pipecc --help`"]


def test_the_console_script_gives_one_line_too(tmp_path):
    """The same through a real process: the exit code, the one line, no traceback."""
    (tmp_path / "afile").write_text("")
    r = subprocess.run([sys.executable, "-m", "pipecc.cli", "plan", MLP, "-d", "cpu", "-o",
                        str(tmp_path / "afile" / "p.json")], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr


# ----------------------------------------------------------------------------- item 4: user files
def test_force_on_a_foreign_folder_keeps_its_files_and_names_what_it_replaces(tmp_path, capsys):
    out = tmp_path / "theirs"
    (out / "sub").mkdir(parents=True)
    (out / "thesis.txt").write_text("years of work")
    (out / "sub" / "data.bin").write_bytes(b"\x00\x01")
    (out / "plan.json").write_text("their plan")
    code, text, err = run_cli(COMPILE + ["-o", str(out), "--force", "-q"], capsys)
    assert code == 0, err
    assert (out / "thesis.txt").read_text() == "years of work"
    assert (out / "sub" / "data.bin").read_bytes() == b"\x00\x01"
    assert json.loads((out / "plan.json").read_text())["stages"]  # pipecc's now
    marker = json.loads((out / "pipecc.json").read_text())
    assert "thesis.txt" not in marker["files"] and "plan.json" in marker["files"]
    assert marker["model_sha256"] == __import__("hashlib").sha256(Path(MLP).read_bytes()).hexdigest()
    assert "replaced 1 file(s) in" in err and "(--force): plan.json" in err
    assert "kept 2 file(s) in" in err and "thesis.txt" in err and "sub/data.bin" in err
    assert leftovers(tmp_path) == []


def test_recompiling_keeps_files_pipecc_did_not_write(tmp_path, mlp_plan, capsys):
    out = write(tmp_path / "out", mlp_plan, stages_of=3)
    (out / "notes.txt").write_text("mine")
    (out / "stage_0" / "mine").mkdir()
    (out / "stage_0" / "mine" / "a.txt").write_text("also mine")
    (out / "empty").mkdir()
    progress.configure(stream=sys.stderr)
    write(out, mlp_plan, stages_of=2)  # no --force: pipecc's folder
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / "stage_0" / "mine" / "a.txt").read_text() == "also mine" and (out / "empty").is_dir()
    assert not (out / "stage_2").exists()  # pipecc's own stage of the old compile: gone
    assert "kept 2 file(s)" in capsys.readouterr().err
    assert leftovers(tmp_path) == []


def test_a_hand_made_manifest_proves_nothing(tmp_path, capsys):
    """Issue #24 item 4: a pipecc.json written by hand that lists a user's file does not make
    compile -o delete it: only files whose keyed hash checks are pipecc's."""
    out = tmp_path / "theirs"
    out.mkdir()
    (out / "thesis.txt").write_text("years of work")
    (out / "pipecc.json").write_text(json.dumps({"format": "pipecc-compile", "version": 1,
                                                 "files": ["thesis.txt", "pipecc.json"],
                                                 "files_mac": {"thesis.txt": "0" * 64}}))
    code, _, err = run_cli(COMPILE + ["-o", str(out), "-q"], capsys)
    assert code == 0, err
    assert (out / "thesis.txt").read_text() == "years of work"
    assert "kept 1 file(s)" in err and "thesis.txt" in err
    marker = json.loads((out / "pipecc.json").read_text())
    assert "thesis.txt" not in marker["files"] and set(marker["files_mac"]) == set(marker["files"]) - {"pipecc.json"}


def test_an_edited_file_pipecc_wrote_is_the_users(tmp_path, mlp_plan):
    """A file pipecc wrote and the user changed since fails its hash: kept when nothing new
    goes there, refused in the way (without --force) when the new compile writes it."""
    out = write(tmp_path / "out", mlp_plan, stages_of=3)
    (out / "stage_2" / "stage.py").write_text("# my edits")
    (out / "stage_1" / "stage.py").write_text("# mine too")
    with pytest.raises(PipeccError, match=r"1 file\(s\) pipecc did not write are where it writes: stage_1/stage.py"):
        write(out, mlp_plan, stages_of=2)
    (out / "stage_1" / "stage.py").unlink()
    progress.configure(stream=sys.stderr)
    write(out, mlp_plan, stages_of=2)
    assert (out / "stage_2" / "stage.py").read_text() == "# my edits"


def test_a_recompile_keeps_the_users_umask(tmp_path, mlp_plan):
    """Issue #24 item 4: OUT was left 0700 and its weights 0600 (mkdtemp's modes) after a recompile."""
    old = os.umask(0o022)
    try:
        out = write(tmp_path / "out", mlp_plan)
        write(out, mlp_plan)
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o755
    assert (out / "stage_0" / "weights.safetensors").stat().st_mode & 0o777 == 0o644
    assert (out / "stage_0").stat().st_mode & 0o777 == 0o755


def test_a_file_in_the_way_is_refused_or_replaced_with_force(tmp_path, mlp_plan, capsys):
    out = write(tmp_path / "out", mlp_plan, stages_of=2)
    (out / "stage_2").mkdir()
    (out / "stage_2" / "stage.py").write_text("# the user's")
    before = snapshot(out)
    with pytest.raises(PipeccError, match=r"1 file\(s\) pipecc did not write are where it writes: "
                       r"stage_2/stage.py; move them away, or use --force"):
        write(out, mlp_plan, stages_of=3)
    assert snapshot(out) == before and leftovers(tmp_path) == []
    progress.configure(stream=sys.stderr)
    write(out, mlp_plan, stages_of=3, force=True)
    assert "# the user's" not in (out / "stage_2" / "stage.py").read_text()
    assert "replaced 1 file(s)" in capsys.readouterr().err


def test_a_folder_from_before_the_manifest_counts_pipecc_layout_as_pipecc(tmp_path, mlp_plan):
    out = write(tmp_path / "out", mlp_plan, stages_of=3)
    marker = json.loads((out / "pipecc.json").read_text())
    del marker["files"]
    (out / "pipecc.json").write_text(json.dumps(marker))
    (out / "stage_2" / "__pycache__").mkdir()
    (out / "stage_2" / "__pycache__" / "stage.cpython-311.pyc").write_bytes(b"")
    (out / "stage_2" / "notes.md").write_text("mine")
    write(out, mlp_plan, stages_of=2)
    assert snapshot(out / "stage_2") == ["notes.md"]


def test_an_empty_folder_and_a_long_name_are_fine(tmp_path, mlp_plan):
    (tmp_path / "empty").mkdir()
    write(tmp_path / "empty", mlp_plan)  # nothing to lose: no --force needed
    long = write(tmp_path / ("y" * 250), mlp_plan)  # its temporary name is shortened
    write(long, mlp_plan)
    assert (long / "pipecc.json").is_file() and leftovers(tmp_path) == []


def test_a_failed_write_leaves_no_folder_it_created(tmp_path, mlp_plan):
    def failing(tmp: Path) -> None:
        raise OSError(28, "No space left on device", str(tmp / "x"))
    with pytest.raises(PipeccError, match="cannot write .*No space left on device"):
        write(tmp_path / "a" / "b" / "out", mlp_plan, writers=[failing])
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_in_safetensors_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    """safetensors raises its own SafetensorError (not an OSError) for a full disk (issue #22
    item 6): one line naming the disk, and no folder, temporary or half-written."""
    import safetensors.torch
    from safetensors import SafetensorError

    def full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\x00" * 8)  # a partial file, as a full disk leaves it
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    code, out, err = run_cli(COMPILE + ["-o", str(tmp_path / "out"), "-q"], capsys)
    assert code == 1 and err.count("\n") == 1 and "No space left on device" in err, err
    assert err.startswith("pipecc: error: cannot write ") and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_inspect_onnx_onto_a_full_disk_leaves_no_partial_file(mlp_out, tmp_path, monkeypatch, capsys):
    """Issue #24 item 8: a full disk during `inspect --onnx` left a partial stage_0.onnx."""
    pytest.importorskip("onnxscript")
    import torch

    def full(self, destination, **kwargs):
        Path(destination).write_bytes(b"\x08\x01")  # what a full disk leaves
        raise OSError(28, "No space left on device", str(destination))
    monkeypatch.setattr(torch.onnx.ONNXProgram, "save", full)
    dest = tmp_path / "onnx"
    code, _, err = run_cli(["inspect", str(mlp_out), "--onnx", str(dest)], capsys)
    assert code == 1 and err.count("\n") == 1 and "No space left on device" in err, err
    assert not dest.exists() or list(dest.iterdir()) == []


# ----------------------------------------------------------------------------- item 4: killed compiles
def _temp(parent: Path, kind: str, host: str, pid: int, age_s: float = 0.0) -> Path:
    path = parent / f".out.pipecc-{kind}-{host}-{pid}-abc"
    path.mkdir()
    (path / "plan.json").write_text("{}")
    if age_s:
        os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temporaries_are_cleaned_live_ones_kept(tmp_path, mlp_plan):
    host, other = torch_compile.HOST, "0" * 8 if torch_compile.HOST != "0" * 8 else "1" * 8
    dead = _temp(tmp_path, "new", host, _dead_pid())
    live = _temp(tmp_path, "new", host, os.getppid())
    far_young = _temp(tmp_path, "new", other, 12345)
    far_old = _temp(tmp_path, "new", other, 12346, age_s=2 * 3600)
    legacy = tmp_path / ".out.pipecc-k2j3h4"  # before pids were recorded
    legacy.mkdir()
    os.utime(legacy, (time.time() - 2 * 3600,) * 2)
    plan_tmp = tmp_path / f".plan.json.pipecc-file-{host}-{_dead_pid()}-zz"
    plan_tmp.write_text("{")
    write(tmp_path / "out", mlp_plan)
    assert not dead.exists() and not far_old.exists() and not legacy.exists()
    assert live.exists() and far_young.exists()
    from pipecc.cli.args import write_atomic
    write_atomic(str(tmp_path / "plan.json"), "{}")
    assert not plan_tmp.exists()


def test_a_kill_between_the_renames_puts_the_old_folder_back(tmp_path, mlp_plan):
    out = write(tmp_path / "out", mlp_plan)
    (out / "notes.txt").write_text("mine")
    old = tmp_path / f".out.pipecc-old-{torch_compile.HOST}-{_dead_pid()}-q"
    old.mkdir()
    os.replace(out, old / "previous")  # killed here: OUT missing, the old one aside
    torch_compile.clean_stale_temps(out)
    assert (out / "notes.txt").read_text() == "mine" and leftovers(tmp_path) == []


KILLED = """
import sys, time
from pipecc import driver
from pipecc.backends.torch import cut_stages, write_output
analysis = driver.analyze(sys.argv[1], batch_size=2)
plan, graph = driver.plan(analysis, "cpu,cpu", microbatches=1)
def hang(tmp):
    print("writing", flush=True)
    time.sleep(600)
write_output(sys.argv[2], graph, plan, cut_stages(graph, plan.stage_of()), writers=[hang])
"""


def test_sigkill_mid_compile_keeps_out_and_the_next_compile_cleans_up(tmp_path, mlp_plan):
    out = write(tmp_path / "out", mlp_plan)
    (out / "notes.txt").write_text("mine")
    before = snapshot(out)
    proc = subprocess.Popen([sys.executable, "-c", KILLED, MLP, str(out)], stdout=subprocess.PIPE,
                            text=True, cwd=ROOT)
    try:
        assert proc.stdout.readline().strip() == "writing"
    finally:
        proc.kill()  # SIGKILL
        proc.wait(timeout=60)
    assert snapshot(out) == before and len(leftovers(tmp_path)) == 1
    write(out, mlp_plan)
    assert leftovers(tmp_path) == [] and (out / "notes.txt").read_text() == "mine"


# ----------------------------------------------------------------------------- item 7: terminal
@pytest.mark.parametrize("text,shown", [
    ("plain µs ² ✓ ×", "plain µs ² ✓ ×"),
    ("a\x1b[2Jb", "a\\x1b[2Jb"),
    ("line\rover", "line\\rover"),
    ("csi\x9b31m", "csi\\x9b31m"),
    ("bidi\u202etxt", "bidi\\u202etxt"),
    ("del\x7f nbsp\xa0 nl\n tab\t bell\x07 ls\u2028", "del\\x7f nbsp\\xa0 nl\\n tab\\t bell\\x07 ls\\u2028"),
])
def test_printable_escapes_every_control_character(text, shown):
    from pipecc.report.formatting import printable, terminal_text, text_table
    assert printable(text) == shown and shown in text_table(["name"], [[text]])
    assert terminal_text("a\nb\rc\x1b") == "a\nb\\rc\\x1b"  # newlines stay
    assert terminal_text(f"{text}\n{text}").split("\n") == [printable(t) for t in f"{text}\n{text}".split("\n")]


def test_progress_lines_are_escaped():
    import io
    stream = io.StringIO()
    p = progress.Progress(stream, verbose=True, force=True, notices=True)
    with p.step("tracing \x1b[2Jgpt"):
        p.explain("split \rlm_head")
    p.notice("kept \x9bnotes")
    text = stream.getvalue().replace("\r\033[K", "")  # progress's own redraw sequence
    assert "\\x1b[2Jgpt" in text and "\\rlm_head" in text and "\\x9bnotes" in text
    assert all(ch.isprintable() or ch == "\n" for ch in text), repr(text)


HOSTILE = "\x1b[2J\r\x9b31m\u202e"


@pytest.fixture(scope="module")
def hostile_onnx(tmp_path_factory) -> Path:
    onnx = pytest.importorskip("onnx")
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    def tensor(name: str):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, ["B", 4])
    weight = numpy_helper.from_array(np.ones((4, 4), dtype="float32"), name="w" + HOSTILE)
    nodes = [helper.make_node("Gemm", ["x" + HOSTILE, "w" + HOSTILE], ["h" + HOSTILE],
                              name="gemm" + HOSTILE, transB=1),
             helper.make_node("Relu", ["h" + HOSTILE], ["r" + HOSTILE], name="relu" + HOSTILE),
             helper.make_node("Tanh", ["r" + HOSTILE], ["y" + HOSTILE], name="tanh" + HOSTILE)]
    graph = helper.make_graph(nodes, "g" + HOSTILE, [tensor("x" + HOSTILE)], [tensor("y" + HOSTILE)], [weight])
    path = tmp_path_factory.mktemp("hostile") / "hostile.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_hostile_onnx_names_never_reach_the_terminal_raw(hostile_onnx, tmp_path, capsys):
    out = str(tmp_path / "out")
    runs = [["cost", str(hostile_onnx)], ["plan", str(hostile_onnx), "-d", "cpu,cpu", "-v"],
            ["compile", str(hostile_onnx), "-d", "cpu,cpu", "--use-all-devices", "-o", out, "-v"],
            ["inspect", out, "-v"],
            ["inspect", out, "--stage", "0"], ["inspect", out, "--stage", "1"],
            ["inspect", out, "--format", "dot"]]
    for argv in runs:
        code, text, err = run_cli(argv, capsys)
        assert code == 0, (argv, err)
        raw = [ch for ch in text + err if not ch.isprintable() and ch != "\n"]
        assert raw == [], (argv, raw)
    assert "relu\\x1b[2J\\r\\x9b31m\\u202e" in run_cli(["inspect", out], capsys)[1]
    for argv in (["plan", str(hostile_onnx), "-d", "cpu,cpu", "--json"], ["cost", str(hostile_onnx), "--json"],
                 ["inspect", out, "--format", "json", "--stage", "0"]):
        code, text, _ = run_cli(argv, capsys)
        assert code == 0 and text.isascii()  # json.dumps escapes: the names come back exact
        assert "relu" + HOSTILE in strings(json.loads(text))


def strings(data) -> set[str]:
    if isinstance(data, str):
        return {data}
    values = data.values() if isinstance(data, dict) else data if isinstance(data, list) else []
    return set().union(*[strings(v) for v in values]) if values else set()


# ----------------------------------------------------------------------------- item 10
def test_load_has_the_plan(mlp_out):
    import pipecc
    pm = pipecc.load(mlp_out)
    assert isinstance(pm.plan, Plan) and pm.plan.dumps() == Plan.from_json(
        json.loads((mlp_out / "plan.json").read_text())).dumps()


def test_help_texts_say_what_they_mean():
    parser = cli.build_parser()
    texts = [parser.format_help()]
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    texts += [p.format_help() for p in sub.choices.values()]
    assert not [t for t in texts if "CONTRACT" in t or "§" in t]


def test_inspect_shows_an_fpga_stage_against_its_bram(tmp_path, capsys):
    from pipecc.report.compiled import load_compiled, summary_json
    from pipecc.targets.devices import load_catalog
    from pipecc.targets.fpga_timing import BRAM18_BYTES
    analysis = driver.analyze(MLP, batch_size=1)
    plan, graph = driver.plan(analysis, "cpu,u250", training=False)
    assert 1 in plan.fpga_stages()
    out = driver.compile(analysis, plan, graph, tmp_path / "out").out
    bram = load_catalog().devices["u250"]["fpga"]["bram18"] * BRAM18_BYTES
    stage = summary_json(load_compiled(out))["stages"][1]
    assert stage["memory_capacity_bytes"] == bram and stage["memory_kind"] == "BRAM"
    code, text, _ = run_cli(["inspect", str(out)], capsys)
    row = next(line for line in text.splitlines() if line.startswith("1 "))
    assert code == 0 and row.count(" BRAM") == 1 and "64GB" not in row and "10.6MB" in row


# ----------------------------------------------------------------------------- issue #24 item 4: csim links
@pytest.fixture(scope="module")
def fpga_out(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fpga") / "out"
    analysis = driver.analyze(MLP, batch_size=1)
    plan, graph = driver.plan(analysis, "cpu,u250", training=False)
    assert 1 in plan.fpga_stages()
    return driver.compile(analysis, plan, graph, out).out


@pytest.mark.parametrize("linked", ["csim_build", "tb_data", "tb_data/csim_output.bin"])
def test_csim_never_writes_or_deletes_through_a_link(linked, fpga_out, tmp_path, capsys):
    """A `csim_build` link made `pipecc csim` write its build into the folder it named; a
    `tb_data` link made it delete an outside csim_output.bin. Refused in one line, before any
    file is touched."""
    out = tmp_path / "out"
    shutil.copytree(fpga_out, out, symlinks=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "csim_output.bin").write_bytes(b"keep")
    (outside / "stamp").write_text("theirs")
    link = out / "stage_1" / "hls" / linked
    if link.exists():
        shutil.rmtree(link) if link.is_dir() else link.unlink()
    target = outside / "csim_output.bin" if linked.endswith(".bin") else outside
    link.symlink_to(target)
    before = snapshot(outside)
    code, text, err = run_cli(["csim", str(out)], capsys)
    assert code == 1 and err.count("\n") == 1, err
    assert f"{link} is a symbolic link" in err and "will not follow it" in err, err
    assert snapshot(outside) == before and (outside / "csim_output.bin").read_bytes() == b"keep"
    assert (outside / "stamp").read_text() == "theirs"
