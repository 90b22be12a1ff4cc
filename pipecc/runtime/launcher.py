"""Supervising a torchrun launch (``pipecc run``): stream its output, stop every process it
started, and turn a failure into one line.

    pipecc run ──► torchrun agent ──► worker rank 0 (own session) ──► its stages
                                  └─► worker rank 1 (own session) ...

What ``supervise`` guarantees:

  * Output. The workers' stdout and stderr stream through, except ``pipecc: error:`` lines and
    torchrun's own log (held back; shown with --verbose/--debug): a failed run ends with exactly
    one ``pipecc: error: run failed: ...`` line, chosen by ``root_cause``: a ``verify:`` mismatch,
    else the first error that is not a consequence of another rank's failure, else the rank the
    others were waiting for ("rank 1 hung: rank 0 timed out after 10 s waiting for RECV_B mb 0
    from it").
  * Prompt failure. From the first worker error the others get ``GRACE_S`` to finish on their
    own; then every process of the launch still running gets SIGKILL (a checkpoint is renamed
    into place, so no kill leaves a partial one). Stopping a run for another reason (Ctrl-C, a
    stopped agent) sends SIGTERM first and SIGKILL ``GRACE_S`` later, the agent and a stopped
    process SIGKILL at once. torchrun alone would give a rank that ignores SIGTERM (or is
    stopped) 30 s more. A hang therefore ends a run about ``GRACE_S`` past ``--timeout`` (and
    `pipecc run` exits without tearing torch down: ``cli.app._exit_now``).
  * No orphans. The workers live in sessions of their own, so the descendants of the agent are
    recorded while it lives (``ProcessTree``, from /proc) and stopped when it ends, also when it
    was killed; the workers also watch for it themselves (``pipecc.runtime.lifeline``).
  * ``json_only`` (``pipecc run --json``): stdout carries the run's one JSON document (a line
    starting ``{"format": "pipecc-run"``) and nothing else; any other line a worker writes to
    its stdout (also from C code, which Python's redirection does not catch) goes to stderr.
  * Ctrl-C (SIGINT) or SIGTERM stops every process of the launch and raises KeyboardInterrupt
    (the CLI prints ``pipecc: error: interrupted`` and exits 130) or ``Terminated`` (143), with
    nothing of the children's shutdown chatter shown.

Imports ``pipecc.errors`` and the standard library only.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from pipecc.errors import PipeccError

__all__ = ["GRACE_S", "ProcessTree", "Terminated", "root_cause", "supervise"]

GRACE_S = 0.5
RENDEZVOUS_SLACK_S = 15.0  # beyond --timeout: the agent's own start (importing torch) on a loaded machine
# torchrun's own log lines: "W1129 08:45:56.813000 20508 torch/distributed/run.py:874] ..."
_TORCHRUN_LOG = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S*torch/distributed/")
_WORKER_ERROR = re.compile(r"pipecc: error: (.*)")
# torch's C++ log line when a peer's socket closed during setup or a collective, e.g. "[E1201
# 15:19:06.208584802 ProcessGroupGloo.cpp:67] Gloo connectFullMesh failed with ... Connection
# closed by peer": the consequence of another rank's failure, whose own error line follows; held
# back like torchrun's log (shown with --verbose)
_C10_PEER_LOG = re.compile(r"^\[[EW]\d{4} [\d:.]+ \S+:\d+\] .*(?:Connection closed by peer|"
                           r"Connection reset by peer|connectFullMesh failed)")
_RANK = re.compile(r"^rank (\d+)\b")
# a receive times out "... from rank N", a send "... to rank N": either way rank N is waited for
_TIMED_OUT = re.compile(r"^rank (\d+): timed out after (\S+) s waiting for (.+) (from|to) rank (\d+)")
_PEER_GONE = re.compile(r"^rank (\d+): (.+? (?:from|to)) rank (\d+) failed, the peer exited or crashed")
_LAUNCH_GONE = re.compile(r"^rank \d+: (?:the torchrun agent|pipecc run) \(pid \d+\) is gone")
_DOCUMENT = '{"format": "pipecc-run"'  # how pipecc.runtime.timing's document starts (json.dumps)


class Terminated(PipeccError):
    """``pipecc run`` got SIGTERM: the launch was stopped."""

    exit_code = 143


# ----------------------------------------------------------------------------- choosing the line


def root_cause(errors: list[str]) -> str:
    """The one error to report of the workers' ``pipecc: error:`` messages (see the module doc)."""
    verify = [e for e in errors if e.startswith("verify:") or re.match(r"^rank \d+: verify:", e)]
    if verify:
        return verify[0]
    primary = [e for e in errors if not (_TIMED_OUT.match(e) or _PEER_GONE.match(e) or _LAUNCH_GONE.match(e))]
    if primary:
        return primary[0]
    # NOTE: a hung rank's lifeline thread still says the agent is gone when the run is stopped:
    # that is the stop's consequence, not the rank reporting its own failure
    reported = {int(m.group(1)) for m in map(_RANK.match, errors) if m and not _LAUNCH_GONE.match(m.string)}
    for e in errors:
        found = _TIMED_OUT.match(e)
        if found and int(found.group(5)) not in reported:
            waiter, seconds, what, way, culprit = found.groups()
            return f"rank {culprit} hung: rank {waiter} timed out after {seconds} s waiting for {what} {way} it"
    for e in errors:
        found = _PEER_GONE.match(e)
        if found and int(found.group(3)) not in reported:
            return f"rank {found.group(3)} stopped without a message (rank {found.group(1)}: {found.group(2)} " \
                   f"rank {found.group(3)} failed)"
    return errors[0]


class _Watch:
    """Scans the children's stderr: worker errors, torchrun's failure summary."""

    def __init__(self, verbose: bool) -> None:
        self.verbose = verbose
        self.errors: list[str] = []  # worker `pipecc: error:` messages, in arrival order
        self.first_error_at: float | None = None
        self.held: list[str] = []  # torchrun's own lines, and everything after it saw a child fail
        self.launcher_failed = False
        self.muted = False  # set on SIGINT/SIGTERM: the children's shutdown is not shown
        self.before_workers = False  # supervise: the agent's own output until it starts a worker, held
        self.agent_lines: list[str] = []

    def line(self, text: str) -> None:
        found = _WORKER_ERROR.search(text)
        if found:
            # two ranks' lines glued into one (an older worker's two writes): each error apart
            self.errors += [e.strip() for e in found.group(1).split("pipecc: error: ") if e.strip()]
            if self.first_error_at is None:
                self.first_error_at = time.monotonic()
            if self.verbose:
                _write(sys.stderr, text, self)
        elif _C10_PEER_LOG.match(text):
            self.held.append(text)
            if self.verbose:
                _write(sys.stderr, text, self)
        elif self.before_workers:  # a rendezvous that fails prints the agent's traceback: held
            self.agent_lines.append(text)
            self.held.append(text)
            if self.verbose:
                _write(sys.stderr, text, self)
        elif _TORCHRUN_LOG.match(text) or self.launcher_failed:
            # NOTE: after "failed (exitcode" comes the launcher's ChildFailedError traceback
            self.launcher_failed = self.launcher_failed or "failed (exitcode" in text
            self.held.append(text)
            if self.verbose:
                _write(sys.stderr, text, self)
        else:
            _write(sys.stderr, text, self)

    def failed_rank(self) -> int | None:
        """The root-cause rank of torchrun's failure summary, else the first listed."""
        text = "".join(self.held)
        root = text.split("Root Cause", 1)
        for part in (root[1] if len(root) > 1 else "", text):
            found = re.search(r"^\s*rank\s*:\s*(\d+)", part, re.MULTILINE)
            if found:
                return int(found.group(1))
        return None

    def exit_code(self) -> str | None:
        found = re.search(r"^\s*exitcode\s*:\s*(-?\d+)", "".join(self.held).split("Root Cause")[-1], re.MULTILINE)
        return found.group(1) if found else None


def _write(stream: Any, text: str, watch: _Watch | None = None) -> None:
    if watch is not None and watch.muted:
        return
    try:
        stream.write(text)
        stream.flush()
    except (BrokenPipeError, ValueError):
        pass


# ----------------------------------------------------------------------------- the process tree


def _stat(pid: int) -> tuple[int, str, str] | None:
    """(parent pid, state, start time) of ``pid`` from /proc; None when it is gone (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[1]), fields[0], fields[19]) if len(fields) > 19 else None


class ProcessTree:
    """The descendants of ``root`` (pid and start time, so a reused pid is never signalled),
    remembered while ``refresh`` can still find them through their parents."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.known: dict[int, str] = {}

    def refresh(self) -> None:
        children: dict[int, list[int]] = {}
        try:
            entries = os.listdir("/proc")
        except OSError:
            return
        for entry in entries:
            if entry.isdigit():
                stat = _stat(int(entry))
                if stat:
                    children.setdefault(stat[0], []).append(int(entry))
        todo = list(children.get(self.root, ()))
        while todo:
            pid = todo.pop()
            stat = _stat(pid)
            if stat and pid not in self.known:
                self.known[pid] = stat[2]
            todo += children.get(pid, ())

    def alive(self) -> list[int]:
        """Remembered descendants that still run (not zombies, not a reused pid)."""
        out = []
        for pid, start in self.known.items():
            stat = _stat(pid)
            if stat and stat[2] == start and stat[1] != "Z":
                out.append(pid)
        return out

    def stop(self, agent: subprocess.Popen, grace_s: float = GRACE_S, hard: bool = False) -> None:
        """SIGTERM every remembered descendant (SIGKILL a stopped one, and the agent), SIGKILL
        what is left after ``grace_s``; ``hard``: SIGKILL at once (the ranks already had their
        grace: a failed run)."""
        if agent.poll() is None:
            self.refresh()
        for sig in ((signal.SIGKILL,) if hard else (signal.SIGTERM, signal.SIGKILL)):
            for pid in self.alive():
                # NOTE: a stopped process (SIGSTOP, a debugger) cannot act on SIGTERM: it would
                # only cost the grace period; it gets SIGKILL at once
                stat = _stat(pid)
                _kill(pid, signal.SIGKILL if stat and stat[1] in ("T", "t") else sig)
            if agent.poll() is None:
                # NOTE: SIGKILL at once: on SIGTERM the agent stops its workers itself (what the
                # loop above does) and then tears torch down, 0.5 s past a --timeout under load
                _kill(agent.pid, signal.SIGKILL)
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and (agent.poll() is None or self.alive()):
                time.sleep(0.02)
            if agent.poll() is not None and not self.alive():
                return
        agent.wait()


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# ----------------------------------------------------------------------------- running


def _die_with_parent() -> None:
    """In the torchrun agent, before it runs: the kernel sends it SIGKILL when ``pipecc run`` dies,
    also by ``kill -9`` (Linux's PR_SET_PDEATHSIG); its workers follow through their lifeline
    (``pipecc.runtime.lifeline``). Elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def supervise(cmd: list[str], env: dict[str, str], verbose: bool, json_only: bool = False,
              steps: Any = None, timeout_s: float = 60.0, rendezvous: str | None = None) -> int:
    """Run torchrun with ``env``, stream its output, return 0 or raise one ``PipeccError`` line;
    ``json_only``: only the run's JSON document goes to stdout, every other line to stderr.
    ``steps`` (`pipecc.cli.runprogress.RunProgress`): sees each stdout line first and may draw
    or drop the step lines; told before any other output, and closed at the end.

    ``timeout_s`` (the ranks' --timeout) also bounds what the workers cannot see: an agent that
    is stopped (SIGSTOP) while its workers run or after they ended, and, with ``rendezvous``
    (the line naming what several nodes must do), a rendezvous no worker came out of."""
    try:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, bufsize=1, errors="replace", preexec_fn=_die_with_parent)
    except OSError as exc:
        raise PipeccError(f"cannot start torchrun ({exc})") from None
    watch, tree = _Watch(verbose), ProcessTree(proc.pid)
    watch.before_workers = True

    def out(text: str) -> None:
        if steps is not None and not text.startswith(_DOCUMENT) and not watch.muted:
            if steps.line(text):
                return
            steps.interrupt()
        _write(sys.stderr if json_only and not text.startswith(_DOCUMENT) else sys.stdout, text, watch)

    def err(text: str) -> None:
        if steps is not None:
            steps.interrupt()
        watch.line(text)

    pumps = [threading.Thread(target=_pump, args=(proc.stdout, out), daemon=True),
             threading.Thread(target=_pump, args=(proc.stderr, err), daemon=True)]
    for thread in pumps:
        thread.start()
    stopped_it = failed = False
    began, stopped_since, why = time.monotonic(), None, None
    with _Signals(watch) as signals:
        try:
            next_refresh = 0.0
            while proc.poll() is None:
                now = time.monotonic()
                if now >= next_refresh:
                    tree.refresh()
                    next_refresh = now + 0.2
                    if tree.known:
                        watch.before_workers = False
                if watch.first_error_at is not None and now - watch.first_error_at > GRACE_S:
                    # the run failed and the others had their grace: stop the ranks still waiting
                    # (or hung) with SIGKILL, safe as every file a rank writes is renamed into place
                    stopped_it = watch.muted = failed = True
                    break
                state = _stat(proc.pid)
                if state is not None and state[1] in ("T", "t"):  # stopped: it reaps and reports nothing
                    stopped_since = stopped_since if stopped_since is not None else now
                    if (tree.known and not tree.alive()) or now - stopped_since > timeout_s:
                        why = _stopped_agent(proc.pid, tree)
                else:
                    stopped_since = None
                if rendezvous and not tree.known and now - began > timeout_s + RENDEZVOUS_SLACK_S:
                    why = f"no worker started within {timeout_s:g} s: {rendezvous}"  # torch's own limit did not fire
                if why is not None:
                    stopped_it = watch.muted = True
                    break
                time.sleep(0.05)
            tree.stop(proc, hard=failed)  # also the orphans of an agent that was killed
        except BaseException:
            watch.muted = True
            signals.ignore()
            tree.stop(proc)
            raise
    for thread in pumps:
        thread.join(timeout=5)
    if steps is not None:
        steps.close()
    rc = proc.returncode
    if why is not None and not watch.errors:
        raise PipeccError(f"run failed: {why}")
    if rc == 0 and not watch.errors:
        return 0
    if watch.before_workers and not watch.errors and rc != 0:  # the agent failed before any worker ran
        raise PipeccError(f"run failed: {_agent_failure(watch.agent_lines, rc, rendezvous, timeout_s)}")
    if rc < 0 and not stopped_it:
        name = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else f"signal {-rc}"
        raise PipeccError(f"run failed: the torchrun agent (pid {proc.pid}) was killed by {name}; "
                          "its workers were stopped")
    if watch.errors:
        message = root_cause(watch.errors)
        if not re.search(r"\brank \d+", message):
            rank = watch.failed_rank()
            message = f"rank {rank}: {message}" if rank is not None else message
        raise PipeccError(f"run failed: {message}")
    hint = "" if verbose else " (rerun with --verbose for torchrun's log)"
    rank = watch.failed_rank()
    if rank is not None:
        code = watch.exit_code()
        raise PipeccError(f"run failed: rank {rank} exited with code {code if code is not None else rc}{hint}")
    raise PipeccError(f"run failed: torchrun exited with code {rc}{hint}")


def _stopped_agent(pid: int, tree: ProcessTree) -> str:
    done = "after its workers ended" if tree.known and not tree.alive() else "while its workers ran"
    return (f"the torchrun agent (pid {pid}) was stopped (SIGSTOP) {done}; every process of the run "
            "was stopped")


def _agent_failure(lines: list[str], rc: int, rendezvous: str | None, timeout_s: float) -> str:
    """One line for an agent that exited before starting a worker: a rendezvous that timed out
    (torch's DistStoreError) says which nodes to start; anything else its last line."""
    text = "".join(lines)
    if rendezvous and re.search(r"DistStoreError|TimeoutError|timed out|Timed out|timeout", text):
        return f"the rendezvous did not complete within {timeout_s:g} s: {rendezvous}"
    last = next((ln.strip() for ln in reversed(lines) if ln.strip()), "")
    return f"torchrun exited with code {rc} before starting any worker" + (f" ({last})" if last else "")


def _pump(stream: Any, sink: Any) -> None:
    for text in stream:
        sink(text)


class _Signals:
    """SIGINT and SIGTERM mute the children at once and raise in the main thread."""

    def __init__(self, watch: _Watch) -> None:
        self.watch = watch
        self.saved: dict[int, Any] = {}

    def _on(self, signum: int, frame: Any) -> None:
        self.watch.muted = True
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Terminated("terminated (SIGTERM); stopped every process of the run")

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.saved[sig] = signal.signal(sig, self._on)
        return self

    def ignore(self) -> None:
        """While the launch is being stopped: a second Ctrl-C must not cut that short."""
        for sig in self.saved:
            signal.signal(sig, signal.SIG_IGN)

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)
