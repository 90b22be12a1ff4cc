"""`python -m pipecc.cli ...` is the `pipecc` command."""

import sys

from pipecc.cli.app import main

sys.exit(main())
