"""pipecc.backends."""
