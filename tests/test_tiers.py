"""The test tiers (issue 21): every line of tests/slow_tests.txt names a test that exists, so
the list `make test-fast` leaves out cannot silently drift into naming nothing."""

from __future__ import annotations

import re

from conftest import SLOW_LIST, slow_node_ids
from helpers import ROOT


def test_every_listed_slow_test_exists() -> None:
    ids = slow_node_ids()
    assert ids, SLOW_LIST
    for nodeid in sorted(ids):
        path, _, name = nodeid.partition("::")
        source = (ROOT / path).read_text()
        function = name.split("[")[0]
        assert re.search(rf"^def {function}\(", source, re.MULTILINE), f"{nodeid}: no such test"


def test_the_smoke_launches_stay_in_the_fast_tier() -> None:
    ids = slow_node_ids()
    assert "tests/test_run_cmd.py::test_mlp_runs_and_verifies" not in ids
    assert not any(i.startswith("tests/test_runtime_dist.py::test_two_ranks_match_single_process") for i in ids)


def test_the_files_with_slow_tests_are_collected_first_and_whole() -> None:
    """conftest.slow_first: files by their count of slow tests (most first, ties in collection
    order), each file's tests together and in their order (its module fixtures built once)."""
    from conftest import slow_first

    class Item:
        def __init__(self, nodeid: str, slow: bool) -> None:
            self.nodeid, self.slow = nodeid, slow

        def get_closest_marker(self, name: str):
            return object() if name == "slow" and self.slow else None

    items = [Item("tests/test_a.py::t1", False), Item("tests/test_a.py::t2", False),
             Item("tests/test_b.py::t1", False), Item("tests/test_b.py::t2", True),
             Item("tests/test_c.py::t1", True), Item("tests/test_c.py::t2[x]", True),
             Item("tests/test_d.py::t1", True)]
    assert [i.nodeid for i in slow_first(items)] == [
        "tests/test_c.py::t1", "tests/test_c.py::t2[x]", "tests/test_b.py::t1", "tests/test_b.py::t2",
        "tests/test_d.py::t1", "tests/test_a.py::t1", "tests/test_a.py::t2"]
