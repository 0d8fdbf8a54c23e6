"""The typed messages between roles, with the invariants each carries.

`system` — to and from the SystemActor (joins, worlds, snapshots, supervision, stop);
`agent` — to a proc's agent (spawn actors and procs, stop, stacks); `controller` —
between the client and the controller (commands, results, failures); `worker` — the
commands a worker runs; `supervision` — liveness records and the texts that describe a
failure. Plain msgspec structs: no I/O, no actors.
"""
