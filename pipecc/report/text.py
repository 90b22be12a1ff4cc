"""`pipecc plan` output: the stage table, the bound, the schedule decision, the baselines."""

from __future__ import annotations

from typing import Any

from pipecc.ir.plan import Plan
from pipecc.report.figures import bottleneck_note, bottleneck_stage, cost_basis, first_last
from pipecc.report.formatting import count, fit_table, human, seconds, seconds_in_text, text_table, wrap
from pipecc.techniques import first_answer, parts as technique_parts


def technique_lines(plan: Plan, verbose: bool = False) -> tuple[list[str], tuple[str, ...]]:
    """Every technique's lines in a plan's summary (its package's report part: ``lines(plan,
    verbose)``, in `pipecc.techniques.TECHNIQUES` order), and the prefixes of the planner's
    decision lines they already say (a part's ``DECISIONS``), which a verbose summary skips."""
    out: list[str] = []
    said: list[str] = []
    for part in technique_parts("report"):
        shown = part.lines(plan, verbose)
        out += shown
        if shown and getattr(part, "DECISIONS", None):
            said.append(part.DECISIONS)
    return out, tuple(said)


def technique_answer(hook: str, *args: Any) -> Any:
    """The first answer other than None of the techniques' report parts that define the
    optional `hook` (e.g. `pipecc.techniques.umpipe.report`'s: ``batch_split``, ``timeline``),
    in `pipecc.techniques.TECHNIQUES` order; None when none answers."""
    return first_answer("report", hook, *args)


def technique_labelled(plan: Plan) -> list[tuple[str, str]]:
    """Every technique's (label, text) lines after `pipecc plan`'s "times" line (a report
    part's optional ``labelled(plan)``)."""
    return [line for part in technique_parts("report") if hasattr(part, "labelled") for line in part.labelled(plan)]


def replica_group(plan: Plan, stage) -> str:
    """`a100` or, for a replicated stage, `2x a100 [devices 0-1]` (its replica group)."""
    group = plan.stage_devices(stage)
    names = [plan.devices[g]["name"] if 0 <= g < len(plan.devices) else "?" for g in group]
    if len(group) == 1:
        return names[0]
    kinds = sorted(set(names), key=names.index)
    what = f"{len(group)}x {names[0]}" if len(kinds) == 1 else "+".join(names)
    return f"{what} [devices {group[0]}-{group[-1]}]"




def ratio_note(plan: Plan) -> str:
    """What a replicated plan's balance ratio is measured against (`passes.plan_emit.
    lower_bound`): the bound of its own shape, not of every plan; "" for a plain pipeline."""
    if plan.replicas <= 1:
        return ""
    stages = len(plan.stages)
    return (f" (against the bound for its own shape: {stages} stage{'s' if stages != 1 else ''} x "
            f"{plan.replicas} replicas)")

def stage_table(plan: Plan) -> str:
    """One row per stage; the split-layers column only where layers are split. A table wider
    than `WIDTH` (long node names, replica groups) gives each stage's nodes a line of its own."""
    slowest = bottleneck_stage(plan)
    on_fpga = plan.fpga_stages()
    split_nodes = {sh: sl.node for sl in plan.split_layers for sh in sl.shards}
    headers = ["stage", "device", "first node", "last node", "fwd FLOPs", "fwd", "bwd", "sends", "comm",
               "peak mem"] + (["split layers"] if plan.split_layers else [])
    rows = []
    for s in plan.stages:
        shards = sorted({split_nodes[n] for n in s.nodes if n in split_nodes})
        rows.append([f"{s.index}{' *' if s.index == slowest else ''}", replica_group(plan, s),
                     *first_last(s.nodes),
                     human(s.forward_flops), seconds(s.forward_s), seconds(s.backward_s),
                     human(s.send_bytes, "B"), seconds(s.comm_s),
                     human(s.peak_memory_bytes, "B") + (" BRAM" if s.index in on_fpga else "")]
                    + ([", ".join(shards) or "-"] if plan.split_layers else []))
    return fit_table(headers, rows, moved=[2, 3] + ([10] if plan.split_layers else []))


def _labelled(label: str, text: str) -> list[str]:
    """A summary line `label` (padded to 16 columns) + `text`, wrapped to WIDTH under the text."""
    return wrap(f"{label:<15} {text}", indent=16)


def plan_table(plan: Plan, verbose: bool = False) -> str:
    split = technique_answer("batch_split", plan, "plan")  # UMPIPE's unequal micro-batches
    lines = [
        *wrap(f"{plan.model}: batch {plan.batch_size}, "
              + (split if split is not None else f"{count(plan.microbatches, 'micro-batch')}, ")
              + f"schedule {plan.schedule}" + (f" (v={plan.virtual_stages})" if plan.virtual_stages > 1 else "")
              + (f", {plan.replicas} replicas per stage (each on "
                 f"{replica_rows(plan.batch_size // plan.microbatches, plan.replicas)} of every micro-batch's "
                 f"{plan.batch_size // plan.microbatches} samples)"
                 if plan.replicas > 1 else "")),
        "",
        stage_table(plan),
        "",
        *_labelled("bottleneck", f"{seconds(plan.bottleneck_s)} per micro-batch (stage marked *; "
                   f"{bottleneck_note(plan)})"),
        *_labelled("lower bound", f"{seconds(plan.lower_bound_s)}   balance ratio {plan.balance_ratio:.3f}"
                   f"{ratio_note(plan)}"
                   + (f"   (comm-blind bound {seconds(plan.lower_bound_compute_s)}, ratio "
                      f"{plan.balance_ratio_compute:.3f})" if plan.lower_bound_compute_s > 0 else "")),
        *_labelled("iteration", f"{seconds(plan.predicted_iteration_s)} predicted, bubble "
                   f"{plan.bubble_fraction:.1%}"),
        *_labelled("times", f"predicted from {cost_basis(plan)}"),
    ]
    for label, said_here in technique_labelled(plan):
        lines += _labelled(label, said_here)
    if plan.replicas > 1:
        lines += _labelled("all-reduce", f"{seconds(max(s.allreduce_s for s in plan.stages))} per "
                           "iteration at most (a stage's gradients in its replica group, overlapped "
                           "with its last backward)")
    for sl in plan.split_layers:
        lines += _labelled("split layer", f"{sl.node} into {sl.parts} shards {sl.sizes} (dim {sl.dim})")
    shown, said = technique_lines(plan, verbose)
    lines += [part for line in shown for part in wrap(line, indent=16)]
    if any(d.get("kind") == "fpga" for d in plan.devices):  # any FPGA device, with a stage or not
        lines += _labelled("FPGA stages", f"{plan.options.get('fpga_number', 'float')}, timed by the "
                           "FPGA model of estimates.json; memory is on-chip BRAM")
    if plan.baselines:
        lines += ["", "baselines on the same cost model:"]
        lines.append(text_table(["partition", "bottleneck", "ratio to bound", "vs pipecc"],
                                [[b["name"], seconds(b["bottleneck_s"]),
                                  f"{b['bottleneck_s'] / plan.lower_bound_s:.3f}",
                                  f"{b['bottleneck_s'] / plan.bottleneck_s:.2f}x"
                                  + ("" if b.get("fits_memory", True) else " (exceeds memory)")]
                                 for b in plan.baselines]))
    if verbose:
        # NOTE: a technique's lines above may be the planner's decision: not printed twice
        decisions = [d for d in plan.decisions if not d.startswith(said)]
        lines += ["", "decisions:"] + [part for d in decisions for part in wrap(f"  {seconds_in_text(d)}")]
        lines += [part for line in alternative_lines(plan) for part in wrap(line)]
    return "\n".join(lines)


TOP_ALTERNATIVES = 3


def alternative_lines(plan: Plan, top: int = TOP_ALTERNATIVES) -> list[str]:
    """The `top` runners-up of the planner's search (fastest first), and how many more there
    were: `-v` is read by a person, who wants the choices that nearly won, not ~40 lines of
    every configuration tried (all of them stay in plan.json's `alternatives`)."""
    ranked = list(plan.alternatives)  # the planner records them fastest first
    lines = [f"  runner-up {a['schedule']} m={a['microbatches']}"
             + (f" replicas={a['replicas']}" if a.get("replicas", 1) > 1 else "")
             + f": {seconds_in_text(a['reason'])}" for a in ranked[:top]]
    rest = len(ranked) - top
    if rest > 0:
        lines.append(f"  ... and {count(rest, 'other configuration')} tried "
                     "(plan.json's \"alternatives\" lists every one with its reason)")
    return lines


def replica_rows(mb: int, d: int) -> str:
    """A replica's samples of a micro-batch of mb over d replicas (torch.tensor_split: the first
    mb % d take one more): "8", or "11 or 10" when d does not divide mb."""
    return str(mb // d) if mb % d == 0 else f"{-(-mb // d)} or {mb // d}"
