"""Test configuration: tests import `helpers` from this folder; hypothesis runs derandomized
in CI (CI=true), so a landing never depends on which random examples a run happened to draw
(locally the examples vary from run to run and keep finding new cases)."""
import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings

sys.path.insert(0, str(Path(__file__).parent))

settings.register_profile("ci", derandomize=True, deadline=None)
settings.register_profile("dev", deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


SLOW_LIST = Path(__file__).with_name("slow_tests.txt")


def slow_node_ids() -> set[str]:
    """The node ids tests/slow_tests.txt lists (measured: see its header)."""
    lines = (line.split("#", 1)[0].strip() for line in SLOW_LIST.read_text().splitlines())
    return {line for line in lines if line}


def pytest_collection_modifyitems(config, items) -> None:
    """Mark the tests of slow_tests.txt `slow`: `make test-fast` (-m "not slow") leaves them out."""
    import pytest

    slow = slow_node_ids()
    for item in items:
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)




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
