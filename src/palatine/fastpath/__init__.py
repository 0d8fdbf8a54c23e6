"""The only code that bypasses the event loop: lanes and direct sessions.

A plain thread that blocks on a call (``call_one(...).get()``, a client's fetch) talks
to the destination proc on a connection of its own (a *lane*, `lane`), and a worker or
a client writes to a local controller on a *direct session* (`direct_tx`): both are
ordinary channel sessions (same frames, sequence numbers and acks) whose writes happen
on the calling thread, so a round trip costs no thread hand-off. `blocking` is the
blocking socket side they share. Meshes reach this package through `lane.try_call`
(which answers None when a call must take the loop) and the engine through
`direct_tx.open_direct`; ``PALATINE_LANES=0`` sends everything through the loop
instead, with the same results.
"""
