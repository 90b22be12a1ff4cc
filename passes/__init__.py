"""pipecc.passes."""
