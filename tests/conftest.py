"""Test configuration: tests import `helpers` from this folder; hypothesis runs derandomized
in CI (CI=true), so a landing never depends on which random examples a run happened to draw
(locally the examples vary from run to run and keep finding new cases). torchvision_ops makes
`import torchvision` work on the CPU torch before any test imports it."""
import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings

sys.path.insert(0, str(Path(__file__).parent))

# NOTE: before anything imports torchvision (transformers and timm do): the registry's
# torchvision for torch 2.13 is a CUDA build whose C ops cannot load here (see the module)
import torchvision_ops  # noqa: E402,F401
import real_zoo  # noqa: E402  (the same for the CLI children the tests start: tests/rank_site)

os.environ.update(real_zoo.child_env())

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




@pytest.fixture
def one_thread():
    """torch on one thread for the test (several xdist workers share the cores), restored after."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
