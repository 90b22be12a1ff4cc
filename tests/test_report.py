"""OUT/report.html: self-contained, the schedule drawn from the simulator, bars, baselines, costs."""
from __future__ import annotations

import os
import re
import stat
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import pytest

from pipecc.report.artifacts import timeline_for, timeline_json
from pipecc.report.compiled import load_compiled
from pipecc.report.dot import graphviz_svg
from pipecc.report.html import render_report, report_from_folder
from test_inspect import GPT_ARGS, compile_folder


@pytest.fixture(scope="module")
def gpt_out(tmp_path_factory) -> Path:
    return compile_folder(tmp_path_factory.mktemp("gpt") / "out", "gpt", GPT_ARGS, "4xcpu")


@pytest.fixture(scope="module")
def page(gpt_out) -> str:
    return (gpt_out / "report.html").read_text(encoding="utf-8")


def svgs(page: str) -> list[str]:
    return re.findall(r"<svg\b.*?</svg>", page, re.S)


def test_page_is_self_contained_and_well_formed(page):
    assert page.startswith("<!DOCTYPE html>")
    refs = re.findall(r"""\b(?:src|href|xlink:href)\s*=\s*["']?([^"'\s>]+)""", page, re.I)
    assert not [r for r in refs if not r.startswith("#")], refs
    assert not re.search(r"https?://", page.replace('xmlns="http://www.w3.org/2000/svg"', ""))
    assert "<script" not in page and "<link" not in page and "@import" not in page

    class Strict(HTMLParser):
        def error(self, message):  # pragma: no cover - py<3.10 only
            raise AssertionError(message)
    Strict().feed(page)
    for svg in svgs(page):  # every chart is well-formed XML (a viewer renders it, not guesses)
        ET.fromstring(svg.replace("&nbsp;", " "))


def test_gantt_has_one_row_per_device_and_blocks_per_microbatch(page, gpt_out):
    plan = load_compiled(gpt_out).plan
    gantt = next(s for s in svgs(page) if 'class="chart gantt"' in s)
    root = ET.fromstring(gantt)
    assert root.get("data-devices") == str(len(plan.devices))
    rows = [g for g in root.iter("g") if g.get("class") == "gantt-row"]
    assert [g.get("data-device") for g in rows] == [str(d) for d in range(len(plan.devices))]
    for d, row in enumerate(rows):
        blocks = [r for r in row.iter("rect") if (r.get("class") or "").startswith("block ")]
        stages = [s.index for s in plan.stages if s.device == d]
        for kind in ("F", "B"):
            got = sorted((int(b.get("data-stage")), int(b.get("data-microbatch")))
                         for b in blocks if b.get("class") == f"block {kind}")
            assert got == sorted((s, m) for s in stages for m in range(plan.microbatches)), (d, kind)
        assert all(float(b.get("width")) > 0 for b in blocks)
        assert all(b.find("title") is not None for b in blocks)  # hover text with the times
    sends = [r for r in root.iter("rect") if r.get("class") == "send"]
    assert sends, "communication not drawn"
    assert 'url(#idle-hatch)' in gantt  # bubbles visible as hatched idle time


def test_timeline_is_the_planners_own(gpt_out):
    plan = load_compiled(gpt_out).plan
    tl = timeline_for(plan)
    assert tl.iteration_s == pytest.approx(plan.predicted_iteration_s, rel=1e-12)
    assert tl.bubble_fraction == pytest.approx(plan.bubble_fraction, rel=1e-12)
    saved = load_compiled(gpt_out).timeline
    assert saved == timeline_json(tl) | {"events": saved["events"]}
    assert len(saved["events"]) == len(tl.events)


def test_stage_bars_memory_bars_and_baselines(page, gpt_out):
    plan = load_compiled(gpt_out).plan
    charts = {name: next(s for s in svgs(page) if f"chart bars {name}" in s)
              for name in ("stage-time", "memory", "balance")}
    for s in plan.stages:
        assert f"stage {s.index} · device {s.device}" in charts["stage-time"]
    assert "◀ bottleneck" in charts["stage-time"] and "lower bound" in charts["stage-time"]
    assert "capacity" in charts["memory"] and "planning limit 90%" in charts["memory"]
    assert charts["memory"].count("device ") >= len(plan.devices)
    assert len(plan.baselines) == 3
    for b in plan.baselines:
        assert b["name"] in page  # in the baselines table, with its bottleneck and ratio
        assert f"{b['bottleneck_s'] / plan.lower_bound_s:.3f}" in page
    assert f"{plan.balance_ratio:.3f}" in page
    assert 'class="data stages"' in page


def test_cost_table_per_module(page, gpt_out):
    table = page[page.index('class="data modules"'):]
    table = table[:table.index("</table>")]
    for module in ("blocks.0", "blocks.3", "wte", "lm_head"):
        assert f"<td>{module}</td>" in table
    assert "share of FLOPs" in table


def test_graphviz_used_when_installed_else_a_readable_fallback(gpt_out, tmp_path, monkeypatch):
    fake = tmp_path / "bin" / "dot"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\ncat > /dev/null\necho '<?xml version=\"1.0\"?>'\n"
                    "echo '<svg id=\"from-graphviz\"><g/></svg>'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    assert graphviz_svg("digraph g {}") == '<svg id="from-graphviz"><g/></svg>\n'
    with_dot = report_from_folder(gpt_out)
    assert 'id="from-graphviz"' in with_dot and "<?xml" not in with_dot
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    without = report_from_folder(gpt_out)
    assert "from-graphviz" not in without and "not installed" in without
    c = load_compiled(gpt_out)
    for s in c.plan.stages:  # the fallback lists each stage's nodes with op and shape
        assert f"<h4>stage {s.index} · device {s.device}" in without
    first = c.nodes_of(1)[0]
    assert f"<td>{first['name']}</td><td>{first['op']}</td>" in without


def test_render_is_deterministic_and_matches_the_folder(gpt_out, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # the compile-time page was made without dot here
    c = load_compiled(gpt_out)
    again = report_from_folder(gpt_out)
    assert again == report_from_folder(gpt_out)
    if "not installed" in (gpt_out / "report.html").read_text():
        assert again == (gpt_out / "report.html").read_text()
    # without graph.json or a timeline the page still renders from the plan alone
    bare = render_report(None, c.plan)
    assert 'class="chart gantt"' in bare and "No per-node data" in bare
