"""A non-editable install: `passes`/`backends` ship only as pipecc.passes/pipecc.backends."""
from __future__ import annotations

import subprocess
import sys
import zipfile

from helpers import ROOT


def test_wheel_layout(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "-q", "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    wheel = next(tmp_path.glob("pipecc-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops <= {"pipecc", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}, tops
    for must in ["pipecc/passes/partition.py", "pipecc/backends/__init__.py", "pipecc/techniques/bpipe/search.py",
                 "pipecc/models/gpt.py", "pipecc/targets/data/devices.toml", "pipecc/cli/app.py"]:
        assert must in names, must
    assert not any(n.startswith(("passes/", "backends/", "models/", "tests/")) for n in names)
