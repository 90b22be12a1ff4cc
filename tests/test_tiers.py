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
