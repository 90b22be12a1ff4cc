"""bench/RESULTS.md is shared by every bench: each owns the text between its
`<!-- KEY:begin -->` and `<!-- KEY:end -->` markers and rewrites only that."""
from __future__ import annotations

from pathlib import Path


def replace_section(path: Path, key: str, text: str) -> None:
    """Put `text` between `key`'s markers in `path` (the section is appended when missing,
    the file created when absent); everything else in the file stays as it was."""
    begin, end = f"<!-- {key}:begin -->", f"<!-- {key}:end -->"
    block = f"{begin}\n{text.rstrip()}\n{end}"
    old = path.read_text(encoding="utf-8") if path.exists() else "# Benchmark results\n"
    a, b = old.find(begin), old.find(end)
    if a < 0 or b < a:
        new = old.rstrip("\n") + f"\n\n{block}\n"
    else:
        new = old[:a] + block + old[b + len(end):]
    path.write_text(new, encoding="utf-8")
