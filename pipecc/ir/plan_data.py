"""A technique's side data in a plan: typed in the technique's package, kept in plan.json's
"options" (where it was written before it had a type).

A technique whose planner step records more than plan fields (its search's record, the
per-chunk seconds a report rebuilds its timeline from) declares a type for each record in an
IR module of its package (`pipecc/techniques/<name>/data.py`) and names the types in its rule's
`DATA`. A type gives:

    KEY                         its key in plan.json's "options" (a class attribute)
    to_json() -> Any            its JSON value
    from_json(raw) -> cls       (a classmethod) the value read back; TypeError, ValueError or
                                KeyError when `raw` is not one

A plan holds one value per type (`Plan.data(kind)`, `Plan.with_data(value, ...)`, the field
`Plan.technique_data`, plan.json key -> value). plan.json writes every technique's values after
the planner's options and before those added after planning (`OPTIONS_AFTER_PLANNING`), in
`TECHNIQUES` order and each package's `DATA` order, so it stays byte-identical as the types
moved; reading it back, a value its type cannot write back as read (a hand-edited plan.json)
stays a plain option.
"""

from __future__ import annotations

import importlib
import json
from typing import Any

__all__ = ["OPTIONS_AFTER_PLANNING", "json_object", "kinds", "merge", "split"]

# options later steps add to the planner's (compile, the device count): plan.json keeps the
# techniques' data before them
OPTIONS_AFTER_PLANNING = ("devices_given", "lengths")
# NOTE: the rules (`pipecc.techniques`) import the plan, so the plan cannot import them: the types
# are looked up by that package's name (a plugin load, which tests/test_layering.py's cycle check
# does not see) when a plan is first written or read, once the plan is loaded; so a plan.json
# read is typed whatever else the process imported (tests/test_plan_data.py)
TECHNIQUES_PACKAGE = "pipecc.techniques"
_kinds: tuple[type, ...] | None = None


def kinds() -> tuple[type, ...]:
    """Every technique's data types: `TECHNIQUES` order, then each package's `DATA` order."""
    global _kinds
    if _kinds is None:
        techniques = importlib.import_module(TECHNIQUES_PACKAGE)
        _kinds = tuple(kind for technique in techniques.TECHNIQUES for kind in getattr(technique, "DATA", ()))
    return _kinds


def split(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """plan.json's options -> (the plain options, the techniques' typed values by key)."""
    options, typed = dict(options), {}
    for kind in kinds():
        raw = options.get(kind.KEY)
        try:
            value = kind.from_json(raw) if raw is not None else None
        except (TypeError, ValueError, KeyError):
            value = None
        # NOTE: a value the type cannot write back as it reads (a hand-edited plan.json) stays an option
        if value is not None and json.dumps(value.to_json()) == json.dumps(raw):
            typed[kind.KEY] = value
            del options[kind.KEY]
    return options, typed


def merge(options: dict[str, Any], typed: dict[str, Any]) -> dict[str, Any]:
    """`options` with the typed values' JSON where plan.json has always had them: in `kinds()`
    order, each before the first key added after planning or of a later kind left an option (a
    hand-edited value: `split`), else last."""
    order = {kind.KEY: i for i, kind in enumerate(kinds())}
    items = list(options.items())
    for key in sorted(typed, key=lambda k: order.get(k, len(order))):
        rank = order.get(key, len(order))
        at = next((i for i, (k, _) in enumerate(items)
                   if k in OPTIONS_AFTER_PLANNING or order.get(k, -1) > rank), len(items))
        items.insert(at, (key, typed[key].to_json()))
    return dict(items)


def json_object(raw: Any, kind: type) -> dict[str, Any]:
    """`raw` when it is a JSON object (a type's `from_json` reads its fields from it), else
    TypeError."""
    if not isinstance(raw, dict):
        raise TypeError(f"{kind.__name__} is a JSON object, not {type(raw).__name__}")
    return raw
