"""`pipecc devices`: the device and link catalog, every figure with its source."""

from __future__ import annotations

import argparse
import json
from typing import Any
from pipecc.report.formatting import terminal_text


def add_parser(subparsers: Any, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = subparsers.add_parser("devices", parents=[common], help="list the device and link catalog",
                              description="The device and link catalog with every figure's source.")
    p.add_argument("--json", action="store_true", help="print the catalog as JSON")
    p.set_defaults(func=cmd_devices)
    return p


def cmd_devices(args: argparse.Namespace) -> int:
    from pipecc.targets import devices
    if args.json:
        print(json.dumps(devices.catalog_json(), indent=1))
    else:
        print(terminal_text(devices.format_catalog()))
    return 0
