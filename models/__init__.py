"""pipecc.models."""
