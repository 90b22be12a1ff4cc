"""`profile_model`: time a model's nodes on this machine's devices and measure the link.

    devices spec ─► targets (torch devices here) ─► cache lookup ─► analyze (driver)
    ─► per target: time every node at micro-batch sizes 1, 2, 4, ..., B ─► fit curves
    ─► [link ping-pong] ─► [fixed costs: one rank per device, all at once] ─► profile JSON
    ─► cache store

With `--nnodes N` (a `Rendezvous`), node 0 first measures its links to the other hosts
(`crosshost`, right after the cheap checks: the other nodes wait at the rendezvous) and adds
them to `links` after the cache lookup or store: the cache keeps one host's measurements
only. The other nodes call `cross_host_side` and time nothing.

A *target* is one torch device that stands for one or more devices of the spec: `cpu,cpu`
is timed once on `cpu`; `2xa100` once on `cuda:0`; `a100@cuda:1` on `cuda:1`; `a100@cpu`
(an A100 modelled, the CPU running it) on `cpu`. FPGA devices are not timed: their costs
come from the analytic FPGA model (`pipecc devices`), and the profile says so in `notes`.
A GPU in the spec on a machine without CUDA is an error, not a silent CPU fallback: the
numbers would describe the wrong hardware.

Fixed costs (`fixed.py`, the profile's "fixed_costs" section that `pipecc.targets.fixed_costs`
reads): one process per CPU or GPU device of the spec, as many as `pipecc run` starts for the plan,
each on its torch device with the threads below, measuring at once; `fixed_costs=False`
(`--no-fixed-costs`) leaves the section out. They do not depend on the model: the cache keeps them
apart from the node timings, keyed on the ranks' devices, the threads, the host and the versions
(`_fixed_costs`), so `cpu,cpu` and `cpu,u250` still share one cached timing of the nodes.

Threads: nodes are timed with torch's intra-op threads at $OMP_NUM_THREADS, else 1 (`cpu_threads`),
the count each rank of `pipecc run` gets, so a profiled plan predicts what a run does; the
profile records it in `timing.cpu_threads` and the cache keys on it.
"""

from __future__ import annotations

import contextlib
import copy
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from pipecc import progress
from pipecc.errors import PipeccError, UsageError
from pipecc.profile import cache
from pipecc.profile.crosshost import Rendezvous, link_device, measure_cross_host
from pipecc.profile.fit import fit_affine
from pipecc.profile.fixed import fixed_costs_section, measure_fixed_costs
from pipecc.profile.link import measure_link
from pipecc.profile.measure import TIMED_OPS, Sample, microbatch_sizes, time_nodes

__all__ = ["FORMAT", "VERSION", "Target", "ProfileResult", "Rendezvous", "cross_host_side",
           "profile_model", "profile_graph", "resolve_targets"]

FORMAT = "pipecc.profile"
VERSION = 1


@dataclass(frozen=True)
class Target:
    """A torch device of this machine and the spec devices it is timed for."""

    torch_device: str         # "cpu", "cuda:0"
    hardware: str             # CPU model or GPU name
    devices: tuple[str, ...]  # catalog names, in spec order, without repeats

    def to_json(self) -> dict[str, Any]:
        return {"torch_device": self.torch_device, "hardware": self.hardware,
                "devices": list(self.devices)}


@dataclass
class ProfileResult:
    data: dict[str, Any]           # the profile JSON document
    cache_hit: bool
    cache_path: Path | None        # where it is (or was just) cached; None with no cache


def resolve_targets(cluster: Any) -> tuple[list[Target], list[str]]:
    """The torch devices to time on, and notes on the spec devices that are not timed.

    Raises PipeccError when a device needs hardware this machine lacks."""
    by_device: dict[str, list[str]] = {}
    notes: list[str] = []
    for d in cluster.devices:
        if d.kind == "fpga":
            note = (f"{d.name}: FPGA, not timed; its costs come from the analytic FPGA model "
                    "(see `pipecc devices`)")
            if note not in notes:
                notes.append(note)
            continue
        where = _torch_device(d.name, d.kind, d.placement)
        names = by_device.setdefault(where, [])
        if d.name not in names:
            names.append(d.name)
    if not by_device:
        raise PipeccError("no device in --devices can be timed on this machine (FPGA costs come "
                          "from the analytic model); add cpu or a GPU, e.g. --devices cpu,u250")
    return [Target(dev, _hardware(dev), tuple(names)) for dev, names in by_device.items()], notes


def _torch_device(name: str, kind: str, placement: str | None) -> str:
    place = placement or ("cuda" if kind == "gpu" else "cpu")
    try:
        dev = torch.device(place)
    except (RuntimeError, ValueError):
        raise UsageError(f"placement {place!r} of device '{name}' is not a torch device "
                         "(use e.g. cpu or cuda:1)") from None
    if dev.type == "cpu":
        return "cpu"
    if dev.type != "cuda":
        raise PipeccError(f"device '{name}' is placed on {dev}; pipecc profile times on cpu and "
                          "cuda only")
    if not torch.cuda.is_available():
        raise PipeccError(f"device '{name}' is a GPU but CUDA is not available here (torch "
                          f"{torch.__version__}); run pipecc profile on the GPU host, or "
                          f"time the CPU with --devices cpu (or {name}@cpu)")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise PipeccError(f"device '{name}' is placed on cuda:{index} but this machine has "
                          f"{torch.cuda.device_count()} GPU(s); use cuda:0..cuda:"
                          f"{torch.cuda.device_count() - 1}")
    return f"cuda:{index}"


def _hardware(torch_device: str) -> str:
    if torch_device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(torch_device))
    return host_cpu_name()


def host_cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _link_plan(targets: Sequence[Target]) -> tuple[str, tuple[str, str], str | None]:
    """(backend, (device of rank 0, device of rank 1), note): NCCL between two GPUs when
    the spec has GPUs and this machine two of them, else gloo between CPU processes."""
    gpus = [t.torch_device for t in targets if t.torch_device.startswith("cuda")]
    if gpus:
        import torch.distributed as dist
        count = torch.cuda.device_count()
        nccl = dist.is_available() and dist.is_nccl_available()
        if count >= 2 and nccl:
            second = gpus[1] if len(gpus) > 1 else next(
                f"cuda:{i}" for i in range(count) if f"cuda:{i}" != gpus[0])
            return "nccl", (gpus[0], second), None
        why = "one GPU here" if count < 2 else "torch has no NCCL"
        return "gloo", ("cpu", "cpu"), f"link: {why}, so the gloo CPU link was measured"
    return "gloo", ("cpu", "cpu"), None


def profile_model(path: str | Path, devices: Any, *, model_args: dict[str, Any] | None = None,
                  batch_size: int = 1, warmup: int = 2, repeat: int = 5, link: bool = True,
                  use_cache: bool = True, cache_directory: Path | None = None,
                  symbols: Sequence[Any] = (), debug: bool = False,
                  rendezvous: Rendezvous | None = None, fixed_costs: bool = True) -> ProfileResult:
    """Profile a .py model file on the devices of `devices` (a spec string or Cluster).

    `symbols` (`--symbol`) only shape the analysis; the timings do not depend on them.
    `rendezvous` (node 0 of several hosts) adds the cross-host links to `links`; `fixed_costs`
    measures the "fixed_costs" section (module docstring)."""
    from pipecc import __version__, driver

    cluster = _cluster(devices)
    if rendezvous is not None and rendezvous.node_rank != 0:
        raise ValueError("profile_model runs on node 0; the other nodes call cross_host_side")
    if warmup < 0 or repeat < 1:
        raise UsageError(f"need --warmup >= 0 and --repeat >= 1, got {warmup} and {repeat}")
    path = Path(path)
    if not path.is_file():
        raise PipeccError(f"model file {str(path)!r} does not exist")
    if path.suffix != ".py":
        raise PipeccError(f"pipecc profile needs a .py model file, got {path.name}: an ONNX "
                          "file has no example_inputs(batch) to make micro-batches with")
    targets, notes = resolve_targets(cluster)
    cross: list[dict[str, Any]] = []
    if rendezvous is not None and rendezvous.nnodes > 1:
        with progress.step(f"measuring the links to {rendezvous.nnodes - 1} other host(s) "
                           f"(rendezvous {rendezvous.endpoint})"):
            cross = measure_cross_host(rendezvous, *link_device([t.torch_device for t in targets]))
    link_spec = _link_plan(targets) if link and len(cluster.devices) > 1 else None
    if link_spec and link_spec[2]:
        notes.append(link_spec[2])
    model_args = dict(model_args or {})
    sizes = microbatch_sizes(batch_size)
    sha = cache.file_sha256(path)
    threads = cpu_threads()
    # NOTE: one rank per device `pipecc run` would start for a plan on every device of the spec
    ranks = [(d.name, _torch_device(d.name, d.kind, d.placement)) for d in cluster.devices
             if d.kind != "fpga"] if fixed_costs else []
    key = cache.cache_key({
        "format": FORMAT, "version": VERSION, "pipecc": __version__, "torch": torch.__version__,
        "model_sha256": sha, "model_args": model_args, "batch_size": batch_size,
        "targets": [t.to_json() for t in targets], "host_cpu": host_cpu_name(),
        "warmup": warmup, "repeat": repeat, "link": link_spec[:2] if link_spec else None,
        "cpu_threads": threads})
    # NOTE: what describes this spec rather than the measurements (its device list, the
    # notes on it) is not in the key: `cpu,cpu` and `cpu,u250` share one cached timing
    spec_part = {"devices": [{"name": d.name, "kind": d.kind, "placement": d.placement,
                              "torch_device": None if d.kind == "fpga" else
                              _torch_device(d.name, d.kind, d.placement)}
                             for d in cluster.devices], "notes": notes}
    if use_cache:
        hit = cache.load(key, cache_directory)
        if hit is not None:
            where = (cache_directory or cache.cache_dir()) / f"{key}.json"
            progress.explain(f"profile of {path.name} from the cache ({where})")
            hit["model"]["path"] = str(path.resolve())
            hit.update(spec_part)
            hit.update(_fixed_costs(ranks, threads, use_cache, cache_directory))
            return ProfileResult(_with_cross_host(hit, cross), True, where)

    analysis = driver.analyze(path, model_args=model_args, batch_size=batch_size,
                              symbols=symbols, debug=debug)
    assert analysis.spec is not None  # a .py file
    with torch_threads(threads):
        timings = [dict(t.to_json(), nodes=profile_graph(analysis.graph.gm, analysis.spec.make_inputs,
                                                         t.torch_device, sizes, warmup=warmup,
                                                         repeat=repeat))
                   for t in targets]
    link_data = None
    if link_spec:
        backend, pair, _ = link_spec
        with progress.step(f"measuring the {backend} link"):
            link_data = measure_link(backend, pair)
    data = {
        "format": FORMAT, "version": VERSION, "cache_key": key,
        "model": {"name": path.stem, "path": str(path.resolve()), "sha256": sha,
                  "args": model_args},
        "batch_size": batch_size, "microbatch_sizes": sizes,
        "torch_version": torch.__version__, "pipecc_version": __version__,
        "host": {"cpu": host_cpu_name(), "platform": platform.platform()},
        "devices": spec_part["devices"],
        "timing": {"warmup": warmup, "repeat": repeat, "statistic": "median", "cpu_threads": threads,
                   "curve": "t(b) = a + c*b, a >= 0, c >= 0, least relative squares"},
        "targets": timings, "link": link_data, "links": [link_data] if link_data else [],
        "notes": notes}
    stored = cache.store(key, data, cache_directory) if use_cache else None
    if stored:
        progress.explain(f"profile cached as {stored}")
    data.update(_fixed_costs(ranks, threads, use_cache, cache_directory))
    return ProfileResult(_with_cross_host(data, cross), False, stored)


def _fixed_costs(ranks: Sequence[tuple[str, str]], threads: int, use_cache: bool,
                 directory: Path | None) -> dict[str, Any]:
    """{"fixed_costs": section} measured with one rank per (device name, torch device) of
    `ranks` at once, or from the cache; {} with no ranks (`--no-fixed-costs`)."""
    if not ranks:
        return {}
    from pipecc import __version__
    key = cache.cache_key({"format": FORMAT, "part": "fixed_costs", "pipecc": __version__,
                           "torch": torch.__version__, "host_cpu": host_cpu_name(),
                           "ranks": [list(r) for r in ranks], "cpu_threads": threads})
    hit = cache.load(key, directory) if use_cache else None
    if hit is not None and isinstance(hit.get("fixed_costs"), dict):
        return {"fixed_costs": hit["fixed_costs"]}
    with progress.step(f"measuring the fixed costs on {len(ranks)} rank(s) at once"):
        section = fixed_costs_section(measure_fixed_costs([t for _, t in ranks], threads),
                                      [n for n, _ in ranks], host_cpu_name(), threads)
    if use_cache:
        cache.store(key, {"cache_key": key, "fixed_costs": section}, directory)
    return {"fixed_costs": section}


def cpu_threads() -> int:
    """The intra-op threads `pipecc run` gives each rank: $OMP_NUM_THREADS, else 1
    (`pipecc.cli.run` sets OMP_NUM_THREADS=1 for its children unless it is set). The nodes
    are timed with as many, so a profiled plan predicts what a run does."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    try:
        return max(1, int(value)) if value else 1
    except ValueError:
        return 1


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to `n` inside, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _cluster(devices: Any) -> Any:
    from pipecc.targets.devices import Cluster, DeviceSpecError, parse_devices
    try:
        return devices if isinstance(devices, Cluster) else parse_devices(devices)
    except DeviceSpecError as exc:
        raise UsageError(str(exc)) from exc


def _with_cross_host(data: dict[str, Any], cross: list[dict[str, Any]]) -> dict[str, Any]:
    """`data` with `links` = its in-host link (if any), then the cross-host ones (also for a
    cached profile from before `links` existed), and a note when there are cross-host ones."""
    data["links"] = ([data["link"]] if data.get("link") else []) + cross
    if cross:
        data["notes"] = [*data.get("notes", []),
                         "links: the cross-host links are recorded in \"links\" (scope "
                         "cross-host); `pipecc plan --profile` plans with the in-host link only, "
                         "as its cluster model has no hosts"]
    return data


def cross_host_side(devices: Any, rendezvous: Rendezvous) -> dict[str, Any]:
    """Node r > 0 of several hosts: its end of the link to node 0 (the GPU of `devices` if
    it has one and NCCL is there, else the CPU); returns node 0's record of it."""
    targets, _ = resolve_targets(_cluster(devices))
    with progress.step(f"measuring the link to node 0 (rendezvous {rendezvous.endpoint})"):
        return measure_cross_host(rendezvous, *link_device([t.torch_device for t in targets]))[0]


def profile_graph(gm: torch.fx.GraphModule, make_inputs: Any, torch_device: str,
                  sizes: Sequence[int], *, warmup: int = 2, repeat: int = 5) -> list[dict[str, Any]]:
    """Time and fit every call node of `gm` on `torch_device`; `gm` is left as found.

    A graph whose tensors are elsewhere is timed on a copy (moving it would move the
    caller's model)."""
    device = torch.device(torch_device)
    tensors = [*gm.parameters(), *gm.buffers()]
    work = gm
    if any(t.device != device for t in tensors):
        try:
            work = copy.deepcopy(gm).to(device)
        except Exception as exc:
            raise PipeccError(f"cannot move the model to {device}: {type(exc).__name__}: "
                              f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}") from exc
    count = sum(1 for n in gm.graph.nodes if n.op in TIMED_OPS)
    with progress.step(f"timing {count} nodes on {device} at micro-batch sizes "
                       f"{', '.join(map(str, sizes))}",
                       total=len(sizes)) as step:
        nodes = time_nodes(work, make_inputs, device, sizes, warmup=warmup, repeat=repeat,
                           on_size=lambda b: step.advance())
    return [node_entry(n["name"], n["op"], n["samples"]) for n in nodes]


def node_entry(name: str, op: str, samples: Sequence[Sample]) -> dict[str, Any]:
    """{name, op, samples, fit: {fwd: {a, c, error}, bwd: {...}}, fit_error}."""
    mbs = [s.mb for s in samples]
    fwd = fit_affine(mbs, [s.fwd_s for s in samples])
    bwd = fit_affine(mbs, [s.bwd_s for s in samples])
    return {"name": name, "op": op, "samples": [s.to_json() for s in samples],
            "fit": {"fwd": fwd.to_json(), "bwd": bwd.to_json()},
            "fit_error": max(fwd.error, bwd.error)}
