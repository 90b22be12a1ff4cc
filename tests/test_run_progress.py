"""`pipecc run`'s step lines (issue 21, item 10): a bar on a terminal, a line per N steps
elsewhere, through the launcher's real output path (`supervise` on a child process)."""

from __future__ import annotations

import io
import sys

from pipecc.cli.runprogress import MAX_LINES, RunProgress
from pipecc.runtime.launcher import supervise


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def step_lines(n: int) -> list[str]:
    return [f"step {i}: loss {1.0 / (i + 1):.6g}, {100 + i}.0 samples/s\n" for i in range(n)]


def feed(progress: RunProgress, lines: list[str], out: io.StringIO) -> None:
    """What the launcher does with each stdout line."""
    for text in lines:
        if not progress.line(text):
            progress.interrupt()
            out.write(text)
    progress.close()


def test_a_log_keeps_every_nth_step_and_the_first_and_last() -> None:
    out = io.StringIO()
    feed(RunProgress(1000, out), step_lines(1000), out)
    kept = out.getvalue().splitlines()
    assert len(kept) <= MAX_LINES + 1, len(kept)
    assert kept[0].startswith("step 0: loss 1,") and kept[-1].startswith("step 999: loss 0.001,")
    assert kept[1].startswith("step 50: ")  # every ceil(1000 / 20) = 50 steps


def test_a_short_run_and_verbose_keep_every_line() -> None:
    for progress_args, n in (({}, MAX_LINES), ({"verbose": True}, 300)):
        out = io.StringIO()
        feed(RunProgress(n, out, **progress_args), step_lines(n), out)
        assert out.getvalue() == "".join(step_lines(n))


def test_other_lines_pass_through_untouched() -> None:
    out = io.StringIO()
    lines = ["verify: outputs, loss and 3 gradients match\n", *step_lines(100), "resumed from x\n"]
    feed(RunProgress(100, out), lines, out)
    text = out.getvalue()
    assert text.startswith("verify: outputs") and text.endswith("resumed from x\n")


def test_a_terminal_gets_one_bar_redrawn_in_place_with_loss_and_rate() -> None:
    term = Terminal()
    lines = [*step_lines(500)[:250], "note: something\n", *step_lines(500)[250:]]
    feed(RunProgress(500, term), lines, term)
    text = term.getvalue()
    assert text.count("\n") == 2, text.count("\n")  # the note's line and the bar's last state
    last = text.rsplit("\r\x1b[K", 1)[1]
    assert last.startswith("step 500/500  [" + "#" * 24 + "]") and "loss 0.002" in last
    assert "599.0 samples/s" in last and last.endswith("\n")
    assert "\r\x1b[Knote: something\n" in text  # the bar was cleared before the note
    assert "step 0: loss" not in text


def test_quiet_on_a_terminal_is_a_log() -> None:
    term = Terminal()
    feed(RunProgress(100, term, quiet=True), step_lines(100), term)
    assert "\r" not in term.getvalue() and term.getvalue().count("\n") <= MAX_LINES + 1


def test_the_launcher_hands_the_child_s_step_lines_to_the_filter(capsys) -> None:
    child = ("import sys\n"
             "for i in range(200): print(f'step {i}: loss 0.5, 10.0 samples/s')\n"
             "print('done')\n")
    out = io.StringIO()
    progress = RunProgress(200, out)
    assert supervise([sys.executable, "-c", child], {"PATH": "/usr/bin:/bin"}, verbose=False,
                     steps=progress) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "step 0: loss 0.5, 10.0 samples/s" and printed[-1] == "done"
    assert len(printed) == 200 // 10 + 2, printed  # every 10th step, the last step, "done"
