"""Fewer devices: whether a plan over some of the given devices beats the plan over all of them.

Issue 20: on small work a pipeline over every device can lose to fewer devices (an MLP on two
CPUs: zb-h1 with one micro-batch, 77 % bubble, where one CPU has none), and the plain search
may leave a stage with negligible compute (`passes.plan_search.negligible_stages`). With
`PlanOptions.use_all_devices` False (the command line's default; `--use-all-devices` pins every
device) the driver's `plan` weighs, for each k < p (up to 4 devices; beyond, p/2, p/4, ..., 1),
the balance search on k of the devices
(`subsets`: the first k when the devices are alike, else the k fastest in their given order)
against the plan over all p; the best k, when predicted faster (or when the plan over all p
keeps a negligible stage and k devices need none), is planned in full (layer splits and the
other later steps) and kept if still faster. The chosen plan's `devices` then lists only the
devices it uses, each with its `given_index` in `--devices` (the runtime starts one rank per
listed device; the others stay idle), `options["devices_given"]` the count given, and a
decision line says how many devices it uses and why.

Not tried (the plan over all devices is kept as it is): explicit replica counts above one,
what a technique's options ask for (its `search` part's `all_devices(options)` hook: explicit
per-stage micro-batch sizes, `--activation-balancing on`), and more than
`MAX_DEVICES` devices (the first two each ask for a pipeline
over the devices as given). With a `--profile`, the balance search on k devices reads its
curves and measured links as the plan over all does.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from pipecc import techniques
from pipecc.passes.plan_search import negligible_stages
from pipecc.report.formatting import count

# NOTE: beyond this many devices the sub-clusters' link tables (k x k) cost more than the
# search: the plan over all of them is kept
MAX_DEVICES = 64

__all__ = ["MAX_DEVICES", "applies", "decide", "negligible_of_plan", "remap", "subsets"]


def applies(options: Any, p: int) -> bool:
    """Whether fewer than the `p` devices may be planned on (module docstring)."""
    return bool(1 < p <= MAX_DEVICES and not options.use_all_devices
                and (options.replicas == "auto" or options.replicas == 1)
                and not any(asks(options) for part in techniques.parts("search")
                            if (asks := getattr(part, "all_devices", None)) is not None))


def subsets(cluster: Any) -> list[tuple[list[int], Any]]:
    """(kept device indices, their cluster) for k = 1 .. p-1 devices (the halvings of p beyond 4): the first k when every
    device is alike, else the k fastest (peak FLOP/s of the catalog or cluster file, the
    figure the cost model reads) in their given order. Links are the given ones."""
    from pipecc.targets.hardware import Cluster
    devices = cluster.devices
    p = len(devices)
    alike = len(set(devices)) == 1
    fastest = sorted(range(p), key=lambda i: -max(devices[i].peak_flops.values(), default=0.0))
    out = []
    # NOTE: every k up to 4 devices; beyond, the halvings p/2, p/4, ..., 1 (each k costs a
    # balance search: 7 of them on 8 devices took minutes for large graphs)
    counts = range(1, p) if p <= 4 else sorted({max(1, p >> i) for i in range(1, p.bit_length())} - {p})
    for k in counts:
        keep = list(range(k)) if alike else sorted(fastest[:k])
        out.append((keep, Cluster(devices=tuple(devices[i] for i in keep),
                                  links=tuple(tuple(cluster.links[i][j] for j in keep) for i in keep))))
    return out


def negligible_of_plan(plan: Any) -> list[int]:
    """`negligible_stages` of a written plan (its stages' forward + backward seconds)."""
    return negligible_stages([s.forward_s + s.backward_s for s in plan.stages])


def remap(plan: Any, keep: Sequence[int]) -> Any:
    """A plan made on the devices `keep` with its devices' `given_index` into the given list:
    a new plan (`plan` stays as it was)."""
    devices = [dict(dev, given_index=keep[int(dev.get("given_index", 0))]) for dev in plan.devices]
    return dataclasses.replace(plan, devices=devices)


def _shape(plan: Any) -> str:
    ranks = len(plan.devices)
    stages = len(plan.stages)
    return (f"{count(stages, 'stage')}" + (f" x {plan.replicas} replicas" if plan.replicas > 1 else "")
            + ("" if stages * plan.replicas == ranks else f" on {count(ranks, 'device')}"))


def decide(whole: Any, alone: Any, keep: Sequence[int], p: int, why: str = "") -> tuple[Any, str]:
    """The plan to keep of `whole` (over all p devices; None when nothing fit: `why`) and
    `alone` (over the devices `keep`; None when not planned), and its decision line."""
    if alone is None:
        assert whole is not None
        return whole, f"uses all {p} devices"
    k = len(keep)
    idle = bool(whole is not None and negligible_of_plan(whole)) and not negligible_of_plan(alone)
    if whole is not None and not idle and whole.predicted_iteration_s <= alone.predicted_iteration_s:
        return whole, (f"uses all {p} devices: {_shape(whole)}, predicted {whole.predicted_iteration_s:.4g} s "
                       f"per iteration; on {k}: {_shape(alone)}, {alone.predicted_iteration_s:.4g} s")
    against = ("nothing fits on all of them: " + why.split("\n")[0] if whole is None else
               f"on all {p}: {_shape(whole)}, {whole.predicted_iteration_s:.4g} s"
               + (", with a stage of negligible compute" if idle else ""))
    return alone, (f"uses {k} of {p} devices: {_shape(alone)}, predicted {alone.predicted_iteration_s:.4g} s "
                   f"per iteration; {against} (--use-all-devices pins every device)")
