"""Loading model files: the contract's `.py` convention (CONTRACT §2) and `.onnx` files.

A `.py` model file defines `build_model(**kwargs)` and `example_inputs(batch_size=1)`, and
optionally `loss_fn(outputs, target)` and `example_target(batch_size=1)`. Size keyword
arguments given with `--model-arg KEY=VALUE` go to `build_model`; they are also offered to
`example_inputs`/`example_target` when those accept them (so inputs can follow the sizes).
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import math
import os
import signal
import sys
import threading
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from pipecc.errors import PipeccError, UsageError

REQUIRED = ("build_model", "example_inputs")
# a model file is imported under this prefix and a hash of its path (not importable by name:
# a stage calls its functions through `pipecc.runtime.modelfuncs`)
MODULE_PREFIX = "pipecc_model_"


@dataclass
class ModelSpec:
    """What a model file provides, built and ready to trace."""

    path: Path
    model: torch.nn.Module
    example_inputs: tuple
    make_inputs: Callable[[int], tuple]
    loss_fn: Callable | None = None
    make_target: Callable[[int], Any] | None = None
    model_args: dict[str, Any] = field(default_factory=dict)


def parse_model_args(items: list[str] | None) -> dict[str, Any]:
    """Turn `KEY=VALUE` strings into keyword arguments; values are Python literals or strings."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.isidentifier():
            raise UsageError(f"--model-arg {item!r} is not KEY=VALUE (example: --model-arg n_layer=2)")
        try:
            out[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            out[key] = raw
    return out


def _call_with_accepted(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """Call fn with the keyword arguments it accepts (all of them if it takes **kwargs)."""
    params = inspect.signature(fn).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    return fn(*args, **kwargs)


def import_model_file(path: Path, source: bytes | None = None) -> Any:
    """Run a model file as a fresh module (registered in sys.modules under a name of its own).

    ``source`` is the file's bytes as already read (and hashed, ``pipecc.runtime.trust.
    model_source``); without it the file is read here, once. Either way those bytes are compiled
    from memory: the import system is never asked, so no ``__pycache__`` bytecode (which it
    trusts on a matching mtime and size) runs instead of the source, and nothing is re-read
    from the path after it was hashed.
    """
    path = Path(path)
    if source is None:
        if not path.exists():
            raise PipeccError(f"model file {str(path)!r} does not exist")
        if path.suffix != ".py":
            raise PipeccError(f"model file {str(path)!r} is neither .py nor .onnx")
        try:
            source = path.read_bytes()
        except OSError as exc:
            raise PipeccError(f"cannot read the model file {path} ({exc.strerror or exc})") from None
    name = f"{MODULE_PREFIX}{abs(hash(str(path.resolve())))}"
    module = types.ModuleType(name)
    module.__file__ = str(path)  # tracebacks, inspect.getsource and torch's source lookups
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    with _limited(f"importing {path.name}"):
        code = compile(source, str(path), "exec", dont_inherit=True)
        exec(code, module.__dict__)  # noqa: S102 - the user's model file, as `python model.py` would run it
    missing = [n for n in REQUIRED if not callable(defined(module, n))]
    if missing:
        raise PipeccError(
            f"{path.name} does not define {', '.join(missing)}; a model file needs "
            "build_model(**kwargs) and example_inputs(batch_size=1) (see docs/model-files.md)"
        )
    return module


TIME_LIMIT_ENV = "PIPECC_MODEL_TIME_LIMIT"  # seconds a model file's import or function may take
DEFAULT_TIME_LIMIT_S = 600.0


class _OverTime(BaseException):
    """Raised in the main thread when user code runs past the limit (a BaseException, so the
    user's own `except Exception` does not swallow it)."""


def time_limit_s() -> float:
    """``$PIPECC_MODEL_TIME_LIMIT`` (seconds; 0 = none), default 600."""
    raw = os.environ.get(TIME_LIMIT_ENV, "")
    try:
        value = float(raw) if raw.strip() else DEFAULT_TIME_LIMIT_S
    except ValueError:
        raise UsageError(f"{TIME_LIMIT_ENV}={raw!r} is not a number of seconds") from None
    return value if value > 0 and math.isfinite(value) else 0.0


RETRY_S = 0.5  # the timer fires again this often after the limit until the block has ended
_held = 0  # > 0: inside torch's C++ dispatch (fake tensors), where the timer must not raise
_expired = False  # the timer has fired in this block: a hold raises when it ends
# Python code that C++ or the import system called, where a raise does harm: an import cut
# short leaves a partly initialised module in sys.modules (every later compile in the process
# fails on `torch._dynamo`), and a raise inside a torch op's Python override can cross C++
# frames that cannot unwind it (SIGABRT). The timer raises on its next tick instead.
_UNSAFE_NAMES = frozenset({"__torch_function__", "__torch_dispatch__"})


def _may_raise_in(frame: Any) -> bool:
    """Whether the timer may raise in `frame` (the code it interrupted): not while any frame
    of the stack is an import or a torch op's Python override (`_UNSAFE_NAMES`)."""
    while frame is not None:
        code = frame.f_code
        if code.co_name in _UNSAFE_NAMES or code.co_filename.startswith("<frozen importlib"):
            return False
        frame = frame.f_back
    return True


@contextlib.contextmanager
def held() -> Iterator[None]:
    """A block the time limit never interrupts: an exception raised by the timer inside torch's
    dispatch (a fake-tensor op calling back into Python) can cross C++ frames that cannot unwind
    it, and the process aborts (SIGABRT) instead of naming the limit. A timer that fires inside
    the block raises when the block ends, between two ops."""
    global _held, _expired
    _held += 1
    try:
        yield
    finally:
        _held -= 1
    if not _held and _expired:
        _expired = False
        raise _OverTime()


@contextlib.contextmanager
def deadline(what: str) -> Iterator[None]:
    """Run the block under the time limit: one that does not return within it is named in one
    line, not a hang (a 100000-layer `--model-arg depth=100000`). The limit is a SIGALRM timer,
    so it holds in the main thread only (elsewhere the block runs unlimited); nested blocks keep
    the outer timer."""
    global _expired
    limit = time_limit_s()
    timed = (bool(limit) and threading.current_thread() is threading.main_thread()
             and hasattr(signal, "setitimer") and signal.getitimer(signal.ITIMER_REAL)[0] == 0)
    previous = None
    if timed:
        def over(signum: int, frame: Any) -> None:
            global _expired
            _expired = True
            # held (inside torch's dispatch): raised when the hold ends; an import or a torch
            # op's override (`_may_raise_in`): raised on a later tick, every RETRY_S
            if not _held and _may_raise_in(frame):
                raise _OverTime()
        previous = signal.signal(signal.SIGALRM, over)
        # then again every RETRY_S: a raise that lands in a callback Python ignores (a weakref's,
        # a destructor's) is lost, and the next one ends the block
        signal.setitimer(signal.ITIMER_REAL, limit, RETRY_S)
    try:
        yield
    except _OverTime:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)  # no second raise while this one is named
        raise PipeccError(f"{what} did not return within {limit:g} s; make the model smaller (--model-arg) "
                          f"or allow longer with {TIME_LIMIT_ENV}=SECONDS") from None
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            _expired = False


@contextlib.contextmanager
def _limited(what: str) -> Iterator[None]:
    """Run the user's code under the time limit (`deadline`) and turn what it raises into one
    line: an exception of any class (a BaseException subclass too, not just Exception) is the
    model file's error. Ctrl-C stays Ctrl-C."""
    try:
        with deadline(what):
            yield
    except SystemExit as exc:
        raise _exited(what, exc) from None
    except (PipeccError, KeyboardInterrupt, RecursionError):
        raise
    except MemoryError as exc:
        raise PipeccError(f"{what} ran out of memory (MemoryError{': ' + safe_str(exc) if safe_str(exc) else ''}); "
                          "give smaller sizes (--model-arg, -b) or run on a machine with more memory") from None
    except BaseException as exc:  # the user's code: report, don't crash
        raise PipeccError(f"{what} failed: {type(exc).__name__}: {safe_str(exc)}") from exc


def safe_str(exc: BaseException) -> str:
    """``str(exc)``, or a note when the model's exception class cannot even say what it is
    (its ``__str__`` raises)."""
    try:
        return str(exc)
    except Exception as inner:  # noqa: BLE001 - the user's __str__
        return f"(its message cannot be shown: {type(exc).__name__}.__str__ raised {type(inner).__name__})"


def defined(module: Any, name: str) -> Any:
    """What the model file defines as ``name`` (None when nothing): looked up in its namespace,
    so a module-level ``__getattr__`` (which may raise anything) is never called."""
    return vars(module).get(name)


def _exited(what: str, exc: SystemExit) -> PipeccError:
    """User code that calls sys.exit (or exit()) must not end pipecc silently with its code."""
    return PipeccError(f"{what} called sys.exit({exc.code!r}); a model file must return its "
                       "model and inputs, not exit")


def load_model_file(path: str | Path, model_args: dict[str, Any] | None = None,
                    batch_size: int = 1) -> ModelSpec:
    """Import, build and make example inputs. Errors from user code become PipeccError."""
    path = Path(path)
    model_args = dict(model_args or {})
    module = import_model_file(path)
    try:
        with _limited(f"build_model in {path.name}"):
            try:
                model = module.build_model(**model_args)
            except TypeError as exc:
                raise PipeccError(f"build_model in {path.name} rejected the model arguments: {exc}") from exc
    except RecursionError:
        raise PipeccError(f"build_model in {path.name} recursed too deeply (RecursionError)") from None
    if not isinstance(model, torch.nn.Module):
        raise PipeccError(f"build_model in {path.name} returned {type(model).__name__}, not an nn.Module")

    def make_inputs(b: int) -> tuple:
        inputs = _call_with_accepted(module.example_inputs, b, **model_args)
        return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)

    with _limited(f"example_inputs in {path.name}"):
        inputs = make_inputs(batch_size)
    make_target = None
    for name, what in (("loss_fn", "def loss_fn(outputs, target)"),
                       ("example_target", "def example_target(batch_size=1)")):
        value = defined(module, name)
        if value is not None and not callable(value):
            raise PipeccError(f"{name} in {path.name} is not a function but a value of type "
                              f"{type(value).__name__}; define {what} (or remove it)")
    if callable(defined(module, "example_target")):
        def make_target(b: int) -> Any:
            return _call_with_accepted(defined(module, "example_target"), b, **model_args)
    return ModelSpec(path=path, model=model, example_inputs=inputs, make_inputs=make_inputs,
                     loss_fn=defined(module, "loss_fn"), make_target=make_target,
                     model_args=model_args)


@contextlib.contextmanager
def kept_cwd() -> Iterator[None]:
    """The process's working folder as it was on entry, whatever the model's code inside does
    (`os.chdir` in build_model): every path given before means afterwards what it meant."""
    try:
        here = os.getcwd()
    except OSError:
        here = None
    try:
        yield
    finally:
        if here is not None:
            with contextlib.suppress(OSError):
                os.chdir(here)
