"""C simulation with g++: build a written stage into a testbench and a shared library, run it.

    stage_<i>/ ─► g++ (3 translation units in parallel) ─► csim_build/<top>_tb  (testbench)
                                                       ─► csim_build/lib<top>.so (C ABI:
                                                          run_stage / run_stage_batch /
                                                          run_stage_beats, for ctypes)
    testbench on tb_data/ ─► CsimResult (errors vs torch, FIFO high-water marks, deadlock)

The ap_types headers come from `$PIPECC_AP_TYPES`, else `$XILINX_HLS/include`, else the
hls4ml wheel (Apache-2.0; found without importing hls4ml). `hls_stream.h` is pipecc's own
(csim_include/ comes first on the include path).

Builds are cached on the sources' hash, but a cached build is reused only when this machine
built it: `csim_build/stamp` holds the sources' hash and an HMAC, under a key that never leaves
this machine (`host_key`, in pipecc's cache folder), of the sha256 of the library and the
testbench. A `csim_build/` shipped in a folder from elsewhere, or a library swapped after the
build, fails the check and is rebuilt from the sources (a compiled folder is code, like a
pickle: only run folders you trust — but a prebuilt binary is never taken on trust).
"""

from __future__ import annotations

import hashlib
import hmac
import importlib.util
import json
import math
import os
import secrets
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipecc.errors import PipeccError
from pipecc.runtime.atomic import temp_prefix

CXXFLAGS = ["-std=c++14", "-O2", "-Wno-unknown-pragmas", "-Wno-unused-label",
            "-Wno-uninitialized", "-Wno-maybe-uninitialized"]


class CsimError(PipeccError):
    """The C simulation could not be built or run (the message has the compiler's words)."""


@dataclass
class CsimResult:
    max_abs_err: float
    max_rel_err: float          # max |csim - torch| / max |torch|
    passed: bool
    compile_s: float            # 0.0 when the build was cached
    fifo_occupancy: dict[str, int] = field(default_factory=dict)  # FIFO -> high-water mark
    deadlock: bool = False
    message: str = ""
    tolerance: float = 0.0      # absolute, from stage.json
    fifo_depth: dict[str, int] = field(default_factory=dict)      # FIFO -> depth it ran with
    error_sigma: float = 0.0    # fixed point: statistical error estimate (stage.json)


@dataclass
class Build:
    exe: Path
    lib: Path
    compile_s: float
    cached: bool


def find_ap_types() -> Path | None:
    """Folder holding ap_fixed.h: $PIPECC_AP_TYPES, $XILINX_HLS/include, or the hls4ml wheel."""
    candidates = [os.environ.get("PIPECC_AP_TYPES")]
    if os.environ.get("XILINX_HLS"):
        candidates.append(os.path.join(os.environ["XILINX_HLS"], "include"))
    spec = importlib.util.find_spec("hls4ml")
    if spec and spec.submodule_search_locations:
        candidates.append(os.path.join(list(spec.submodule_search_locations)[0],
                                       "templates", "vivado", "ap_types"))
    for c in candidates:
        if c and (Path(c) / "ap_fixed.h").is_file():
            return Path(c)
    return None


def find_compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def toolchain_problem() -> str | None:
    """Why C simulation cannot run here (None when it can)."""
    if find_compiler() is None:
        return "no C++ compiler (g++ or $CXX) on PATH"
    if find_ap_types() is None:
        return ("no ap_types headers: pip install --no-deps hls4ml==1.3.0, or set "
                "PIPECC_AP_TYPES / XILINX_HLS")
    return None


def _meta(stage_dir: Path) -> dict:
    return json.loads((stage_dir / "stage.json").read_text())


# What the build and the testbench write or delete in a stage's folder
WRITTEN = ("csim_build", "tb_data", "tb_data/csim_output.bin", "csim_fifo.txt")


def check_no_links(stage_dir: str | Path) -> None:
    """Refuse (one line) a stage folder where pipecc would write or delete through a symbolic
    link: the folder itself, `csim_build/` (or a file in it), `tb_data/` or the files the
    testbench writes. A folder from elsewhere could point them at the user's files."""
    stage_dir = Path(stage_dir)
    linked = [stage_dir] if stage_dir.is_symlink() else []
    linked += [stage_dir / rel for rel in WRITTEN if (stage_dir / rel).is_symlink()]
    build_dir = stage_dir / "csim_build"
    if build_dir.is_dir() and not build_dir.is_symlink():
        linked += [p for p in build_dir.iterdir() if p.is_symlink()]
    if linked:
        raise CsimError(f"{linked[0]} is a symbolic link; the C simulation writes and deletes there, so pipecc "
                        "will not follow it: remove the link (or compile the folder again)")


def build(stage_dir: str | Path) -> Build:
    """Compile the stage (cached): testbench executable and shared library."""
    check_no_links(stage_dir)
    stage_dir = Path(stage_dir).resolve()
    problem = toolchain_problem()
    if problem:
        raise CsimError(f"cannot build the C simulation: {problem}")
    cxx, ap = find_compiler(), find_ap_types()
    top = _meta(stage_dir)["top"]
    out = stage_dir / "csim_build"
    out.mkdir(exist_ok=True)
    exe, lib = out / f"{top}_tb", out / f"lib{top}.so"
    inc = [f"-I{stage_dir / 'csim_include'}", f"-I{stage_dir / 'firmware'}", f"-I{ap}"]
    units = {"top": stage_dir / "firmware" / f"{top}.cpp",
             "bridge": stage_dir / "tb" / f"{top}_bridge.cpp",
             "tb": stage_dir / "tb" / f"{top}_tb.cpp"}
    digest = hashlib.sha256(" ".join([str(cxx), str(ap)] + CXXFLAGS).encode())
    from pipecc.runtime.folder import read_checked
    for path in sorted(p for d in ("firmware", "tb", "csim_include")
                       for p in (stage_dir / d).glob("*.*")):
        # a compiled folder's sources are the ones its compile recorded (pipecc.runtime.folder_sums)
        digest.update(path.name.encode() + read_checked(path))
    stamp = out / "stamp"
    if stamp.is_file() and stamp.read_text() == _stamp(digest.hexdigest(), exe, lib):
        return Build(exe, lib, 0.0, True)
    stamp.unlink(missing_ok=True)
    start = time.perf_counter()
    _run_all([[cxx, *CXXFLAGS, "-fPIC", "-pthread", *inc, "-c", str(src), "-o", str(out / f"{k}.o")]
              for k, src in units.items()])
    objs = [str(out / f"{k}.o") for k in ("bridge", "top")]
    _run_all([[cxx, "-pthread", str(out / "tb.o"), *objs, "-o", str(exe)],
              [cxx, "-shared", "-pthread", *objs, "-o", str(lib)]])
    stamp.write_text(_stamp(digest.hexdigest(), exe, lib))
    return Build(exe, lib, time.perf_counter() - start, False)


def cache_dir() -> Path:
    """pipecc's per-user cache: `$PIPECC_CACHE_DIR`, else `$XDG_CACHE_HOME/pipecc`, else ~/.cache/pipecc."""
    if os.environ.get("PIPECC_CACHE_DIR"):
        return Path(os.environ["PIPECC_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pipecc"


_SESSION_KEY = secrets.token_bytes(32)  # when the cache folder cannot hold a key: reuse within this process only


def host_key() -> bytes:
    """This machine's secret for build stamps (32 random bytes, created on first use, mode 0600)."""
    path = cache_dir() / "csim-build.key"
    try:
        key = path.read_bytes()
        if len(key) == 32:
            return key
    except OSError:
        pass
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(temp_prefix(path, "file") + "key")  # pipecc's one temporary-name scheme
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
        try:
            os.link(tmp, path)  # NOTE: never replaces a key another process made meanwhile
        except FileExistsError:
            pass
        except OSError:  # no hard links here
            if not path.exists():
                os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        key = path.read_bytes()
        return key if len(key) == 32 else _SESSION_KEY
    except OSError:
        return _SESSION_KEY


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "missing"


def _stamp(sources: str, exe: Path, lib: Path) -> str:
    """The stamp of a build of `sources` whose outputs are `exe` and `lib`, as this machine signs it."""
    body = f"{sources} {_file_sha256(exe)} {_file_sha256(lib)}"
    return f"{sources} {hmac.new(host_key(), body.encode(), hashlib.sha256).hexdigest()}"


def _run_all(commands: list[list[str]]) -> None:
    """Run compiler commands in parallel; raise CsimError with the first failure's stderr."""
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for c in commands]
    for cmd, proc in zip(commands, procs):
        _, err = proc.communicate()
        if proc.returncode:
            raise CsimError(f"g++ failed on {Path(cmd[-3] if '-c' in cmd else cmd[-1]).name}: "
                            + " | ".join(err.strip().splitlines()[:12]))


def _fifo_report(stage_dir: Path) -> tuple[dict[str, int], dict[str, int]]:
    high, depth = {}, {}
    path = stage_dir / "csim_fifo.txt"
    for line in path.read_text().splitlines() if path.is_file() else []:
        name, d, h = line.rsplit(" ", 2)
        high[name], depth[name] = int(h), int(d)
    return high, depth


def csim(stage_dir: str | Path, threaded: bool = False, fifo_depth: int | dict[str, int] | None = None,
         timeout_s: float = 120.0) -> CsimResult:
    """Build (cached) and run the testbench on tb_data/ and compare with torch.

    `threaded` runs every DATAFLOW process in its own thread with bounded FIFOs (the declared
    depths, or `fifo_depth`: one depth for all internal FIFOs, or {fifo name: depth}); a
    deadlock is reported with each FIFO's occupancy instead of hanging.
    """
    check_no_links(stage_dir)
    stage_dir = Path(stage_dir).resolve()
    b = build(stage_dir)
    meta = _meta(stage_dir)
    args = [str(b.exe), str(stage_dir)] + (["--threaded"] if threaded else [])
    if isinstance(fifo_depth, int):
        args += ["--fifo-depth", str(fifo_depth)]
    elif fifo_depth:
        for name, d in fifo_depth.items():
            args += ["--fifo", f"{name}={int(d)}"]
    for stale in ("csim_fifo.txt", "tb_data/csim_output.bin"):
        (stage_dir / stale).unlink(missing_ok=True)
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return CsimResult(math.nan, math.nan, False, b.compile_s, deadlock=True,
                          message=f"C simulation did not finish in {timeout_s:g} s",
                          tolerance=meta["tolerance"])
    high, depth = _fifo_report(stage_dir)
    text = (proc.stdout + proc.stderr).strip()
    if proc.returncode not in (0, 1):
        return CsimResult(math.nan, math.nan, False, b.compile_s, high, proc.returncode == 3,
                          text, meta["tolerance"], depth)
    got = np.fromfile(stage_dir / "tb_data" / "csim_output.bin", dtype=np.float32)
    ref = np.fromfile(stage_dir / "tb_data" / "output.bin", dtype=np.float32)
    err = float(np.abs(got.astype(np.float64) - ref).max()) if ref.size else 0.0
    rel = err / max(float(np.abs(ref).max()) if ref.size else 0.0, 1e-30)
    return CsimResult(err, rel, err <= meta["tolerance"], b.compile_s, high, False, text,
                      meta["tolerance"], depth, meta.get("error_sigma", 0.0))
