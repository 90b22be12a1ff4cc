"""Graphviz views of a pipeline: `dot_text(plan, graph)` is the DOT source (`pipecc inspect OUT
--format dot`, and the report's stage graphs), `graphviz_svg(dot)` runs `dot -Tsvg` when
Graphviz is installed."""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

from pipecc.ir.plan import Plan
from pipecc.report.artifacts import MODEL_INPUT
from pipecc.report.formatting import count, human, printable, shapes_text
from pipecc.report.text import replica_group

DOT_TIMEOUT_S = 60


def _q(text: Any) -> str:
    """A DOT string; control characters escaped (`printable`), newlines as DOT's `\\n`."""
    lines = [printable(line).replace("\\", "\\\\").replace('"', '\\"')
             for line in str(text).split("\n")]
    return '"' + "\\n".join(lines) + '"'


def dot_text(plan: Plan, graph: dict[str, Any] | None) -> str:
    """Graphviz from the plan and graph.json: one `subgraph cluster_<i>` per stage, model inputs
    and the output outside, cross-stage edges labelled with the bytes per micro-batch, in red."""
    title = (f"{plan.model}: {count(len(plan.stages), 'stage')}, schedule {plan.schedule}; "
             "edge labels: bytes per micro-batch")
    lines = [f"digraph {_q(plan.model)} {{", "  rankdir=TB;", "  compound=true;",
             '  node [shape=box, style="rounded,filled", fillcolor="#f5f7fa", '
             'fontname="Helvetica", fontsize=10];', '  edge [fontname="Helvetica", fontsize=9];',
             f"  label={_q(title)};"]
    if not graph:
        for s in plan.stages:
            dev = plan.devices[s.device]["name"] if s.device < len(plan.devices) else "?"
            dev = replica_group(plan, s) if plan.replicas > 1 else dev
            lines.append(f"  subgraph cluster_{s.index} {{ label={_q(f'stage {s.index} · {dev}')}; "
                         f"s{s.index} [label={_q(count(len(s.nodes), 'node'))}]; }}")
        for s in plan.stages[:-1]:
            lines.append(f"  s{s.index} -> s{s.index + 1} [label={_q(human(s.send_bytes, 'B'))}];")
        return "\n".join(lines + ["}"])
    nodes = [n for n in graph["nodes"] if n["stage"] is not None]
    by_id = {n["id"]: n for n in nodes}
    for n in nodes:
        if n["stage"] == MODEL_INPUT:
            lines.append(f"  {_q(n['id'])} [label={_q(n['name'] + chr(10) + ' '.join(n['shapes']))}, "
                         'shape=ellipse, fillcolor="#e8f4e8"];')
    for s in plan.stages:
        dev = plan.devices[s.device]["name"] if s.device < len(plan.devices) else "?"
        lines.append(f"  subgraph cluster_{s.index} {{")
        where = f"device {s.device} {dev}" if plan.replicas == 1 else replica_group(plan, s)
        lines.append(f"    label={_q(f'stage {s.index} · {where}')}; style=rounded; "
                     'color="#7a8ca3";')
        members = [n for n in nodes if n["stage"] == s.index]
        for n in members:
            label = f"{n['name']}\n{n['op']}  {shapes_text(n['shapes'])}"
            lines.append(f"    {_q(n['id'])} [label={_q(label)}];")
        if not members:  # Graphviz drops an empty cluster; keep the stage visible
            lines.append(f'    "stage_{s.index}_empty" [label="no nodes of its own", style=dashed];')
        lines.append("  }")
    lines.append('  "output" [shape=ellipse, fillcolor="#e8f4e8"];')
    for n in nodes:
        for u in n["users"]:
            if u["id"] != "output" and u["id"] not in by_id:
                continue
            cross = u["stage"] != n["stage"]
            attrs = (f' [label={_q(human(n["output_bytes_mb"], "B"))}, penwidth=2, color="#c0392b", '
                     'fontcolor="#c0392b"]') if cross and n["stage"] != MODEL_INPUT else ""
            lines.append(f"  {_q(n['id'])} -> {_q(u['id'])}{attrs};")
    return "\n".join(lines + ["}"])


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
