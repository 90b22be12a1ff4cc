"""Measured costs: `pipecc profile` times a model's nodes and the link on this machine.

The analytic cost model (`pipecc.cost` + the device catalog) predicts times from FLOPs and
bytes; this package measures them instead, for the devices that are really here (CPU; CUDA
GPUs where torch sees them; FPGAs keep their analytic model). The planner can read a
profile in place of the roofline figures; that is its business, not this package's.

    measure.py   time every call node, forward and backward, at one micro-batch size
    fit.py       t(b) = a + c*b per node (overhead a >= 0, slope c >= 0), relative error
    link.py      latency + bytes/bandwidth between two ranks (gloo; NCCL between GPUs)
    crosshost.py the same between hosts: one process per host around node 0's store
    fixed.py     the fixed costs per op call, micro-batch, step and message, one rank per
                 device running at once (`pipecc.targets.fixed_costs` reads them)
    cache.py     profiles keyed by model file hash, arguments, batch, devices, versions
    profiler.py  `profile_model`: the steps above, in order, into one JSON document

The profile JSON (format "pipecc.profile", version 1)::

    {"format": "pipecc.profile", "version": 1, "cache_key": str,
     "model": {"name", "path", "sha256", "args"}, "batch_size": int,
     "microbatch_sizes": [1, 2, 4, ..., B], "torch_version": str, "pipecc_version": str,
     "host": {"cpu": str, "platform": str},
     "devices": [{"name", "kind", "placement", "torch_device": str | null}],  # spec order
     "timing": {"warmup", "repeat", "statistic": "median", "curve": str},
     "targets": [{"torch_device": "cpu", "hardware": str, "devices": ["cpu"],
                  "nodes": [{"name", "op", "samples": [{"mb", "fwd_s", "bwd_s"}],
                             "fit": {"fwd": {"a", "c", "error"}, "bwd": {"a", "c", "error"}},
                             "fit_error": float}]}],
     "link": {"scope": "in-host", "backend", "devices", "latency_s", "bandwidth_Bps",
              "fit_error", "statistic", "warmup", "repeat",
              "samples": [{"bytes", "seconds"}]} | null,
     "links": [the "link" above if any, then with --nnodes N one per node r = 1 .. N-1:
               {"scope": "cross-host", "endpoint": "HOST:PORT", "nodes": [0, r],
                "hosts": [str, str], "backend", "devices", "latency_s", ... as "link"}],
     "fixed_costs": {"<device name>": {"op_forward_s", "op_backward_s", "microbatch_s",
                                       "step_s", "message_s", "ranks": N, "fit_error",
                                       "source": str}},   # absent with --no-fixed-costs
     "notes": [str]}

Times are seconds. A node's time at micro-batch b is `a + c*b` of its fit; `error` is the
largest relative residual of the fit over its samples. `nodes` lists every call node
(call_module, call_function, call_method) by its human name, as in `pipecc cost --json`;
placeholders and attribute reads do no work and are left out. `link` is null with one
device, or with `--no-link`. Older profiles have no `links` and no `scope` (their `link` is
in-host); readers take `links` when present, else `[link]`. The planner
(`pipecc.targets.profiled`) reads `link` only: its cluster model has no hosts, so it plans
with the in-host figure and the cross-host ones are recorded, not used. `fixed_costs` (absent
in older profiles, which still load) has one entry per CPU or GPU device name of the spec,
measured with one rank per such device running at once (`ranks`); FPGA devices have none.
"""

from pipecc.profile.crosshost import Rendezvous, summary_line
from pipecc.profile.profiler import FORMAT, VERSION, ProfileResult, cross_host_side, profile_model

__all__ = ["FORMAT", "VERSION", "ProfileResult", "Rendezvous", "cross_host_side", "profile_model",
           "summary_line"]
