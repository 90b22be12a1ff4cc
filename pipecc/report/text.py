"""`pipecc plan` output: the stage table, the bound, the schedule decision, the baselines."""

from __future__ import annotations

from pipecc.report.tables import _table, human
from pipecc.ir.plan import Plan


def _seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} µs"


def plan_table(plan: Plan, verbose: bool = False) -> str:
    rows = []
    slowest = max(range(len(plan.stages)),
                  key=lambda i: plan.stages[i].forward_s + plan.stages[i].backward_s + plan.stages[i].comm_s)
    split_nodes = {sh: sl.node for sl in plan.split_layers for sh in sl.shards}
    for s in plan.stages:
        dev = plan.devices[s.device] if s.device < len(plan.devices) else {"name": "?"}
        shards = sorted({split_nodes[n] for n in s.nodes if n in split_nodes})
        rows.append([f"{s.index}{' *' if s.index == slowest else ''}", dev["name"],
                     s.nodes[0] if s.nodes else "-", s.nodes[-1] if s.nodes else "-",
                     human(s.forward_flops), _seconds(s.forward_s), _seconds(s.backward_s),
                     human(s.send_bytes, "B"), _seconds(s.comm_s),
                     human(s.peak_memory_bytes, "B") + (" BRAM" if dev.get("kind") == "fpga" else ""),
                     ", ".join(shards) or "-"])
    lines = [
        f"{plan.model}: batch {plan.batch_size}, {plan.microbatches} micro-batches, "
        f"schedule {plan.schedule}" + (f" (v={plan.virtual_stages})" if plan.virtual_stages > 1 else ""),
        "",
        _table(["stage", "device", "first node", "last node", "fwd FLOPs", "fwd", "bwd",
                "sends", "comm", "peak mem", "split layers"], rows),
        "",
        f"bottleneck      {_seconds(plan.bottleneck_s)} per micro-batch (stage marked *)",
        f"lower bound     {_seconds(plan.lower_bound_s)}   balance ratio {plan.balance_ratio:.3f}",
        f"iteration       {_seconds(plan.predicted_iteration_s)} predicted, bubble "
        f"{plan.bubble_fraction:.1%}",
    ]
    for sl in plan.split_layers:
        lines.append(f"split layer     {sl.node} into {sl.parts} shards {sl.sizes} (dim {sl.dim})")
    if any(d.get("kind") == "fpga" for d in plan.devices):
        lines.append(f"FPGA stages     {plan.options.get('fpga_number', 'float')}, timed by the "
                     "FPGA model of estimates.json; memory is on-chip BRAM")
    if plan.baselines:
        lines += ["", "baselines on the same cost model:"]
        lines.append(_table(["partition", "bottleneck", "ratio to bound", "vs pipecc"],
                            [[b["name"], _seconds(b["bottleneck_s"]),
                              f"{b['bottleneck_s'] / plan.lower_bound_s:.3f}",
                              f"{b['bottleneck_s'] / plan.bottleneck_s:.2f}x"
                              + ("" if b.get("fits_memory", True) else " (exceeds memory)")]
                             for b in plan.baselines]))
    if verbose:
        lines += ["", "decisions:"] + [f"  {d}" for d in plan.decisions]
        lines += [f"  rejected {a['schedule']} m={a['microbatches']}: {a['reason']}"
                  for a in plan.alternatives]
    return "\n".join(lines)
