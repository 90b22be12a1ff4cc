"""A technique's command-line switches, as data its package declares (``OPTIONS``) and
`pipecc.cli.args` adds to the plan commands' "techniques" group: one table, so adding a
technique adds its switch where the technique lives.

Every switch reads ``auto|on|off`` (one with nothing to force offers ``auto|off``): `words` maps
each CLI word to the value the planner has always taken (``recompute="full"``,
``microbatch_sizes="equal"``, ...), so plan.json, the Python API and the planner are unchanged;
`old` keeps the old spellings (the planner's own values, which plan.json's ``options`` and the
Python API still use) working. A switch that also takes free text (UMPIPE's sizes) has `parse`,
which raises ValueError with the message the user sees.

The same table makes the switch's field of `passes.plan_options.PlanOptions` (the Python API's
options): its `type`, its default there (`api_default`, where the Python API's differs from the
command line's `default`) and the values it accepts (`choices`, in the order its one-line error
names them; none: any value, as `parse` or the planner checks it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

__all__ = ["Option", "SAME", "Setting"]


class _Same:
    def __repr__(self) -> str:
        return "SAME"


SAME: Any = _Same()  # `Option.api_default`: the Python API's default is the command line's


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
    type: Any = str                    # the field's type in `PlanOptions`
    api_default: Any = SAME            # the field's default in `PlanOptions` (SAME: `default`)
    choices: tuple[str, ...] = ()      # the values `PlanOptions` accepts (none: any)

    @property
    def planner_default(self) -> Any:
        """The field's default in `PlanOptions` (the Python API's)."""
        return self.default if self.api_default is SAME else self.api_default

    def problem(self, value: Any) -> str | None:
        """Why `value` is not one of `choices` (one line naming the flag and the choices), or None."""
        if not self.choices or value in self.choices:
            return None
        return f"{self.flag} {value!r}: choose {', '.join(self.choices[:-1])} or {self.choices[-1]}"

    def value(self, text: str) -> Any:
        """The planner's value of the CLI text `text`; ValueError names the choices."""
        if text in self.words:
            return self.words[text]
        if text in self.old:
            return self.old[text]
        if self.parse is not None:
            return self.parse(text)
        raise ValueError(f"invalid choice: {text!r} (choose from {', '.join(self.words)})")


@dataclass(frozen=True)
class Setting:
    """A technique's planner field without a command-line switch (the Python API's keyword
    only), as its package declares it (``SETTINGS``): a field of `passes.plan_options.PlanOptions`."""
    dest: str                          # "umpipe_budget_s"
    type: Any
    default: Any
    help: str
