"""pipecc plans handed to torch.distributed.pipelining (see `pipelining`)."""

from pipecc.interop.pipelining import *  # noqa: F401,F403
from pipecc.interop.pipelining import __all__  # noqa: F401
