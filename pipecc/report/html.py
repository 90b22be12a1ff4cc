"""OUT/report.html: one self-contained page about a compiled pipeline (CONTRACT §6).

    render_report(graph, plan, timeline)  at compile time (the driver passes its timeline)
    report_from_folder(OUT)               the same page from a compiled folder's JSON files

Sections: key figures; the schedule as a Gantt chart from the simulator (one row per device,
forward/backward blocks per micro-batch, sends on a strip below, idle time hatched); per-stage
compute time against the lower bound and memory against each device's capacity; pipecc's
bottleneck beside the baseline partitions; the planner's decisions; the stage graphs (Graphviz
SVG when `dot` is installed, otherwise a stage-flow diagram and node lists); the cost per module.

Everything is inline (CSS, SVG, no script, no fonts or images fetched), so the file opens
offline. The charts are SVG written here: a few rectangles and lines need no plotting library.
"""

from __future__ import annotations

import html
import math
import shutil
import subprocess
from pathlib import Path
from typing import Any, Sequence

from pipecc.report.tables import human
from pipecc.report.compiled import (MODEL_INPUT, bottleneck_stage, device_capacities, dot_text, graph_json,
                            load_compiled, timeline_json)
from pipecc.passes.balance import MEMORY_HEADROOM
from pipecc.ir.plan import Plan
from pipecc.report.text import _seconds

F_COLORS = ("#4c78a8", "#9ecae9", "#2f4b7c", "#6baed6")   # forward, by interleaved chunk
B_COLORS = ("#f58518", "#ffbf79", "#b35806", "#fdae6b")   # backward
COMM_F, COMM_B, COMM_C = "#7b4fa0", "#c39bd3", "#7b4fa0"
DOT_MAX_NODES = 1500
DOT_TIMEOUT_S = 60


def esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


# ----------------------------------------------------------------------------- timeline
def timeline_for(plan: Plan) -> Any:
    """The simulator's Timeline for `plan`, rebuilt from its per-stage figures.

    Equal to the planner's own (same stage costs, same schedule generator): the per-direction
    transfer times come back from `comm_s`, which the planner sums as 2*recv + 2*send.
    """
    from pipecc.passes.simulate import StageCosts, simulate
    from pipecc.ir.schedule import gpipe, inference, interleaved_1f1b, one_f_one_b

    n, m, v = len(plan.stages), plan.microbatches, max(plan.virtual_stages, 1)
    send, prev = [], 0.0
    for k, s in enumerate(plan.stages):
        t = max(s.comm_s / 2 - prev, 0.0) if k < n - 1 else 0.0
        send.append(t)
        prev = t
    costs = StageCosts.per_stage(m, [s.forward_s for s in plan.stages],
                                 [s.backward_s for s in plan.stages], send, [0.0] + send[:-1])
    schedule = {"inference": lambda: inference(n, m), "gpipe": lambda: gpipe(n, m),
                "1f1b": lambda: one_f_one_b(n, m),
                "interleaved": lambda: interleaved_1f1b(n // v, m, v)}[plan.schedule]()
    return simulate(schedule, costs)


# ----------------------------------------------------------------------------- small helpers
def _nice_step(span: float, target: int = 8) -> float:
    raw = span / max(target, 1)
    if raw <= 0:
        return 1.0
    mag = 10 ** math.floor(math.log10(raw))
    return next(f * mag for f in (1, 2, 2.5, 5, 10) if f * mag >= raw)


def _time_unit(span: float) -> tuple[float, str]:
    if span >= 1:
        return 1.0, "s"
    if span >= 1e-3:
        return 1e3, "ms"
    return 1e6, "µs"


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def _text(x: float, y: float, s: Any, cls: str = "", anchor: str = "start", extra: str = "") -> str:
    return (f'<text x="{_fmt(x)}" y="{_fmt(y)}" text-anchor="{anchor}"'
            f'{f" class={chr(34)}{cls}{chr(34)}" if cls else ""}{extra}>{esc(s)}</text>')


def _rect(x: float, y: float, w: float, h: float, fill: str, title: str = "", extra: str = "") -> str:
    t = f"<title>{esc(title)}</title>" if title else ""
    return (f'<rect x="{_fmt(x)}" y="{_fmt(y)}" width="{_fmt(max(w, 0.0))}" height="{_fmt(h)}" '
            f'fill="{fill}"{extra}>{t}</rect>')


def _device_label(plan: Plan, d: int) -> str:
    name = plan.devices[d]["name"] if d < len(plan.devices) else "?"
    return f"device {d} · {name}"


# ----------------------------------------------------------------------------- Gantt
def gantt_svg(plan: Plan, timeline: dict[str, Any], width: int = 1300) -> str:
    """One row per device: F and B blocks labelled with their micro-batch, sends below them on
    a thin strip, idle time hatched (the bubbles), a time axis in the iteration's unit."""
    left, right, top, row_h, bar_h = 130, 20, 30, 46, 26
    ranks = timeline["num_ranks"]
    span = timeline["iteration_s"] or 1e-9
    scale, unit = _time_unit(span)
    plot_w = width - left - right
    height = top + ranks * row_h + 40
    p = max(len(plan.devices), 1)

    def x(t: float) -> float:
        return left + t / span * plot_w

    out = [f'<svg class="chart gantt" viewBox="0 0 {width} {height}" width="{width}" '
           f'height="{height}" role="img" aria-label="pipeline schedule" data-devices="{ranks}">',
           '<defs><pattern id="idle-hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
           'patternTransform="rotate(45)"><rect width="6" height="6" fill="#f4f4f4"/>'
           '<line x1="0" y1="0" x2="0" y2="6" stroke="#d0d0d0" stroke-width="2"/></pattern></defs>']
    step = _nice_step(span * scale)
    k = 0
    while k * step <= span * scale * 1.0001:
        tx = x(k * step / scale)
        out.append(f'<line x1="{_fmt(tx)}" y1="{top - 4}" x2="{_fmt(tx)}" '
                   f'y2="{top + ranks * row_h}" class="grid"/>')
        out.append(_text(tx, top + ranks * row_h + 16, f"{k * step:g}", "axis", "middle"))
        k += 1
    out.append(_text(left + plot_w / 2, top + ranks * row_h + 34, f"time in one iteration ({unit})",
                     "axis", "middle"))
    for r in range(ranks):
        y = top + r * row_h
        busy = timeline["busy_s"][r] if r < len(timeline.get("busy_s", [])) else 0.0
        out.append(f'<g class="gantt-row" data-device="{r}">')
        out.append(_text(8, y + bar_h / 2 + 4, _device_label(plan, r), "rowlabel"))
        out.append(_text(8, y + bar_h / 2 + 18, f"busy {busy / span:.0%}", "small"))
        out.append(_rect(left, y, plot_w, bar_h, "url(#idle-hatch)",
                         f"{_device_label(plan, r)}: idle where hatched"))
        for e in (e for e in timeline["events"] if e["rank"] == r):
            out += _event(e, y, x, scale, unit, bar_h, p if plan.virtual_stages > 1 else 0)
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out)


def _event(e: dict[str, Any], y: float, x: Any, scale: float, unit: str, bar_h: float,
           per_chunk: int) -> list[str]:
    """SVG for one timeline event: a compute block (class `block F|B`) or a send on the strip."""
    kind = e["kind"]
    x0, x1 = x(e["start"]), x(e["end"])
    chunk = e["stage"] // per_chunk if per_chunk else 0
    when = f"{e['start'] * scale:.4g}–{e['end'] * scale:.4g} {unit}"
    data = f' data-stage="{e["stage"]}" data-microbatch="{e["microbatch"]}"'
    if kind in ("F", "B"):
        color = (F_COLORS if kind == "F" else B_COLORS)[chunk % 4]
        word = "forward" if kind == "F" else "backward"
        out = [_rect(x0, y, x1 - x0, bar_h, color,
                     f"{word} of stage {e['stage']}, micro-batch {e['microbatch']}: {when}",
                     f' class="block {kind}"{data} stroke="#ffffff" stroke-width="0.8"')]
        if x1 - x0 >= 11:
            dark = color in ("#9ecae9", "#ffbf79", "#6baed6", "#fdae6b")
            out.append(_text((x0 + x1) / 2, y + bar_h / 2 + 4, e["microbatch"],
                             "blocklabel" + (" dark" if dark else ""), "middle"))
        return out
    if kind in ("SEND_F", "SEND_B"):
        what = "activation" if kind == "SEND_F" else "gradient"
        return [_rect(x0, y + bar_h + 3, max(x1 - x0, 1.0), 7, COMM_F if kind == "SEND_F" else COMM_B,
                      f"{what} of stage {e['stage']}, micro-batch {e['microbatch']} to device "
                      f"{e['peer']}: {when}", f' class="send"{data}')]
    return []  # a RECV is the receiver waiting: it shows as idle time


def _legend(plan: Plan) -> str:
    p = max(len(plan.devices), 1)
    items = []
    for c in range(max(plan.virtual_stages, 1)):
        which = (f" (stages {c * p}–{c * p + p - 1})" if plan.virtual_stages > 1 else "")
        items.append((F_COLORS[c % 4], f"forward{which}"))
        if plan.schedule != "inference":
            items.append((B_COLORS[c % 4], f"backward{which}"))
    items += [(COMM_F, "send activation"), (COMM_B, "send gradient")]
    extra = ('<span class="key"><span class="swatch hatch"></span>idle (bubble)</span>'
             '<span class="key">numbers: micro-batch</span>')
    return _keys(items, extra)


def _keys(items: Sequence[tuple[str, str]], extra: str = "", indent: int = 0) -> str:
    """A legend: colour swatches with their meaning."""
    spans = "".join(f'<span class="key"><span class="swatch" style="background:{c}"></span>{esc(t)}'
                    f"</span>" for c, t in items)
    style = f' style="margin-left:{indent}px"' if indent else ""
    return f'<div class="legend"{style}>{spans}{extra}</div>'


# ----------------------------------------------------------------------------- bars
def _hbars(rows: Sequence[dict[str, Any]], *, width: int = 620, max_value: float,
           lines: Sequence[tuple[float, str, str, str]] = (), label_w: int = 190,
           value_w: int = 150, name: str = "") -> str:
    """Horizontal stacked bars. rows: {label, segments [(value, color, title)], note, bold}.
    lines: vertical markers (value, label, css class, label anchor)."""
    row_h, top = 26, 22
    plot_w = width - label_w - value_w
    height = top + len(rows) * row_h + 8
    scale = plot_w / max_value if max_value > 0 else 0.0
    out = [f'<svg class="chart bars {name}" viewBox="0 0 {width} {height}" width="{width}" '
           f'height="{height}">']
    for i, row in enumerate(rows):
        y = top + i * row_h
        out.append(_text(label_w - 8, y + 14, row["label"], "rowlabel bold" if row.get("bold")
                         else "rowlabel", "end"))
        out.append(_rect(label_w, y + 2, plot_w, 16, "#f2f2f2"))
        x = label_w
        for value, color, title in row["segments"]:
            w = max(value * scale, 2.0) if value > 0 else 0.0  # a tiny share stays visible
            out.append(_rect(x, y + 2, w, 16, color, title))
            x += w
        out.append(_text(label_w + plot_w + 6, y + 14, row.get("note", ""),
                         "value bold" if row.get("bold") else "value"))
    for value, label, cls, anchor in lines:
        lx = label_w + value * scale
        out.append(f'<line x1="{_fmt(lx)}" y1="{top - 4}" x2="{_fmt(lx)}" '
                   f'y2="{top + len(rows) * row_h}" class="{cls}"/>')
        shift = {"end": -3, "start": 3}.get(anchor, 0)
        out.append(_text(lx + shift, top - 8, label, "small " + cls, anchor))
    out.append("</svg>")
    return "\n".join(out)


def stage_time_svg(plan: Plan) -> str:
    worst = bottleneck_stage(plan)
    rows = []
    for s in plan.stages:
        total = s.forward_s + s.backward_s + s.comm_s
        rows.append({"label": f"stage {s.index} · {_device_label(plan, s.device)}",
                     "bold": s.index == worst,
                     "note": _seconds(total) + ("  ◀ bottleneck" if s.index == worst else ""),
                     "segments": [(s.forward_s, F_COLORS[0], f"forward {_seconds(s.forward_s)}"),
                                  (s.backward_s, B_COLORS[0], f"backward {_seconds(s.backward_s)}"),
                                  (s.comm_s, COMM_C, f"communication {_seconds(s.comm_s)}")]})
    top = max([plan.bottleneck_s, plan.lower_bound_s] + [r["segments"][0][0] + r["segments"][1][0]
                                                        + r["segments"][2][0] for r in rows])
    return _hbars(rows, max_value=top * 1.02, name="stage-time", lines=[(plan.lower_bound_s,
                  f"lower bound {_seconds(plan.lower_bound_s)}", "bound", "middle")])


def memory_svg(plan: Plan, capacities: Sequence[float | None]) -> str:
    """Per device: its stages' peak memory stacked, against capacity (100%) and the 90% plan line."""
    rows, peaks = [], []
    for d in range(len(plan.devices)):
        stages = [s for s in plan.stages if s.device == d]
        peak = float(sum(s.peak_memory_bytes for s in stages))
        cap = capacities[d] if d < len(capacities) else None
        peaks.append(peak)
        segs = [(float(s.peak_memory_bytes) / cap if cap else float(s.peak_memory_bytes),
                 F_COLORS[(s.index // max(len(plan.devices), 1)) % 4],
                 f"stage {s.index}: {human(s.peak_memory_bytes, 'B')}") for s in stages]
        note = human(peak, "B") + (f" of {human(cap, 'B')} ({peak / cap:.1%})" if cap
                                   else " (capacity unknown)")
        rows.append({"label": _device_label(plan, d), "segments": segs, "note": note})
    if all(c for c in capacities[:len(plan.devices)]):
        return _hbars(rows, max_value=max([1.0] + [p / c for p, c in zip(peaks, capacities)]),
                      lines=[(MEMORY_HEADROOM, "planning limit 90%", "bound", "end"),
                             (1.0, "capacity", "cap", "start")], value_w=200, name="memory")
    return _hbars(rows, max_value=max(peaks + [1.0]) * 1.05, value_w=200, name="memory")


def balance_svg(plan: Plan) -> str:
    rows = [{"label": "pipecc", "bold": True, "note": _ratio_note(plan, plan.bottleneck_s, True),
             "segments": [(plan.bottleneck_s, "#54a24b", f"pipecc: {_seconds(plan.bottleneck_s)}")]}]
    for b in plan.baselines:
        ok = b.get("fits_memory", True)
        rows.append({"label": b["name"].split(" (")[0], "note": _ratio_note(plan, b["bottleneck_s"], ok),
                     "segments": [(b["bottleneck_s"], "#9d9d9d" if ok else "#e45756",
                                   f"{b['name']}: {_seconds(b['bottleneck_s'])}"
                                   + ("" if ok else ", exceeds memory"))]})
    top = max([plan.lower_bound_s] + [r["segments"][0][0] for r in rows])
    return _hbars(rows, max_value=top * 1.02, label_w=230, width=760, name="balance",
                  lines=[(plan.lower_bound_s, f"lower bound {_seconds(plan.lower_bound_s)}", "bound",
                          "middle")])


def _ratio_note(plan: Plan, value: float, fits: bool) -> str:
    ratio = value / plan.lower_bound_s if plan.lower_bound_s > 0 else float("inf")
    return f"{_seconds(value)} · ratio {ratio:.2f}" + ("" if fits else " · over memory")


# ----------------------------------------------------------------------------- graphs
def graphviz_svg(dot: str) -> str | None:
    """`dot -Tsvg` output without its XML prologue, or None (no Graphviz, or it failed)."""
    exe = shutil.which("dot")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, "-Tsvg"], input=dot, capture_output=True, text=True,
                              timeout=DOT_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0 or "<svg" not in done.stdout:
        return None
    return done.stdout[done.stdout.index("<svg"):]


def stage_flow_svg(plan: Plan, graph: dict[str, Any] | None) -> str:
    """Stages as boxes left to right, arrows labelled with the bytes per micro-batch."""
    n = len(plan.stages)
    per_row = min(n, 6)
    box_w, box_h, gap, top = 170, 90, 56, 16
    width = per_row * box_w + (per_row - 1) * gap + 20
    rows = math.ceil(n / per_row)
    height = top + rows * (box_h + 40)
    out = [f'<svg class="chart stage-flow" viewBox="0 0 {width} {height}" width="{width}" '
           f'height="{height}">',
           '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
           'markerHeight="7" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#c0392b"/></marker></defs>']
    pos = []
    for s in plan.stages:
        r, c = divmod(s.index, per_row)
        x, y = 10 + c * (box_w + gap), top + r * (box_h + 40)
        pos.append((x, y))
        ops = len([nd for nd in (graph or {}).get("nodes", []) if nd["stage"] == s.index]) or len(s.nodes)
        out.append(_rect(x, y, box_w, box_h, "#f5f7fa", f"stage {s.index}: {', '.join(s.nodes[:8])}"
                         + (" …" if len(s.nodes) > 8 else ""), ' rx="6" stroke="#7a8ca3"'))
        out.append(_text(x + box_w / 2, y + 18, f"stage {s.index}", "rowlabel bold", "middle"))
        out.append(_text(x + box_w / 2, y + 34, _device_label(plan, s.device), "small", "middle"))
        out.append(_text(x + box_w / 2, y + 50, f"{ops} nodes, {human(s.forward_flops)}FLOP fwd",
                         "small", "middle"))
        first, last = (s.nodes[0], s.nodes[-1]) if s.nodes else ("-", "-")
        out.append(_text(x + box_w / 2, y + 66, _short(first), "small", "middle"))
        out.append(_text(x + box_w / 2, y + 80, "… " + _short(last), "small", "middle"))
    for s in plan.stages[:-1]:
        (x0, y0), (x1, y1) = pos[s.index], pos[s.index + 1]
        label = human(s.send_bytes, "B")
        if y0 == y1:
            out.append(f'<line x1="{x0 + box_w}" y1="{y0 + box_h / 2}" x2="{x1 - 2}" y2="{y1 + box_h / 2}" '
                       'class="flow" marker-end="url(#arrow)"/>')
            out.append(_text((x0 + box_w + x1) / 2, y0 + box_h / 2 - 6, label, "small flowlabel", "middle"))
        else:  # wrap to the next row
            out.append(f'<path d="M{x0 + box_w / 2},{y0 + box_h} L{x0 + box_w / 2},{y0 + box_h + 20} '
                       f'L{x1 + box_w / 2},{y0 + box_h + 20} L{x1 + box_w / 2},{y1 - 2}" class="flow" '
                       'fill="none" marker-end="url(#arrow)"/>')
            out.append(_text(x1 + box_w / 2 + 6, y0 + box_h + 16, label, "small flowlabel"))
    out.append("</svg>")
    return "\n".join(out)


def _short(name: str, limit: int = 24) -> str:
    return name if len(name) <= limit else "…" + name[-(limit - 1):]


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
        cards.append(f'<div class="card"><h4>stage {s.index} · {esc(_device_label(plan, s.device))}</h4>'
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
        first, last = (s.nodes[0], s.nodes[-1]) if s.nodes else ("-", "-")
        body.append(f"<tr{' class=worst' if s.index == worst else ''}><td>{s.index}"
                    f"{' ◀' if s.index == worst else ''}</td><td>{esc(_device_label(plan, s.device))}</td>"
                    f"<td>{esc(first)} … {esc(last)} ({len(s.nodes)})</td>"
                    f"<td>{human(s.forward_flops)}</td><td>{human(s.param_bytes, 'B')}</td>"
                    f"<td>{_seconds(s.forward_s)}</td><td>{_seconds(s.backward_s)}</td>"
                    f"<td>{_seconds(s.comm_s)}</td><td>{human(s.peak_memory_bytes, 'B')}"
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
    body = "".join(f"<tr><td>{esc(name)}</td><td>{_seconds(value)}</td><td>{value / bound:.3f}</td>"
                   f"<td>{value / plan.bottleneck_s:.2f}×</td><td>{'yes' if fits else 'no'}</td></tr>"
                   for name, value, fits, _ in rows)
    return ('<table class="data baselines"><tr><th>partition</th><th>bottleneck</th>'
            "<th>ratio to bound</th><th>vs pipecc</th><th>fits memory</th></tr>" + body + "</table>")


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
    return render_page(plan, data, tl, device_capacities(plan, cluster))


def report_from_folder(out: str | Path) -> str:
    """The page for an existing compiled folder (its plan, graph.json and timeline.json)."""
    c = load_compiled(out)
    tl = c.timeline or timeline_json(timeline_for(c.plan))
    return render_page(c.plan, c.graph, tl, device_capacities(c.plan))


def render_page(plan: Plan, graph: dict[str, Any] | None, timeline: dict[str, Any],
                capacities: Sequence[float | None]) -> str:
    mb = plan.batch_size // max(plan.microbatches, 1)
    devs = _device_summary(plan)
    sched = plan.schedule + (f" 1F1B ({plan.virtual_stages} stages per device)"
                             if plan.virtual_stages > 1 else "")
    figures = [(_seconds(plan.predicted_iteration_s), "predicted iteration"),
               (f"{plan.batch_size / plan.predicted_iteration_s:,.0f}/s"
                if plan.predicted_iteration_s > 0 else "-", "samples per second"),
               (f"{plan.bubble_fraction:.1%}", "bubble (idle share)"),
               (_seconds(plan.bottleneck_s), f"bottleneck: stage {bottleneck_stage(plan)}"),
               (_seconds(plan.lower_bound_s), "lower bound, any split"),
               (f"{plan.balance_ratio:.3f}", "balance ratio (1 = optimal)")]
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
<p class="sub">batch {plan.batch_size} in {plan.microbatches} micro-batches of {mb} · schedule
{esc(sched)} · {len(plan.stages)} stages on {esc(devs)} · {esc(plan.dtype)}</p>
<div class="figures">{fig_html}</div>

<h2>Pipeline schedule</h2>
<p class="note">One iteration as the simulator predicts it, one row per device: each block is the
forward or backward of one micro-batch on one stage; the strip below a row shows its sends;
hatched gaps are bubbles. Hover a block for its times.</p>
{gantt_svg(plan, timeline)}
{_legend(plan)}

<h2>Stages</h2>
<div class="row"><div><h4>Compute and communication per micro-batch</h4>{stage_time_svg(plan)}
{_keys([(F_COLORS[0], "forward"), (B_COLORS[0], "backward"), (COMM_C, "communication")], indent=190)}</div>
<div><h4>Peak memory per device against its capacity</h4>{memory_svg(plan, capacities)}
<p class="note">Weights, gradients, optimizer state and stashed activations; the planner keeps
each device under 90% of its memory.</p></div></div>
{stage_table_html(plan, capacities)}
{f"<ul>{splits}</ul>" if splits else ""}

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
    return f"{len(plan.devices)} devices: " + ", ".join(f"{k}× {n}" if k > 1 else n for n, k in groups)
