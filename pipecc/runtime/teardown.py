"""Leaving the process group so that nothing of it outlives ``destroy_process_group``.

Why. ``torch.distributed.nn.functional`` evaluates ``group.WORLD`` as the default argument of
ten of its functions when it is imported, and torch imports it lazily: ``torch._dynamo``
imports it, and ``torch.optim`` imports ``torch._dynamo`` when a script builds its first
optimizer. A script that builds its optimizer after joining the process group (every training
script) so leaves the default group referenced from those defaults. ``destroy_process_group``
then drops torch's own references but not these: the gloo backend stays alive with its two
``pt_gloo_runloop`` worker threads, its ``gloo_tcp_loop`` thread and its sockets, and the
process reaches interpreter teardown with them running. The abort (a core dump's stacks, torch
2.14.1, Python 3.11): a worker thread, done with the last barrier, drops its work, which holds
the previous collective's tensors; releasing a tensor's Python object takes the GIL; when the
main thread is already in ``Py_FinalizeEx``, CPython ends such a thread with ``pthread_exit``,
whose forced unwind through the work's ``noexcept`` destructor calls ``std::terminate``:
"terminate called without an active exception", SIGABRT, exit -6, with every result written.
A race, so now and then: ``init_process_group``, then ``import torch.distributed.nn.functional``,
messages, ``barrier`` and ``destroy_process_group`` aborted 15 of 100 two-rank runs; with
``release_stale_defaults`` after the destroy 0 of 100, with the import before
``init_process_group`` 0 of 40 (the backend is then destroyed inside ``destroy_process_group``,
its threads joined). pipecc's training scripts and ``pipecc run`` had hit it about 1 run in 25.

What. ``bind_defaults_early`` (called before ``init_process_group``) imports that module while
``group.WORLD`` is still None, so its defaults never hold a group. ``leave`` (the one way a
pipecc rank leaves: ``DistributedPipeline.close``, ``pipecc run``'s ranks) waits for every rank,
destroys the process groups and replaces any process group still held in that module's
defaults by None (what ``group.WORLD`` is after the destroy, and what those functions then
mean by it), covering a script that joined the group itself before pipecc imported the module.
A script that never calls ``close()`` is covered by ``leave_at_exit`` (registered by
``pipecc.distributed.load``): at interpreter exit, before teardown, it destroys what is still
joined (without a barrier) and releases the same references. ``backend_threads`` names the
gloo threads still running (Linux; the tests assert none survive ``leave``).

Imports torch only."""

from __future__ import annotations

import atexit
import os
import sys
import types
from collections.abc import Callable

import torch.distributed as dist

__all__ = ["BINDS_WORLD", "backend_threads", "bind_defaults_early", "leave", "leave_at_exit",
           "release_stale_defaults"]

# torch modules that bind group.WORLD into default arguments at import and that torch itself
# imports lazily after a process group may exist (found by the referrers of a destroyed group)
BINDS_WORLD = ("torch.distributed.nn.functional",)
THREAD_PREFIXES = ("gloo", "pt_gloo")  # gloo_tcp_loop, pt_gloo_runloop (torch 2.x thread names)


def bind_defaults_early() -> None:
    """Import ``BINDS_WORLD`` before a process group exists (their defaults then bind None)."""
    import importlib

    for name in BINDS_WORLD:
        importlib.import_module(name)


def leave() -> None:
    """Leave the process group: a barrier (no rank tears its links down under a peer still
    draining a message), ``destroy_process_group``, then ``release_stale_defaults``. A no-op
    when no group is joined."""
    if not dist.is_initialized():
        return
    dist.barrier()
    dist.destroy_process_group()
    release_stale_defaults()


def leave_at_exit(forget: Callable[[], None]) -> None:
    """For a script that ends without ``close()``: at interpreter exit, while Python is whole,
    destroy the process groups still joined, release the stale defaults and call ``forget``
    (the pipelines' own references to groups). No barrier: every rank of a finished script has
    completed its messages, and a rank that ends on an exception must not wait for its peers.
    The latest ``forget`` is the one called."""
    if not _AT_EXIT:
        atexit.register(_at_exit)
    _AT_EXIT[:] = [forget]


_AT_EXIT: list[Callable[[], None]] = []  # the forget of leave_at_exit, once registered


def _at_exit() -> None:
    if not dist.is_initialized():
        return  # closed, or never joined
    try:
        dist.destroy_process_group()
        release_stale_defaults()
        for forget in _AT_EXIT:
            forget()
    except Exception as e:  # exiting anyway: say why, in one line
        print(f"pipecc: warning: leaving the process group at exit failed: {e}", file=sys.stderr)


def release_stale_defaults() -> int:
    """Replace every process group held in a default argument of ``BINDS_WORLD``'s functions by
    None; the number replaced. Call only once every group is destroyed."""
    replaced = 0
    for name in BINDS_WORLD:
        module = sys.modules.get(name)
        if module is None:
            continue
        for fn in vars(module).values():
            if isinstance(fn, types.FunctionType):
                replaced += _release(fn)
    return replaced


def _release(fn: types.FunctionType) -> int:
    count = 0
    if fn.__defaults__:
        defaults = tuple(None if isinstance(v, dist.ProcessGroup) else v for v in fn.__defaults__)
        count += sum(a is not b for a, b in zip(defaults, fn.__defaults__))
        fn.__defaults__ = defaults
    if fn.__kwdefaults__:
        stale = [k for k, v in fn.__kwdefaults__.items() if isinstance(v, dist.ProcessGroup)]
        for k in stale:
            fn.__kwdefaults__[k] = None
        count += len(stale)
    return count


def backend_threads() -> list[str] | None:
    """The names of this process's gloo threads (None where /proc does not list threads)."""
    tasks = f"/proc/{os.getpid()}/task"
    if not os.path.isdir(tasks):
        return None
    names = []
    for tid in os.listdir(tasks):
        try:
            with open(f"{tasks}/{tid}/comm", encoding="utf-8") as f:
                name = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if name.startswith(THREAD_PREFIXES):
            names.append(name)
    return sorted(names)
