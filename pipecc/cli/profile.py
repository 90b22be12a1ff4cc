"""`pipecc profile MODEL --devices SPEC`: measured per-node times and link figures.

Times every node forward and backward at micro-batch sizes 1, 2, 4, ..., B on the devices of
SPEC that this machine has, fits t(b) = a + c*b per node, measures the point-to-point link,
measures the fixed costs (per op call, micro-batch, step and message) with one rank per device
running at once (`pipecc.profile.fixed`; `--no-fixed-costs` skips them), and prints a table (or
`--json`); `-o FILE` writes the profile JSON. Profiles are cached
(`pipecc.profile.cache`); `--no-cache` times again. Nodes are timed with one intra-op thread
($OMP_NUM_THREADS when set), as each rank of `pipecc run` runs.

Several hosts: the same command on each, with `--nnodes N --node-rank R --rdzv-endpoint
HOST:PORT` (the names and checks of `pipecc run`; node 0 hosts the store at HOST:PORT). Node 0
measures its link to every other node in turn (`pipecc.profile.crosshost`), then times the
model as on one host and writes the profile with the cross-host links in `links`; node R > 0
times nothing, prints its link's one line (or its record with `--json`) and writes nothing,
even with `-o`. `--timeout S` bounds the rendezvous.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from pipecc.cli.args import (add_model_args, check_output_file, endpoint, model_stdout, nonnegative_int,
                             positive_float, positive_int, write_atomic)
# NOTE: `pipecc run`'s argument types, so both commands read the multi-node flags alike
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
    p.add_argument("-o", "--output", metavar="PROFILE_JSON",
                   help="write the profile JSON here (with --nnodes: node 0 only)")
    p.add_argument("--force", action="store_true",
                   help="-o: replace PROFILE_JSON even when pipecc did not write it (never the model file)")
    p.add_argument("--json", action="store_true", help="print the profile JSON")
    p.add_argument("--repeat", type=positive_int, default=5, metavar="N",
                   help="timed runs per node and size; the median is kept (default 5)")
    p.add_argument("--warmup", type=nonnegative_int, default=2, metavar="N",
                   help="untimed runs before them (default 2)")
    p.add_argument("--no-link", action="store_true", help="do not measure the link")
    p.add_argument("--no-cache", action="store_true", help="time again even if a profile is cached")
    p.add_argument("--no-fixed-costs", action="store_true",
                   help="do not measure the fixed costs (per op call, micro-batch, step and message, "
                   "one rank per device running at once; default: measured, the \"fixed_costs\" section)")
    g = p.add_argument_group("several hosts (run the same command on each)")
    g.add_argument("--nnodes", type=positive_int, default=1, metavar="N",
                   help="hosts in the cluster (default 1); node 0 also measures its link to "
                   "every other node, in turn")
    g.add_argument("--node-rank", type=nonnegative_int, metavar="R",
                   help="this host's index, 0 .. N-1; node 0 times the model and writes the profile")
    g.add_argument("--rdzv-endpoint", type=endpoint, metavar="HOST:PORT",
                   help="node 0's address and a free port on it")
    g.add_argument("--timeout", type=positive_float, default=60.0, metavar="S",
                   help="seconds to wait for the other hosts at the rendezvous (default 60)")
    p.set_defaults(func=cmd_profile)
    return p


def _rendezvous(args: argparse.Namespace) -> Any:
    """The Rendezvous of --nnodes N > 1, None for one host; usage errors as `pipecc run`'s."""
    from pipecc.profile import Rendezvous
    nnodes = args.nnodes
    if args.node_rank is not None and args.node_rank >= nnodes:
        raise UsageError(f"--node-rank {args.node_rank} is not below --nnodes {nnodes}")
    if nnodes == 1:
        return None
    if not args.rdzv_endpoint:
        raise UsageError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (node 0's address and a "
                         "free port there)")
    if args.node_rank is None:
        raise UsageError("--nnodes > 1 needs --node-rank R on each machine (0 on the host of "
                         "--rdzv-endpoint)")
    if args.no_link:
        raise UsageError(f"--no-link with --nnodes {nnodes}: the other hosts are there only to "
                         "measure the links; profile one host with --nnodes 1")
    return Rendezvous(args.rdzv_endpoint, nnodes, args.node_rank, args.timeout)


def cmd_profile(args: argparse.Namespace) -> int:
    from pipecc.profile import cross_host_side, summary_line

    rendezvous = _rendezvous(args)
    if rendezvous is not None and rendezvous.node_rank > 0:
        record = cross_host_side(args.devices, rendezvous)
        print(json.dumps(record, indent=1) if args.json else
              terminal_text(summary_line(record, rendezvous.node_rank)))
        return 0
    if args.output:
        parent = Path(args.output).parent
        if not parent.is_dir():  # fail before minutes of timing, not after
            raise PipeccError(f"-o {args.output}: directory {str(parent)!r} does not exist")
        check_output_file(args.output, "-o", [args.model], args.force)
    with model_stdout(args):  # a print in the model must not corrupt --json
        result = _profile(args, rendezvous)
    text = json.dumps(result.data, indent=1)
    if args.output:
        write_atomic(args.output, text + "\n", "-o", [args.model], args.force)
    if args.json:
        print(text)
    else:
        print(terminal_text(profile_table(result.data, cached=result.cache_hit)))
    return 0


def _profile(args: argparse.Namespace, rendezvous: Any) -> Any:
    from pipecc import driver
    from pipecc.frontend.modelfile import parse_model_args
    from pipecc.profile import profile_model
    return profile_model(args.model, args.devices, model_args=parse_model_args(args.model_arg),
                         batch_size=args.batch_size, warmup=args.warmup, repeat=args.repeat,
                         link=not args.no_link, use_cache=not args.no_cache,
                         symbols=driver.parse_symbols(args.symbol), debug=args.debug,
                         rendezvous=rendezvous, fixed_costs=not args.no_fixed_costs)


POOR_FIT = 0.25  # a node's fit error above this is flagged in the table


def profile_table(data: dict[str, Any], cached: bool = False) -> str:
    """Per target: each node's fitted forward and backward curve (its fit error explained, the
    poor ones flagged), and the link."""
    from pipecc.report.formatting import count, wrap
    lines = [f"profile of {data['model']['name']} at batch {data['batch_size']} (micro-batch "
             f"sizes {', '.join(map(str, data['microbatch_sizes']))})"
             + ("  [from the cache]" if cached else "")]
    for target in data["targets"]:
        lines.append(f"\n{target['torch_device']} ({target['hardware']}) for "
                     f"{', '.join(target['devices'])}")
        rows = [["node", "op", "fwd us = a + c*b", "bwd us = a + c*b", "fit err"]]
        poor = 0
        for n in target["nodes"]:
            f, b = n["fit"]["fwd"], n["fit"]["bwd"]
            flag = n["fit_error"] > POOR_FIT
            poor += flag
            rows.append([n["name"], n["op"], _curve(f), _curve(b),
                         f"{100 * n['fit_error']:.0f}%" + (" !" if flag else "")])
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines += wrap(f"fit err: the largest gap between a measured time and its line a + c*b, relative to the "
                      f"measured time (micro-batch sizes {', '.join(map(str, data['microbatch_sizes']))})"
                      + (f"; {poor} of {count(len(target['nodes']), 'node')} above {POOR_FIT:.0%} (marked !): "
                         "their times are noisy (a larger --repeat helps) or not linear in b, and plans "
                         "predict them that much less surely" if poor else ""), indent=4)
    links = data.get("links", [data["link"]] if data.get("link") else [])  # older: "link" only
    if links:
        lines.append("")
    for link in links:
        where = "" if link.get("scope", "in-host") == "in-host" else \
            f"cross-host, node {link['nodes'][0]} <-> node {link['nodes'][1]}, "
        lines.append(f"link ({link['backend']}, {where}{' <-> '.join(link['devices'])}): latency "
                     f"{link['latency_s'] * 1e6:.1f} us, bandwidth {link['bandwidth_Bps'] / 1e9:.3g} GB/s")
    for name, fc in (data.get("fixed_costs") or {}).items():  # older profiles: none
        lines.append(f"fixed costs on {name} ({fc['ranks']} rank(s) at once): op forward "
                     f"{fc['op_forward_s'] * 1e6:.2f} us, op backward {fc['op_backward_s'] * 1e6:.2f} us, "
                     f"micro-batch {fc['microbatch_s'] * 1e6:.1f} us, step {fc['step_s'] * 1e6:.1f} us, "
                     f"message {fc['message_s'] * 1e6:.1f} us")
    lines += [f"note: {n}" for n in data.get("notes", [])]
    return "\n".join(lines)


def _curve(fit: dict[str, float]) -> str:
    return f"{fit['a'] * 1e6:.2f} + {fit['c'] * 1e6:.3f}*b"
