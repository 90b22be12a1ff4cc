"""The report's charts as inline SVG: the schedule as a Gantt chart (`gantt_svg`), per-stage
time and per-device memory bars (`stage_time_svg`, `memory_svg`), the balance against the
baselines (`balance_svg`) and the stages as boxes (`stage_flow_svg`). A few rectangles and
lines need no plotting library; nothing is fetched, so the page opens offline.
"""

from __future__ import annotations

import html
import math
from typing import Any, Sequence

from pipecc.ir.plan import Plan
from pipecc.targets.timing import MEMORY_HEADROOM
from pipecc.report.figures import bottleneck_stage, first_last
from pipecc.report.formatting import count, human, seconds

F_COLORS = ("#4c78a8", "#9ecae9", "#2f4b7c", "#6baed6")   # forward, by interleaved chunk
B_COLORS = ("#f58518", "#ffbf79", "#b35806", "#fdae6b")   # backward (zero-bubble: its I part)
W_COLORS = ("#54a24b", "#a1d99b", "#31752b", "#74c476")   # zero-bubble weight gradient (W)
COMM_F, COMM_B, COMM_C = "#7b4fa0", "#c39bd3", "#7b4fa0"
ALLREDUCE = "#5aa469"  # replica groups' gradient all-reduce (PP x DP)


def esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


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


def device_label(plan: Plan, d: int) -> str:
    name = plan.devices[d]["name"] if d < len(plan.devices) else "?"
    return f"device {d} · {name}"


def pipeline_ranks(plan: Plan) -> int:
    """Pipeline ranks: devices, or replica groups of `plan.replicas` devices."""
    return max(len(plan.devices) // max(plan.replicas, 1), 1)


def rank_label(plan: Plan, r: int) -> str:
    """Pipeline rank r: its device, or its replica group `devices 0-1 · 2× a100`."""
    d = max(plan.replicas, 1)
    if d == 1:
        return device_label(plan, r)
    names = [plan.devices[g]["name"] if g < len(plan.devices) else "?" for g in range(r * d, r * d + d)]
    what = f"{d}× {names[0]}" if len(set(names)) == 1 else "+".join(names)
    return f"devices {r * d}-{r * d + d - 1} · {what}"


def stage_label(plan: Plan, stage: Any) -> str:
    """Where a stage runs: its device, or its replica group."""
    d = max(plan.replicas, 1)
    return device_label(plan, stage.device) if d == 1 else rank_label(plan, stage.device // d)


# ----------------------------------------------------------------------------- Gantt
def gantt_svg(plan: Plan, timeline: dict[str, Any], width: int = 1300, span: float | None = None,
              measured: bool = False) -> str:
    """One row per device: F and B blocks labelled with their micro-batch, sends below them on
    a thin strip, idle time hatched (the bubbles), a time axis in the iteration's unit.
    ``span``: the axis' length (default the iteration's; two charts on one scale share it);
    ``measured``: a traced step (`pipecc.report.measured`), class ``gantt measured``."""
    left, right, top, row_h, bar_h = 130, 20, 30, 46, 26
    ranks = timeline["num_ranks"]
    span = span or timeline["iteration_s"] or 1e-9
    scale, unit = _time_unit(span)
    plot_w = width - left - right
    height = top + ranks * row_h + 40
    p = pipeline_ranks(plan)

    def x(t: float) -> float:
        return left + t / span * plot_w

    what = "measured" if measured else "predicted"
    out = [f'<svg class="chart gantt{" measured" if measured else ""}" viewBox="0 0 {width} {height}" '
           f'width="{width}" height="{height}" role="img" aria-label="{what} pipeline schedule" '
           f'data-devices="{ranks}">',
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
    out.append(_text(left + plot_w / 2, top + ranks * row_h + 34, f"time in one iteration, {what} ({unit})",
                     "axis", "middle"))
    for r in range(ranks):
        y = top + r * row_h
        busy = timeline["busy_s"][r] if r < len(timeline.get("busy_s", [])) else 0.0
        out.append(f'<g class="gantt-row" data-device="{r}">')
        out.append(_text(8, y + bar_h / 2 + 4, rank_label(plan, r), "rowlabel"))
        out.append(_text(8, y + bar_h / 2 + 18, f"busy {busy / span:.0%}", "small"))
        out.append(_rect(left, y, plot_w, bar_h, "url(#idle-hatch)",
                         f"{rank_label(plan, r)}: idle where hatched"))
        for e in (e for e in timeline["events"] if e["rank"] == r):
            out += _event(e, y, x, scale, unit, bar_h, p if plan.virtual_stages > 1 else 0)
        out += _allreduce(timeline, r, y, x, scale, unit, bar_h)
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out)


def _event(e: dict[str, Any], y: float, x: Any, scale: float, unit: str, bar_h: float,
           per_chunk: int) -> list[str]:
    """SVG for one timeline event: a compute block (class `block F|B|I|W`) or a send on the strip."""
    kind = e["kind"]
    x0, x1 = x(e["start"]), x(e["end"])
    chunk = e["stage"] // per_chunk if per_chunk else 0
    when = f"{e['start'] * scale:.4g}–{e['end'] * scale:.4g} {unit}"
    data = f' data-stage="{e["stage"]}" data-microbatch="{e["microbatch"]}"'
    if kind in ("F", "B", "I", "W"):
        color = {"F": F_COLORS, "B": B_COLORS, "I": B_COLORS, "W": W_COLORS}[kind][chunk % 4]
        word = {"F": "forward", "B": "backward", "I": "backward for the input (I)",
                "W": "backward for the weights (W)"}[kind]
        out = [_rect(x0, y, x1 - x0, bar_h, color,
                     f"{word} of stage {e['stage']}, micro-batch {e['microbatch']}: {when}",
                     f' class="block {kind}"{data} stroke="#ffffff" stroke-width="0.8"')]
        if x1 - x0 >= 11:
            dark = color in ("#9ecae9", "#ffbf79", "#6baed6", "#fdae6b", "#a1d99b", "#74c476")
            out.append(_text((x0 + x1) / 2, y + bar_h / 2 + 4, e["microbatch"],
                             "blocklabel" + (" dark" if dark else ""), "middle"))
        return out
    if kind in ("SEND_F", "SEND_B"):
        what = "activation" if kind == "SEND_F" else "gradient"
        return [_rect(x0, y + bar_h + 3, max(x1 - x0, 1.0), 7, COMM_F if kind == "SEND_F" else COMM_B,
                      f"{what} of stage {e['stage']}, micro-batch {e['microbatch']} to device "
                      f"{e['peer']}: {when}", f' class="send"{data}')]
    return []  # a RECV is the receiver waiting: it shows as idle time


def _allreduce(timeline: dict[str, Any], r: int, y: float, x: Any, scale: float, unit: str,
               bar_h: float) -> list[str]:
    """Replica groups: rank r's gradient all-reduce on the strip below, from its last backward's
    start (when the runtime's hooks launch it) to its end (`allreduce_end_s`)."""
    ends = timeline.get("allreduce_end_s") or []
    # the last B, or W under a zero-bubble schedule: where the simulator starts it too
    starts = [e["start"] for e in timeline["events"] if e["rank"] == r and e["kind"] in ("B", "W")]
    if r >= len(ends) or not starts or ends[r] <= 0:
        return []
    t0, t1 = max(starts), ends[r]
    return [_rect(x(t0), y + bar_h + 12, max(x(t1) - x(t0), 1.0), 5, ALLREDUCE,
                  f"gradient all-reduce in the replica group: {t0 * scale:.4g}–{t1 * scale:.4g} "
                  f"{unit} (overlapped with the last backward)", ' class="allreduce"')]


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
        rows.append({"label": f"stage {s.index} · {stage_label(plan, s)}",
                     "bold": s.index == worst,
                     "note": seconds(total) + ("  ◀ bottleneck" if s.index == worst else ""),
                     "segments": [(s.forward_s, F_COLORS[0], f"forward {seconds(s.forward_s)}"),
                                  (s.backward_s, B_COLORS[0], f"backward {seconds(s.backward_s)}"),
                                  (s.comm_s, COMM_C, f"communication {seconds(s.comm_s)}")]})
    top = max([plan.bottleneck_s, plan.lower_bound_s] + [r["segments"][0][0] + r["segments"][1][0]
                                                        + r["segments"][2][0] for r in rows])
    return _hbars(rows, max_value=top * 1.02, name="stage-time", lines=[(plan.lower_bound_s,
                  f"lower bound {seconds(plan.lower_bound_s)}", "bound", "middle")])


def memory_svg(plan: Plan, capacities: Sequence[float | None]) -> str:
    """Per device: its stages' peak memory stacked, against capacity (100%) and the 90% plan line."""
    rows, peaks = [], []
    for d in range(len(plan.devices)):
        stages = [s for s in plan.stages if d in plan.stage_devices(s)]  # replicas: each holds a copy
        peak = float(sum(s.peak_memory_bytes for s in stages))
        cap = capacities[d] if d < len(capacities) else None
        peaks.append(peak)
        segs = [(float(s.peak_memory_bytes) / cap if cap else float(s.peak_memory_bytes),
                 F_COLORS[(s.index // pipeline_ranks(plan)) % 4],
                 f"stage {s.index}: {human(s.peak_memory_bytes, 'B')}") for s in stages]
        note = human(peak, "B") + (f" of {human(cap, 'B')} ({peak / cap:.1%})" if cap
                                   else " (capacity unknown)")
        rows.append({"label": device_label(plan, d), "segments": segs, "note": note})
    if all(c for c in capacities[:len(plan.devices)]):
        return _hbars(rows, max_value=max([1.0] + [p / c for p, c in zip(peaks, capacities)]),
                      lines=[(MEMORY_HEADROOM, "planning limit 90%", "bound", "end"),
                             (1.0, "capacity", "cap", "start")], value_w=200, name="memory")
    return _hbars(rows, max_value=max(peaks + [1.0]) * 1.05, value_w=200, name="memory")


def balance_svg(plan: Plan) -> str:
    rows = [{"label": "pipecc", "bold": True, "note": _ratio_note(plan, plan.bottleneck_s, True),
             "segments": [(plan.bottleneck_s, "#54a24b", f"pipecc: {seconds(plan.bottleneck_s)}")]}]
    for b in plan.baselines:
        ok = b.get("fits_memory", True)
        rows.append({"label": b["name"].split(" (")[0], "note": _ratio_note(plan, b["bottleneck_s"], ok),
                     "segments": [(b["bottleneck_s"], "#9d9d9d" if ok else "#e45756",
                                   f"{b['name']}: {seconds(b['bottleneck_s'])}"
                                   + ("" if ok else ", exceeds memory"))]})
    top = max([plan.lower_bound_s] + [r["segments"][0][0] for r in rows])
    return _hbars(rows, max_value=top * 1.02, label_w=230, width=760, name="balance",
                  lines=[(plan.lower_bound_s, f"lower bound {seconds(plan.lower_bound_s)}", "bound",
                          "middle")])


def _ratio_note(plan: Plan, value: float, fits: bool) -> str:
    ratio = value / plan.lower_bound_s if plan.lower_bound_s > 0 else float("inf")
    return f"{seconds(value)} · ratio {ratio:.2f}" + ("" if fits else " · over memory")


# ----------------------------------------------------------------------------- stages as boxes
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
        out.append(_text(x + box_w / 2, y + 34, stage_label(plan, s), "small", "middle"))
        out.append(_text(x + box_w / 2, y + 50, f"{count(ops, 'node')}, {human(s.forward_flops)}FLOP fwd",
                         "small", "middle"))
        first, last = first_last(s.nodes)
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


# ----------------------------------------------------------------------------- curves
def line_chart_svg(series: Sequence[tuple[str, str, Sequence[tuple[float, float | None]]]], *,
                   x_label: str, y_label: str, name: str, width: int = 900, height: int = 280,
                   levels: Sequence[tuple[float, str, str]] = (), shade: tuple[float, float, str] | None = None,
                   zero: bool = False) -> str:
    """Lines over a shared x axis (steps): ``series`` of (label, colour, points (x, y)); a None or
    non-finite y breaks its line. ``levels``: dashed horizontal lines (y, label, colour);
    ``shade``: an x range drawn grey (x0, x1, its title), e.g. the warm-up steps; ``zero``: the y
    axis starts at 0 (rates, so that two levels compare by their lengths)."""
    left, right, top, bottom = 64, 150, 14, 42
    plot_w, plot_h = width - left - right, height - top - bottom
    xs = [x for _, _, pts in series for x, _ in pts]
    ys = [y for _, _, pts in series for _, y in pts if y is not None and math.isfinite(y)]
    ys += [y for y, _, _ in levels if math.isfinite(y)] + ([0.0] if zero else [])
    x0, x1 = (min(xs), max(xs)) if xs else (0.0, 1.0)
    y0, y1 = (min(ys), max(ys)) if ys else (0.0, 1.0)
    if x1 <= x0:
        x1 = x0 + 1.0
    pad = (y1 - y0) * 0.05 or abs(y1) * 0.05 or 1.0
    y0, y1 = (0.0 if y0 >= 0 and y0 - pad < 0 else y0 - pad), y1 + pad

    def px(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * plot_w

    def py(y: float) -> float:
        return top + (y1 - y) / (y1 - y0) * plot_h

    out = [f'<svg class="chart line {name}" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
           f'role="img" aria-label="{esc(y_label)} by {esc(x_label)}">']
    if shade is not None:
        a, b = max(shade[0], x0), min(shade[1], x1)
        if b > a:
            out.append(_rect(px(a), top, px(b) - px(a), plot_h, "#f0f0f0", shade[2], ' class="shade"'))
    step = _nice_step(y1 - y0, 5)
    k = math.ceil(y0 / step)
    while k * step <= y1 + 1e-12 * abs(y1):
        y = py(k * step)
        out.append(f'<line x1="{left}" y1="{_fmt(y)}" x2="{left + plot_w}" y2="{_fmt(y)}" class="grid"/>')
        out.append(_text(left - 6, y + 4, f"{k * step:.4g}", "axis", "end"))
        k += 1
    step = max(1.0, _nice_step(x1 - x0, 8))
    k = math.ceil(x0 / step)
    while k * step <= x1:
        x = px(k * step)
        out.append(f'<line x1="{_fmt(x)}" y1="{top}" x2="{_fmt(x)}" y2="{top + plot_h}" class="grid"/>')
        out.append(_text(x, top + plot_h + 16, f"{k * step:g}", "axis", "middle"))
        k += 1
    out.append(_text(left + plot_w / 2, height - 6, x_label, "axis", "middle"))
    out.append(_text(14, top + plot_h / 2, y_label, "axis", "middle",
                     f' transform="rotate(-90 14 {_fmt(top + plot_h / 2)})"'))
    legend_y = top + 10
    for y, label, color in levels:
        if math.isfinite(y):
            out.append(f'<line x1="{left}" y1="{_fmt(py(y))}" x2="{left + plot_w}" y2="{_fmt(py(y))}" '
                       f'stroke="{color}" stroke-width="1.5" stroke-dasharray="6 4" class="level"/>')
            out.append(f'<line x1="{left + plot_w + 8}" y1="{legend_y - 6}" x2="{left + plot_w + 20}" '
                       f'y2="{legend_y - 6}" stroke="{color}" stroke-width="1.5" stroke-dasharray="3 2"/>')
            out.append(_text(left + plot_w + 24, legend_y - 2, label, "small"))
            legend_y += 16
    for label, color, pts in series:
        runs: list[list[str]] = [[]]
        for x, y in pts:
            if y is None or not math.isfinite(y):
                runs.append([])
            else:
                runs[-1].append(f"{_fmt(px(x))},{_fmt(py(y))}")
        for r in runs:
            if len(r) == 1:
                x, y = r[0].split(",")
                out.append(f'<circle cx="{x}" cy="{y}" r="2" fill="{color}"/>')
            elif r:
                out.append(f'<polyline class="series" fill="none" stroke="{color}" stroke-width="1.6" '
                           f'points="{" ".join(r)}"><title>{esc(label)}</title></polyline>')
        out.append(_rect(left + plot_w + 8, legend_y - 7, 12, 3, color))
        out.append(_text(left + plot_w + 24, legend_y - 2, label, "small"))
        legend_y += 16
    out.append(f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#bbb"/>')
    out.append("</svg>")
    return "\n".join(out)
