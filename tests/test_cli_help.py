"""Help that guides (issue 21, item 8): options grouped, every option with help and its default,
two examples per subcommand that parse, one `auto|on|off` vocabulary for technique switches
(mapped to the planner's unchanged values; the old spellings still parse)."""

from __future__ import annotations

import argparse
import shlex

import pytest

from pipecc.cli.app import build_parser
from pipecc.errors import UsageError

PARSER = build_parser()
SUBCOMMANDS = next(a for a in PARSER._actions if isinstance(a, argparse._SubParsersAction)).choices


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_each_subcommand_ends_with_two_examples_that_parse(name: str) -> None:
    text = SUBCOMMANDS[name].format_help()
    examples = [line.strip() for line in text.split("examples:\n", 1)[1].splitlines()
                if line.startswith("  pipecc ")]
    assert len(examples) == 2, text[-600:]
    for line in examples:
        argv = shlex.split(line)[1:]
        assert argv[0] == name
        args = PARSER.parse_args(argv)  # a usage error would raise UsageError here
        assert args.command == name


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_every_option_has_help_and_says_its_default(name: str) -> None:
    p = SUBCOMMANDS[name]
    formatter = p._get_formatter()
    for action in p._actions:
        if action.help is argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{name} {action.option_strings or action.dest} has no help"
        if action.option_strings and not any(action.default is x for x in (None, False, True)):
            shown = formatter._get_help_string(action) % {"default": action.default}
            assert "default" in shown, f"{name} {action.option_strings}: {shown}"


@pytest.mark.parametrize("name", ["plan", "compile"])
def test_plan_options_are_grouped_basic_schedule_techniques_output(name: str) -> None:
    text = SUBCOMMANDS[name].format_help()
    heads = [text.index(f"\n{title}:\n") for title in
             ("basic", "schedule", "techniques (auto|on|off)", "output")]
    assert heads == sorted(heads), heads
    techniques = text[heads[2]:heads[3]]
    for option in ("--split-layers", "--recompute", "--activation-balancing", "--bipartition",
                   "--microbatch-sizes"):
        assert f"  {option} auto|" in techniques, option
    assert "--microbatches auto|M" in text[heads[1]:heads[2]] and "--schedule" in text[heads[1]:heads[2]]


def plan_args(*extra: str) -> argparse.Namespace:
    return PARSER.parse_args(["plan", "m.py", "-d", "cpu", *extra])


def test_one_vocabulary_maps_to_the_planner_s_values() -> None:
    defaults = plan_args()
    assert (defaults.recompute, defaults.microbatch_sizes, defaults.bipartition,
            defaults.activation_balancing, defaults.no_split_layers) == ("none", "equal", "off", "auto", False)
    assert [plan_args("--recompute", w).recompute for w in ("auto", "on", "off")] == ["auto", "full", "none"]
    assert plan_args("--microbatch-sizes", "off").microbatch_sizes == "equal"
    assert plan_args("--microbatch-sizes", "3,5").microbatch_sizes == [3, 5]
    assert [plan_args("--activation-balancing", w).activation_balancing for w in ("auto", "on", "off")] == \
        ["auto", "on", "off"]
    assert plan_args("--split-layers", "off").no_split_layers is True
    assert plan_args("--split-layers", "auto").no_split_layers is False


def test_old_spellings_still_parse() -> None:
    assert plan_args("--recompute", "full").recompute == "full"
    assert plan_args("--recompute", "none").recompute == "none"
    assert plan_args("--microbatch-sizes", "equal").microbatch_sizes == "equal"
    assert plan_args("--no-split-layers").no_split_layers is True


@pytest.mark.parametrize("argv, word", [(["--recompute", "always"], "always"), (["--bipartition", "on"], "on"),
                                        (["--split-layers", "on"], "on")])
def test_a_word_outside_the_vocabulary_is_a_usage_error(argv: list[str], word: str) -> None:
    with pytest.raises(UsageError, match=f"invalid choice: '{word}'"):
        plan_args(*argv)
