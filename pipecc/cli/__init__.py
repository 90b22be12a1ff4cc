"""The `pipecc` command line, one module per subcommand (see `app.py` for the parser).

    pipecc cost | plan | compile | devices | run | inspect | csim
"""

from pipecc.cli.app import build_parser, main

__all__ = ["build_parser", "main"]
