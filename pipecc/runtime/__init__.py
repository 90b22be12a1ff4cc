"""Runtimes that execute compiled pipecc stages: in one process (local) or one process per stage (dist)."""
