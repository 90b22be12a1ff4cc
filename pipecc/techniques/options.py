"""A technique's command-line switches, as data its package declares (``OPTIONS``) and
`pipecc.cli.args` adds to the plan commands' "techniques" group: one table, so adding a
technique adds its switch where the technique lives.

Every switch reads ``auto|on|off`` (one with nothing to force offers ``auto|off``): `words` maps
each CLI word to the value the planner has always taken (``recompute="full"``,
``microbatch_sizes="equal"``, ...), so plan.json, the Python API and the planner are unchanged;
`old` keeps the old spellings (the planner's own values, which plan.json's ``options`` and the
Python API still use) working. A switch that also takes free text (UMPIPE's sizes) has `parse`,
which raises ValueError with the message the user sees.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

__all__ = ["Option"]


@dataclass(frozen=True)
class Option:
    flag: str                          # "--recompute"
    dest: str                          # the planner's field (`passes.plan_options.PlanOptions`)
    default: Any                       # the planner's value when the flag is not given
    metavar: str                       # "auto|on|off"
    help: str
    words: Mapping[str, str] = field(default_factory=dict)   # CLI word -> the planner's value
    old: Mapping[str, str] = field(default_factory=dict)     # old spellings, still accepted
    parse: Callable[[str], Any] | None = None                # free text -> value (ValueError: refused)

    def value(self, text: str) -> Any:
        """The planner's value of the CLI text `text`; ValueError names the choices."""
        if text in self.words:
            return self.words[text]
        if text in self.old:
            return self.old[text]
        if self.parse is not None:
            return self.parse(text)
        raise ValueError(f"invalid choice: {text!r} (choose from {', '.join(self.words)})")
