"""`pipecc profile MODEL --devices SPEC`: measured per-node times and link figures.

Times every node forward and backward at micro-batch sizes 1, 2, 4, ..., B on the devices of
SPEC that this machine has, fits t(b) = a + c*b per node, measures the point-to-point link,
and prints a table (or `--json`); `-o FILE` writes the profile JSON. Profiles are cached
(`pipecc.profile.cache`); `--no-cache` times again.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from pipecc.cli.args import add_model_args, positive_int, write_atomic
from pipecc.errors import PipeccError, UsageError
from pipecc.report.formatting import terminal_text


def add_parser(subparsers: Any, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "profile", parents=[common], help="time a model's nodes and the link on this machine",
        description="Time every node's forward and backward on the devices of SPEC present "
        "here (CPU; CUDA GPUs; FPGAs keep their analytic model) at micro-batch sizes 1, 2, 4, "
        "..., B, fit t(b) = a + c*b per node, and measure point-to-point latency and bandwidth.")
    add_model_args(p)
    p.add_argument("--devices", "-d", required=True, metavar="SPEC",
                   help="devices as for `pipecc plan`: cpu,cpu | 2xa100 | a100@cuda:1 | @cluster.toml")
    p.add_argument("-o", "--output", metavar="PROFILE_JSON", help="write the profile JSON here")
    p.add_argument("--json", action="store_true", help="print the profile JSON")
    p.add_argument("--repeat", type=positive_int, default=5, metavar="N",
                   help="timed runs per node and size; the median is kept (default 5)")
    p.add_argument("--warmup", type=_non_negative_int, default=2, metavar="N",
                   help="untimed runs before them (default 2)")
    p.add_argument("--no-link", action="store_true", help="do not measure the link")
    p.add_argument("--no-cache", action="store_true", help="time again even if a profile is cached")
    p.add_argument("--nnodes", type=positive_int, default=1, metavar="N",
                   help="hosts in the cluster (only 1 is supported yet)")
    p.set_defaults(func=cmd_profile)
    return p


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {value}")
    return value


def cmd_profile(args: argparse.Namespace) -> int:
    from pipecc import driver
    from pipecc.frontend.modelfile import parse_model_args
    from pipecc.profile import profile_model

    if args.nnodes > 1:
        raise UsageError(f"--nnodes {args.nnodes}: measuring links across hosts needs pipecc "
                         "profile launched on each host, which is not supported yet; profile "
                         "one host (--nnodes 1)")
    if args.output:
        parent = Path(args.output).parent
        if not parent.is_dir():  # fail before minutes of timing, not after
            raise PipeccError(f"-o {args.output}: directory {str(parent)!r} does not exist")
    result = profile_model(args.model, args.devices, model_args=parse_model_args(args.model_arg),
                           batch_size=args.batch_size, warmup=args.warmup, repeat=args.repeat,
                           link=not args.no_link, use_cache=not args.no_cache,
                           symbols=driver.parse_symbols(args.symbol), debug=args.debug)
    text = json.dumps(result.data, indent=1)
    if args.output:
        write_atomic(args.output, text + "\n")
    if args.json:
        print(text)
    else:
        print(terminal_text(profile_table(result.data, cached=result.cache_hit)))
    return 0


def profile_table(data: dict[str, Any], cached: bool = False) -> str:
    """Per target: each node's fitted forward and backward curve, and the link."""
    lines = [f"profile of {data['model']['name']} at batch {data['batch_size']} (micro-batch "
             f"sizes {', '.join(map(str, data['microbatch_sizes']))})"
             + ("  [from the cache]" if cached else "")]
    for target in data["targets"]:
        lines.append(f"\n{target['torch_device']} ({target['hardware']}) for "
                     f"{', '.join(target['devices'])}")
        rows = [["node", "op", "fwd us = a + c*b", "bwd us = a + c*b", "fit err"]]
        for n in target["nodes"]:
            f, b = n["fit"]["fwd"], n["fit"]["bwd"]
            rows.append([n["name"], n["op"], _curve(f), _curve(b), f"{100 * n['fit_error']:.0f}%"])
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    link = data.get("link")
    if link:
        lines.append(f"\nlink ({link['backend']}, {' <-> '.join(link['devices'])}): latency "
                     f"{link['latency_s'] * 1e6:.1f} us, bandwidth {link['bandwidth_Bps'] / 1e9:.3g} GB/s")
    lines += [f"note: {n}" for n in data.get("notes", [])]
    return "\n".join(lines)


def _curve(fit: dict[str, float]) -> str:
    return f"{fit['a'] * 1e6:.2f} + {fit['c'] * 1e6:.3f}*b"
