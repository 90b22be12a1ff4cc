"""Test configuration: tests import `helpers` from this folder; hypothesis runs derandomized
in CI (CI=true), so a landing never depends on which random examples a run happened to draw
(locally the examples vary from run to run and keep finding new cases)."""
import gc
import json
import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings

sys.path.insert(0, str(Path(__file__).parent))

settings.register_profile("ci", derandomize=True, deadline=None)
settings.register_profile("dev", deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


ROOT = Path(__file__).resolve().parents[1]
# the editable install's packages (pipecc, pipecc.backends, pipecc.models, pipecc.passes)
PACKAGES = ("pipecc", "backends", "models", "passes")


def pytest_configure(config) -> None:
    """Bytecode for pipecc's own modules, written once (compileall: nothing when it is fresh),
    even where PYTHONDONTWRITEBYTECODE is set: that variable only stops writing, so every rank,
    launcher and worker that imports pipecc then reads the .pyc instead of compiling its
    sources again (about 0.1-0.2 s of CPU per process; the suite starts hundreds). The stage
    and model files of compiled folders are never imported through the import system
    (pipecc.runtime.stagefile), so no folder gets a __pycache__."""
    import compileall
    for name in PACKAGES:
        compileall.compile_dir(str(ROOT / name), quiet=2)
    name_group_record(config)


@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session):
    """Collection with bytecode writing on: pytest keeps each test module's assertion rewrite
    (seconds of CPU for the whole suite, in every xdist worker) in tests/__pycache__ and reads it
    back next time; the flag is restored before any test runs (tests that import files of their
    own tmp folders leave no __pycache__ there)."""
    before = sys.dont_write_bytecode
    sys.dont_write_bytecode = False
    try:
        yield
    finally:
        sys.dont_write_bytecode = before


# ---------------------------------------------------------------------------- garbage collector
# A worker holds millions of long-lived objects (torch, sympy, fx, hypothesis, pipecc, the test
# modules; later the libraries tests import lazily) and CPython's full collections walk all of
# them, each longer than the last: measured over ten in-process test files, 2.5-2.7 s of
# collections in 27 s. Frozen (gc.freeze) after collection and again between test files (after
# a collection, so nothing that is garbage then is kept), a full collection walks only what the
# file being run made: 1.3 s there. Reference counting frees everything as before; a frozen
# object that later becomes part of a garbage cycle stays until the worker exits.

def pytest_collection_finish(session) -> None:
    gc.collect()
    gc.freeze()


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After a test file's last test (its module fixtures gone): collect, then freeze."""
    yield
    if nextitem is not None and nextitem.nodeid.split("::", 1)[0] != item.nodeid.split("::", 1)[0]:
        gc.collect()
        gc.freeze()


SLOW_LIST = Path(__file__).with_name("slow_tests.txt")


def slow_node_ids() -> set[str]:
    """The node ids tests/slow_tests.txt lists (measured: see its header)."""
    lines = (line.split("#", 1)[0].strip() for line in SLOW_LIST.read_text().splitlines())
    return {line for line in lines if line}


def pytest_collection_modifyitems(config, items) -> None:
    """Mark the tests of slow_tests.txt `slow`: `make test-fast` (-m "not slow") leaves them out.
    Then run the files that hold slow tests first (slow_first)."""
    slow = slow_node_ids()
    for item in items:
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)
    items[:] = slow_first(items)
    record_groups(config, items)


def slow_first(items: list) -> list:
    """The test files by how many slow tests they hold, most first; each file's tests together
    and in their order, files of equal count in collection order.

    Under `-n 2 --dist loadgroup` xdist hands out its groups first (largest first), then the
    tests of no group in this order, one at a time to whichever worker asks: a 25-s test that
    starts last keeps one worker busy while the other idles (the tail). With the files of slow
    tests first the tail is short tests. A file stays whole so that its module-scoped fixtures
    (compiled folders) are built once per worker, not again for the tests moved away from them."""
    def path(item) -> str:
        return item.nodeid.split("::", 1)[0]

    weight: dict[str, int] = {}
    for item in items:
        weight[path(item)] = weight.get(path(item), 0) + (item.get_closest_marker("slow") is not None)
    order = {name: i for i, name in enumerate(weight)}  # collection order
    return sorted(items, key=lambda item: (-weight[path(item)], order[path(item)]))




# ---------------------------------------------------------------------------- xdist groups
# pytest-xdist 3.8 puts a test in its `xdist_group` by appending "@GROUP" to `item._nodeid`;
# pytest 9 derives `nodeid` from `item._id` and ignores that attribute, so under pytest 9
# `--dist loadgroup` ran every test on its own, in collection order (a group's module
# fixtures, torchrun launches among them, built again on the second worker; the groups' long
# tests last). The workers write each grouped test's group (xdist's name: the sorted mark
# names joined by "_") to a file the controller named; the controller's scheduler reads it.
GROUPS_ENV = "PIPECC_TEST_XDIST_GROUPS"


def _is_xdist_controller(config) -> bool:
    return (not hasattr(config, "workerinput") and config.pluginmanager.has_plugin("xdist")
            and config.getoption("dist", "no") == "loadgroup")


def record_groups(config, items) -> None:
    """On an xdist worker: each grouped test's group, into the controller's record."""
    path = os.environ.get(GROUPS_ENV)
    if not hasattr(config, "workerinput") or not path:
        return
    groups = {}
    for item in items:
        names = {str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                 for m in item.iter_markers("xdist_group")}
        if names:
            groups[item.nodeid] = "_".join(sorted(names))
    tmp = f"{path}.{config.workerinput['workerid']}"
    Path(tmp).write_text(json.dumps(groups))
    os.replace(tmp, path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """LoadGroupScheduling whose groups come from the workers' record (see above)."""
    if not _is_xdist_controller(config) or not os.environ.get(GROUPS_ENV):
        return None
    from xdist.scheduler import LoadGroupScheduling

    class RecordedGroups(LoadGroupScheduling):
        _groups: dict | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._groups is None:
                source = Path(os.environ[GROUPS_ENV])
                self._groups = json.loads(source.read_text()) if source.exists() else {}
            return self._groups.get(nodeid) or super()._split_scope(nodeid)

    return RecordedGroups(config, log)


def name_group_record(config) -> None:
    """The controller names the group record before its workers start (they inherit it)."""
    if _is_xdist_controller(config):
        import tempfile
        handle, name = tempfile.mkstemp(prefix="pipecc-test-groups-", suffix=".json")
        os.close(handle)
        os.unlink(name)
        os.environ[GROUPS_ENV] = name


def pytest_unconfigure(config) -> None:
    path = os.environ.get(GROUPS_ENV)
    if path and _is_xdist_controller(config):
        Path(path).unlink(missing_ok=True)


# The bad-input suite (one-line errors, nothing left behind): its files, the category each tries.
BAD_INPUT_SUITE = {"test_bad_inputs_frontend.py": "model files and ONNX files",
                   "test_bad_inputs_output.py": "compiled folders and OUT",
                   "test_bad_inputs_run.py": "runs of damaged folders and bad run flags",
                   "test_output_files.py": "output files (-o, --trace, --report, export-checkpoint)",
                   "test_hangs_and_leftovers.py": "hangs, exits and leftovers",
                   "test_model_side_effects.py": "model code leaking into output",
                   "test_trust.py": "trust (hashes, bytecode, checkpoints)"}
_TRIED: dict = {}


def pytest_runtest_logreport(report) -> None:
    """Count what the bad-input suite tried, per category (also the reports xdist workers send)."""
    file = report.nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    category = BAD_INPUT_SUITE.get(file)
    if category is None or not (report.when == "call" or (report.when == "setup" and not report.passed)):
        return
    counts = _TRIED.setdefault(category, {})
    counts[report.outcome] = counts.get(report.outcome, 0) + 1


def pytest_terminal_summary(terminalreporter) -> None:
    """The bad-input suite's cases per category: what was tried and how it came out."""
    if not _TRIED:
        return
    terminalreporter.write_sep("-", "bad-input suite: cases tried per category")
    for category, counts in sorted(_TRIED.items()):
        tried = sum(counts.values())
        parts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items()))
        terminalreporter.write_line(f"{category}: {tried} tried ({parts})")


@pytest.fixture
def one_thread():
    """torch on one thread for the test (several xdist workers share the cores), restored after."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------------------- shared compiled folders
# Compiled once per xdist worker (session scope) and never written to: a test or module fixture
# that runs, edits or damages a folder takes a copy (helpers.copy_folder, or the `mlp_copy`
# fixture); a copy costs milliseconds, the MLP's compile 0.1 s warm to 1.5 s as a process's first.

@pytest.fixture(scope="session")
def mlp_folder(tmp_path_factory) -> Path:
    """The tiny MLP (helpers.MLP_TINY) compiled for two CPU ranks, batch 8 in 2 micro-batches,
    every device a stage (helpers.compile_mlp's defaults). Read-only: copy it to change or run it."""
    from helpers import compile_mlp
    return compile_mlp(tmp_path_factory.mktemp("shared") / "mlp")


@pytest.fixture
def mlp_copy(mlp_folder: Path, tmp_path: Path) -> Path:
    """A copy of `mlp_folder` this test may run, edit or damage."""
    from helpers import copy_folder
    return copy_folder(mlp_folder, tmp_path / "mlp")
