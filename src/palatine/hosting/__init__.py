"""Procs as OS processes: the proc agent, the host that starts and watches workers.

`agent` is the actor every proc runs to join the system and obey it; `heartbeat` keeps
a proc's supervision updates flowing from a thread of its own; `host` is the agent of a
host proc, which starts a world's procs (`children`, `child_env`; forked
from a pre-imported `forkserver`), reports each exit at once and dumps stacks
(`stacks`). `limits` checks a job's open-files budget before anything starts.
"""
