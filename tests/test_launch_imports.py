"""`pipecc run`'s launcher checks a folder (`pipecc.cli.run.launch_plan`: its ports, weights, plan,
schedule and options) without importing torch or sympy: the ranks import them, the launcher would
only pay their ~2 s before the ranks start (`pipecc.runtime.launch_checks`,
`pipecc.runtime.folder_check`, `pipecc.runtime.dtypes`)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipecc.runtime.dtypes import TORCH_DTYPES, dtype_name
from pipecc.runtime.ports import StagePorts, boundary_digest

LAUNCH = """
import sys
from pipecc.cli.app import build_parser
from pipecc.cli.run import launch_plan
from pipecc.errors import PipeccError
try:
    launch_plan(build_parser().parse_args(sys.argv[1:]))
except PipeccError as e:
    print("error:", e)
print(sorted(m for m in ("torch", "sympy") if m in sys.modules))
"""


def launcher(*argv: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", LAUNCH, "run", *argv], capture_output=True, text=True,
                         timeout=120, check=True).stdout.strip().splitlines()
    return out


@pytest.mark.parametrize("extra", [(), ("--schedule", "1f1b", "--microbatches", "4"), ("--verify",),
                                   ("--schedule", "inference")], ids=["compiled", "1f1b", "verify", "inference"])
def test_launcher_imports_neither_torch_nor_sympy(mlp_folder: Path, extra: tuple[str, ...]) -> None:
    lines = launcher(str(mlp_folder), "--steps", "1", *extra)
    assert lines == ["[]"], lines


def test_a_refused_run_is_refused_without_torch(mlp_copy: Path) -> None:
    (mlp_copy / "stage_1" / "ports.json").write_text("{", encoding="utf-8")
    lines = launcher(str(mlp_copy), "--steps", "1")
    assert lines[0].startswith("error: ") and "ports.json is not valid JSON" in lines[0], lines
    assert lines[-1] == "[]"


def test_dtype_table_is_torchs() -> None:
    """The launcher's dtype names are torch's (the installed one's, so a torch upgrade that adds or
    renames a dtype fails here: regenerate `TORCH_DTYPES`)."""
    found = {n: str(getattr(torch, n)).removeprefix("torch.") for n in dir(torch)
             if isinstance(getattr(torch, n, None), torch.dtype)}
    assert TORCH_DTYPES == found
    assert dtype_name("Tensor") is None and dtype_name("nn") is None and dtype_name("half") == "float16"


def test_boundary_digest_is_the_same_by_name_and_by_torch_dtype(mlp_folder: Path) -> None:
    for stage in sorted(mlp_folder.glob("stage_*")):
        spec = json.loads((stage / "ports.json").read_text(encoding="utf-8"))
        by_torch, by_name = StagePorts.from_json(spec), StagePorts.from_json(spec, dtype_name)
        assert isinstance(by_torch.in_leaves[0].dtype, torch.dtype)
        for a, b in ((by_torch.in_leaves, by_name.in_leaves), (by_torch.out_leaves, by_name.out_leaves)):
            assert boundary_digest(a) == boundary_digest(b)
