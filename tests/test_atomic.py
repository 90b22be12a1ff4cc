"""pipecc's one atomic write (`pipecc.runtime.atomic.write_atomic`): the whole file or none, no
temporary left behind, and temporaries named so a later write knows whose they are."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipecc.runtime.atomic import HOST, TEMP_TAG, temp_prefix, temp_status, umask, write_atomic


def test_bytes_text_and_a_writer(tmp_path: Path) -> None:
    target = tmp_path / "a.json"
    assert write_atomic(target, b"\x00\x01") == target and target.read_bytes() == b"\x00\x01"
    write_atomic(target, "ü\n")
    assert target.read_text(encoding="utf-8") == "ü\n"
    write_atomic(target, lambda tmp: Path(tmp).write_text("from a writer"))
    assert target.read_text() == "from a writer"
    assert os.listdir(tmp_path) == ["a.json"]
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask()
    write_atomic(target, "private", mode=0o600)
    assert target.stat().st_mode & 0o777 == 0o600


def test_a_failing_writer_leaves_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "latest.json"
    target.write_text("old")

    def fail(tmp: str) -> None:
        Path(tmp).write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_atomic(target, fail)
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["latest.json"]


def test_temporary_names_say_whose_they_are(tmp_path: Path) -> None:
    prefix = temp_prefix(tmp_path / "out", "file")
    assert prefix == f".out{TEMP_TAG}file-{HOST}-{os.getpid()}-"
    mine = tmp_path / (prefix + "x")
    mine.write_text("")
    assert temp_status(mine, mine.name[len(f".out{TEMP_TAG}"):]) == ("file", False)  # this process: running
    long = temp_prefix(tmp_path / ("n" * 250), "new")
    assert len(os.fsencode(long)) < 255 - 6  # room for mkstemp's random part
