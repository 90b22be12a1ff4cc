"""pipecc: a pipeline-parallel compiler for deep-learning models."""

__version__ = "0.1.0"
