"""OUT/report.html: one self-contained page about a compiled pipeline, written by every compile.

    render_report(graph, plan, timeline)  at compile time (the driver passes its timeline)
    report_from_folder(OUT)               the same page from a compiled folder's JSON files

Sections: key figures; the schedule as a Gantt chart from the simulator (one row per device,
forward/backward blocks per micro-batch, sends on a strip below, idle time hatched); per-stage
compute time against the lower bound and memory against each device's capacity; pipecc's
bottleneck beside the baseline partitions; the planner's decisions; the stage graphs (Graphviz
SVG when `dot` is installed, otherwise a stage-flow diagram and node lists); the cost per module.

Everything is inline (CSS, SVG, no script, no fonts or images fetched), so the file opens
offline. The charts come from `svg`, the graphs from `dot`, the JSON from `artifacts`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from pipecc.ir.plan import Plan
from pipecc.ir.schedule.registry import ZERO_BUBBLE
from pipecc.report.artifacts import MODEL_INPUT, graph_json, timeline_for, timeline_json
from pipecc.report.compiled import load_compiled, timeline_of
from pipecc.report.dot import dot_text, graphviz_svg
from pipecc.report.figures import (BOTTLENECK_WITH_COMM, bottleneck_note, bottleneck_stage, cost_basis,
                                   device_capacities, first_last)
from pipecc.report.formatting import count, human, seconds
from pipecc.report.text import ratio_note
from pipecc.techniques import parts as technique_parts
from pipecc.report.svg import (ALLREDUCE, B_COLORS, COMM_B, COMM_C, COMM_F, F_COLORS, W_COLORS, balance_svg,
                               esc, gantt_svg, memory_svg, pipeline_ranks, stage_flow_svg, stage_label,
                               stage_time_svg)

DOT_MAX_NODES = 1500


# ----------------------------------------------------------------------------- legends
def _legend(plan: Plan) -> str:
    p = pipeline_ranks(plan)
    items = []
    for c in range(max(plan.virtual_stages, 1)):
        which = (f" (stages {c * p}–{c * p + p - 1})" if plan.virtual_stages > 1 else "")
        items.append((F_COLORS[c % 4], f"forward{which}"))
        if plan.schedule in ZERO_BUBBLE:  # the backward split: input gradient, then weights
            items.append((B_COLORS[c % 4], f"backward for the input (I){which}"))
            items.append((W_COLORS[c % 4], f"backward for the weights (W){which}"))
        elif plan.schedule != "inference":
            items.append((B_COLORS[c % 4], f"backward{which}"))
    items += [(COMM_F, "send activation"), (COMM_B, "send gradient")]
    if plan.replicas > 1:
        items.append((ALLREDUCE, "gradient all-reduce in each replica group"))
    extra = ('<span class="key"><span class="swatch hatch"></span>idle (bubble)</span>'
             '<span class="key">numbers: micro-batch</span>')
    return _keys(items, extra)


def _keys(items: Sequence[tuple[str, str]], extra: str = "", indent: int = 0) -> str:
    """A legend: colour swatches with their meaning."""
    spans = "".join(f'<span class="key"><span class="swatch" style="background:{c}"></span>{esc(t)}'
                    f"</span>" for c, t in items)
    style = f' style="margin-left:{indent}px"' if indent else ""
    return f'<div class="legend"{style}>{spans}{extra}</div>'


# ----------------------------------------------------------------------------- graphs as lists
def stage_lists_html(plan: Plan, graph: dict[str, Any] | None) -> str:
    """The readable fallback: per stage, what it receives, its nodes (op, shape), what it sends."""
    n = len(plan.stages)
    cards = []
    for s in plan.stages:
        nodes = [nd for nd in (graph or {}).get("nodes", []) if nd["stage"] == s.index]
        ins: dict[str, str] = {}
        outs: dict[str, str] = {}
        for nd in nodes:
            for i in nd["inputs"]:
                if i["stage"] is not None and i["stage"] != s.index:
                    ins[i["id"]] = "the model's input" if i["stage"] == MODEL_INPUT else f"stage {i['stage']}"
            for u in nd["users"]:
                if u["stage"] is not None and u["stage"] != s.index:
                    where = "the model's output" if u["stage"] >= n else f"stage {u['stage']}"
                    outs.setdefault(nd["id"], where)
        body = "".join(f"<tr><td>{esc(nd['name'])}</td><td>{esc(nd['op'])}</td>"
                       f"<td>{esc(', '.join(nd['shapes']))}</td></tr>" for nd in nodes)
        if not body:
            body = ("<tr><td colspan=3>no nodes of its own (its planned nodes run where they are "
                     "used)</td></tr>" if graph else
                     "".join(f"<tr><td>{esc(name)}</td><td></td><td></td></tr>" for name in s.nodes))
        port = lambda d, way: "".join(  # noqa: E731
            f"<li><code>{esc(k)}</code> {way} {esc(v)}</li>" for k, v in d.items())
        cards.append(f'<div class="card"><h4>stage {s.index} · {esc(stage_label(plan, s))}</h4>'
                     f'<ul class="ports">{port(ins, "⟵ from")}</ul>'
                     f'<div class="scroll"><table class="nodes"><colgroup><col class="n"><col class="o">'
                     f'<col class="s"></colgroup><tr><th>node</th><th>op</th>'
                     f'<th>shape</th></tr>{body}</table></div>'
                     f'<ul class="ports">{port(outs, "⟶ to")}</ul></div>')
    return f'<div class="cards">{"".join(cards)}</div>'


# ----------------------------------------------------------------------------- tables
def stage_table_html(plan: Plan, capacities: Sequence[float | None]) -> str:
    worst = bottleneck_stage(plan)
    shards = {sh: sl.node for sl in plan.split_layers for sh in sl.shards}
    head = ("<tr><th>stage</th><th>device</th><th>nodes</th><th>fwd FLOPs</th><th>params</th>"
            "<th>fwd</th><th>bwd</th><th>comm</th><th>peak memory</th><th>in</th><th>out</th>"
            "<th>split layers</th></tr>")
    body = []
    for s in plan.stages:
        cap = capacities[s.device] if s.device < len(capacities) else None
        split = sorted({shards[x] for x in s.nodes if x in shards})
        first, last = first_last(s.nodes)
        body.append(f"<tr{' class=worst' if s.index == worst else ''}><td>{s.index}"
                    f"{' ◀' if s.index == worst else ''}</td><td>{esc(stage_label(plan, s))}</td>"
                    f"<td>{esc(first)} … {esc(last)} ({len(s.nodes)})</td>"
                    f"<td>{human(s.forward_flops)}</td><td>{human(s.param_bytes, 'B')}</td>"
                    f"<td>{seconds(s.forward_s)}</td><td>{seconds(s.backward_s)}</td>"
                    f"<td>{seconds(s.comm_s)}</td><td>{human(s.peak_memory_bytes, 'B')}"
                    f"{f' / {human(cap, chr(66))}' if cap else ''}</td>"
                    f"<td>{human(s.recv_bytes, 'B')}</td><td>{human(s.send_bytes, 'B')}</td>"
                    f"<td>{esc(', '.join(split)) or '-'}</td></tr>")
    return f'<table class="data stages">{head}{"".join(body)}</table>'


def module_table_html(graph: dict[str, Any] | None, depth: int = 2) -> str:
    """Cost per module (the first `depth` components of each node's name), with stages."""
    if not graph:
        return "<p>No per-node data in this folder.</p>"
    groups: dict[str, dict[str, Any]] = {}
    for nd in graph["nodes"]:
        if nd["stage"] == MODEL_INPUT:
            continue
        key = ".".join(nd["name"].split(".")[:depth])
        g = groups.setdefault(key, {"ops": 0, "forward_flops": 0, "backward_flops": 0,
                                    "param_bytes": 0, "output_bytes": 0, "stages": set()})
        g["ops"] += nd["stage"] is not None
        for f in ("forward_flops", "backward_flops", "param_bytes", "output_bytes"):
            g[f] += nd[f]
        g["stages"].update([nd["stage"]] if nd["stage"] is not None else nd.get("stages", []))
    total = sum(g["forward_flops"] + g["backward_flops"] for g in groups.values()) or 1
    rows = []
    for key, g in groups.items():
        share = (g["forward_flops"] + g["backward_flops"]) / total
        st = sorted(g["stages"])
        where = (f"{st[0]}" if len(st) == 1 else f"{st[0]}–{st[-1]}") if st else "-"
        rows.append(f"<tr><td>{esc(key)}</td><td>{g['ops']}</td><td>{where}</td>"
                    f"<td>{human(g['forward_flops'])}</td><td>{human(g['backward_flops'])}</td>"
                    f"<td>{human(g['param_bytes'], 'B')}</td><td>{human(g['output_bytes'], 'B')}</td>"
                    f'<td class="sharecell"><span class="share" style="width:{share * 100:.1f}%"></span>'
                    f"{share:.1%}</td></tr>")
    return ('<table class="data modules"><tr><th>module</th><th>ops</th><th>stage</th><th>fwd FLOPs</th>'
            "<th>bwd FLOPs</th><th>params</th><th>activations</th><th>share of FLOPs</th></tr>"
            + "".join(rows) + "</table>"
            f'<p class="note">FLOPs and bytes at the compile batch ({graph.get("batch_size")}); '
            f"a multiply-add counts 2.</p>")


def baselines_table_html(plan: Plan) -> str:
    bound = plan.lower_bound_s if plan.lower_bound_s > 0 else float("nan")
    rows = [("pipecc", plan.bottleneck_s, True, [])] + \
        [(b["name"], b["bottleneck_s"], b.get("fits_memory", True), b.get("bounds", []))
         for b in plan.baselines]
    body = "".join(f"<tr><td>{esc(name)}</td><td>{seconds(value)}</td><td>{value / bound:.3f}</td>"
                   f"<td>{value / plan.bottleneck_s:.2f}×</td><td>{'yes' if fits else 'no'}</td></tr>"
                   for name, value, fits, _ in rows)
    return ('<table class="data baselines"><tr><th>partition</th><th>bottleneck</th>'
            "<th>ratio to bound</th><th>vs pipecc</th><th>fits memory</th></tr>" + body + "</table>")


def technique_html(plan: Plan) -> str:
    """Every technique's section (a report part's optional ``html(plan)``, in `TECHNIQUES` order:
    Bi-Partition's cut pair and each stage's forward/backward range)."""
    return "".join(part.html(plan) for part in technique_parts("report") if hasattr(part, "html"))


def decisions_html(plan: Plan) -> str:
    items = "".join(f"<li>{esc(d)}</li>" for d in plan.decisions)
    lost = "".join(f"<tr><td>{esc(a['schedule'])}</td><td>{esc(a['microbatches'])}</td>"
                   f"<td>{esc(a['reason'])}</td></tr>" for a in plan.alternatives)
    alt = (f"<details><summary>{len(plan.alternatives)} alternatives the planner rejected</summary>"
           f'<table class="data"><tr><th>schedule</th><th>micro-batches</th><th>why not</th></tr>'
           f"{lost}</table></details>") if plan.alternatives else ""
    return f"<ul>{items}</ul>{alt}"


# ----------------------------------------------------------------------------- page
CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Helvetica,Arial,sans-serif;margin:0;color:#222;
 background:#fff;font-size:14px}
main{max-width:1340px;margin:0 auto;padding:18px 24px 40px}
h1{font-size:22px;margin:4px 0}h2{font-size:17px;margin:28px 0 6px;border-bottom:1px solid #ddd;
 padding-bottom:4px}h4{margin:0 0 6px;font-size:13px}
.sub{color:#555;margin:0 0 12px}.note{color:#666;font-size:12px;margin:4px 0}
.figures{display:flex;flex-wrap:wrap;gap:10px;margin:12px 0}
.fig{border:1px solid #e1e4e8;border-radius:6px;padding:8px 14px;min-width:120px}
.fig b{display:block;font-size:20px}.fig span{color:#666;font-size:12px}
.row{display:flex;flex-wrap:wrap;gap:24px;align-items:flex-start}.row>div{flex:1 1 600px;min-width:0}
svg.chart{max-width:100%;height:auto;font-size:12px}
svg text{fill:#222}svg .axis{fill:#555;font-size:11px}svg .small{font-size:11px;fill:#555}
svg .rowlabel{font-size:12px}svg .bold{font-weight:600}svg .value{font-size:12px;fill:#333}
svg .blocklabel{font-size:10px;fill:#fff}svg .blocklabel.dark{fill:#222}
svg .grid{stroke:#e6e6e6;stroke-width:1}svg .bound{stroke:#2a7;stroke-dasharray:4 3;stroke-width:1.5}
svg text.bound{fill:#1a6;stroke:none}svg .cap{stroke:#c0392b;stroke-width:1.5}
svg text.cap{fill:#c0392b;stroke:none}svg .flow{stroke:#c0392b;stroke-width:2}
svg .flowlabel{fill:#c0392b}
.legend{display:flex;flex-wrap:wrap;gap:14px;font-size:12px;color:#444;margin:4px 0 0 130px}
.key{display:inline-flex;align-items:center;gap:5px}
.swatch{display:inline-block;width:14px;height:11px;border-radius:2px}
.swatch.hatch{background:repeating-linear-gradient(45deg,#f4f4f4 0 3px,#d0d0d0 3px 5px)}
table.data{border-collapse:collapse;font-size:12.5px;margin:6px 0}
table.data th,table.data td{border-bottom:1px solid #eee;padding:3px 9px;text-align:right;white-space:nowrap}
table.data th{background:#f6f8fa;font-weight:600}
table.data td:first-child,table.data th:first-child,table.data td:nth-child(2),table.data td:nth-child(3),
table.data th:nth-child(2),table.data th:nth-child(3){text-align:left}
tr.worst td{background:#fff4e5;font-weight:600}
.sharecell{position:relative;min-width:110px}.share{position:absolute;left:0;top:3px;bottom:3px;
 background:#dbe7f3;z-index:-1}
.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(400px,1fr));gap:12px}
.card{border:1px solid #e1e4e8;border-radius:6px;padding:8px 10px;font-size:12px}
.card .scroll{max-height:260px;overflow:auto}
table.nodes{border-collapse:collapse;width:100%;table-layout:fixed}
table.nodes td,table.nodes th{padding:1px 8px 1px 0;text-align:left;font-size:11.5px;vertical-align:top;
 overflow-wrap:anywhere}table.nodes th{color:#666;font-weight:500}
table.nodes col.n{width:42%}table.nodes col.o{width:20%}table.nodes col.s{width:38%}
ul.ports{list-style:none;padding:0;margin:4px 0;color:#c0392b}
code{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:11.5px}
.graphviz{overflow:auto;max-height:900px;border:1px solid #eee}
details summary{cursor:pointer;color:#245;margin:6px 0}
"""


def render_report(graph: Any, plan: Plan, timeline: Any = None, *, cluster: Any = None,
                  graph_data: dict[str, Any] | None = None) -> str:
    """report.html for a compile: `graph` the (split) annotated graph the plan names, `timeline`
    the simulator's Timeline of the chosen plan (rebuilt from the plan when None), `cluster`
    for the devices' memory (else the built-in catalog by device name)."""
    data = graph_data if graph_data is not None else (graph_json(graph, plan) if graph is not None else None)
    tl = timeline_json(timeline if timeline is not None else timeline_for(plan)) \
        if not isinstance(timeline, dict) else timeline
    if graph is not None:  # the stages' node lists as their stage.py computes them, as plan.json has them
        from pipecc.backends.torch.stages import plan_as_cut
        plan = plan_as_cut(plan, graph)
    return render_page(plan, data, tl, device_capacities(plan, cluster))


def report_from_folder(out: str | Path) -> str:
    """The page for an existing compiled folder (its plan, graph.json and the timeline of its
    schedule.txt, `compiled.timeline_of`)."""
    c = load_compiled(out)
    tl = timeline_of(c)
    return render_page(c.plan, c.graph, tl, device_capacities(c.plan))


def report_with_trace(out: str | Path, trace_path: str | Path) -> tuple[str, str]:
    """The folder's page with the measured Gantt chart of one traced step under the predicted
    one, on one time scale (`pipecc.report.measured`); also the comparison as text."""
    from pipecc.report import measured as ms
    from pipecc.report.compiled import _ascii_timeline
    c = load_compiled(out)
    trace = ms.load_trace(trace_path)
    tl = timeline_of(c)
    ms.check_matches(trace, c, tl)
    got = ms.measured_timeline(trace, ms.steady_step(trace))
    span = max(tl["iteration_s"], got["iteration_s"])
    rows = "".join(f"<li>{esc(ms.describe(r))}</li>" for r in ms.differences(tl, got))
    section = (f'<h3>Measured: step {got["step"]} of {esc(trace["path"])}</h3>\n<p class="note">The same '
               f'iteration as it ran (<code>pipecc run --trace</code>), on the predicted chart\'s time scale: '
               f'measured {esc(seconds(got["iteration_s"]))} against {esc(seconds(tl["iteration_s"]))} predicted. '
               f'Largest differences (measured - predicted):</p><ul class="differences">{rows}</ul>\n'
               f'{gantt_svg(c.plan, got, span=span, measured=True)}')
    page = render_page(c.plan, c.graph, tl, device_capacities(c.plan), measured=section, span=span)
    return page, ms.trace_text(trace, tl, got, _ascii_timeline)


def report_with_run(out: str | Path, run_path: str | Path) -> tuple[str, str]:
    """The folder's page with a run's loss curve and samples/s against the predicted
    (`pipecc.report.history`) under its key figures; also the run as text."""
    from pipecc.report import history as hs
    c = load_compiled(out)
    run = hs.load_run(run_path)
    hs.check_folder(run, c.path)
    page = render_page(c.plan, c.graph, timeline_of(c), device_capacities(c.plan), run=hs.history_html(run))
    return page, hs.history_text(run)


def render_page(plan: Plan, graph: dict[str, Any] | None, timeline: dict[str, Any],
                capacities: Sequence[float | None], measured: str = "", span: float | None = None,
                run: str = "") -> str:
    """The page; ``measured`` (`measured_html`) goes under the predicted schedule, which is drawn
    on ``span``'s time scale when given (the longer of the two iterations); ``run``
    (`history.history_html`) under the key figures."""
    mb = plan.batch_size // max(plan.microbatches, 1)
    devs = _device_summary(plan)
    sched = plan.schedule + (f" 1F1B ({plan.virtual_stages} stages per device)"
                             if plan.virtual_stages > 1 else "")
    figures = [(seconds(plan.predicted_iteration_s), "predicted iteration"),
               (f"{plan.batch_size / plan.predicted_iteration_s:,.0f}/s"
                if plan.predicted_iteration_s > 0 else "-", "samples per second, predicted"),
               (f"{plan.bubble_fraction:.1%}", "bubble (idle share)"),
               (seconds(plan.bottleneck_s), f"bottleneck: stage {bottleneck_stage(plan)}, "
                f"{BOTTLENECK_WITH_COMM}"),
               (seconds(plan.lower_bound_s), "lower bound, any split"),
               (f"{plan.balance_ratio:.3f}", "balance ratio (1 = optimal)" + ratio_note(plan))]
    fig_html = "".join(f'<div class="fig"><b>{esc(v)}</b><span>{esc(k)}</span></div>' for v, k in figures)
    if plan.baselines:
        balance = balance_svg(plan) + ('<p class="note">Bottleneck per micro-batch of each partition '
                                       "on the same cost model; ratio = bottleneck / lower bound.</p>"
                                       + baselines_table_html(plan))
    else:
        balance = "<p>No baselines in this plan (plan with <code>--compare</code> to add them).</p>"
    splits = "".join(f"<li>{esc(sl.node)} split into {sl.parts} shards {esc(sl.sizes)} (dim {sl.dim})</li>"
                     for sl in plan.split_layers)
    dot = dot_text(plan, graph)
    nodes = len((graph or {}).get("nodes", []))
    svg = graphviz_svg(dot) if graph and nodes <= DOT_MAX_NODES else None
    if svg:
        graphs = (f'<p class="note">Rendered by Graphviz; red edges cross stages, labelled with the '
                  f'bytes per micro-batch.</p><div class="graphviz">{svg}</div>')
    else:
        graphs = ('<p class="note">Graphviz (<code>dot</code>) is not installed, so the graphs are '
                  "shown as lists; <code>pipecc inspect OUT --format dot | dot -Tsvg</code> draws them "
                  "where it is.</p>" + stage_lists_html(plan, graph))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>pipecc report: {esc(plan.model)}</title><style>{CSS}</style></head>
<body><main>
<h1>pipecc report: {esc(plan.model)}</h1>
<p class="sub">batch {plan.batch_size} in {count(plan.microbatches, 'micro-batch')} of {mb} · schedule
{esc(sched)} · {count(len(plan.stages), 'stage')} on {esc(devs)} · {esc(plan.dtype)}</p>
<div class="figures">{fig_html}</div>
<p class="note">Every time on this page is predicted, from {esc(cost_basis(plan))}.</p>
{run}
<h2>Pipeline schedule</h2>
<p class="note">One iteration as the simulator predicts it, one row per device: each block is the
forward or backward of one micro-batch on one stage; the strip below a row shows its sends;
hatched gaps are bubbles. Hover a block for its times.</p>
{gantt_svg(plan, timeline, span=span)}
{_legend(plan)}
{measured}

<h2>Stages</h2>
<div class="row"><div><h4>Compute and communication per micro-batch</h4>
<p class="note">Each bar sums a stage's forward, backward and communication (no overlap). The
bottleneck ({esc(seconds(plan.bottleneck_s))}) is shorter: {esc(bottleneck_note(plan))}.</p>{stage_time_svg(plan)}
{_keys([(F_COLORS[0], "forward"), (B_COLORS[0], "backward"), (COMM_C, "communication")], indent=190)}</div>
<div><h4>Peak memory per device against its capacity</h4>{memory_svg(plan, capacities)}
<p class="note">Weights, gradients, optimizer state and stashed activations; the planner keeps
each device under 90% of its memory.</p></div></div>
{stage_table_html(plan, capacities)}
{f"<ul>{splits}</ul>" if splits else ""}
{technique_html(plan)}

<h2>Balance against baseline partitions</h2>
{balance}

<h2>Why this plan</h2>
{decisions_html(plan)}

<h2>Stage graphs</h2>
{stage_flow_svg(plan, graph)}
{graphs}

<h2>Cost per module</h2>
{module_table_html(graph)}
<p class="note">Written by pipecc. Inspect it further with <code>pipecc inspect OUT</code>.</p>
</main></body></html>
"""


def _device_summary(plan: Plan) -> str:
    """'4 devices: 2× a100, v100' (consecutive equal names grouped)."""
    groups: list[list[Any]] = []
    for d in plan.devices:
        if groups and groups[-1][0] == d["name"]:
            groups[-1][1] += 1
        else:
            groups.append([d["name"], 1])
    out = f"{count(len(plan.devices), 'device')}: " + ", ".join(f"{k}× {n}" if k > 1 else n for n, k in groups)
    if plan.replicas > 1:  # PP x DP: each pipeline rank is a group of consecutive devices
        p = pipeline_ranks(plan)
        out += (f" in {p} replica group{'s' if p > 1 else ''} of {plan.replicas} (each stage's "
                "gradients all-reduced in its group)")
    return out
