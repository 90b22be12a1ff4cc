#!/usr/bin/env bash
# Re-render docs/report-vgg16.png: compile VGG-16 (batch 8, 4 A100s) with its report.html and
# screenshot the page in headless Chromium (apt-get install -y chromium).
#   docs/screenshot.sh [OUT_PNG]
set -euo pipefail
cd "$(dirname "$0")/.."
png="${1:-docs/report-vgg16.png}"
py="${PYTHON:-.venv/bin/python}"
browser="$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)"
[ -n "$browser" ] || { echo "screenshot.sh: no chromium on PATH (apt-get install -y chromium)" >&2; exit 1; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

"$py" - "$work/vgg16" <<'PY'
import json, sys
from pipecc import driver
from pipecc.backends.torch import cut_stages, write_output
from pipecc.report.artifacts import graph_json, timeline_for, timeline_json
from pipecc.report.html import render_report

analysis = driver.analyze("models/vgg16.py", batch_size=8)
plan, graph = driver.plan(analysis, "4xa100", compare=True)
timeline = timeline_for(plan)  # the planner's timeline for this plan
write_output(sys.argv[1], graph, plan, cut_stages(graph, plan.stage_of()), extra_files={
    "graph.json": json.dumps(graph_json(graph, plan), indent=1),
    "timeline.json": json.dumps(timeline_json(timeline)),
    "report.html": render_report(graph, plan, timeline)})
PY

"$browser" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
    --disable-background-networking --disable-component-update --disable-sync \
    --user-data-dir="$work/profile" --hide-scrollbars --screenshot="$png" --window-size=1400,2000 \
    "file://$work/vgg16/report.html" 2>/dev/null
echo "wrote $png"
