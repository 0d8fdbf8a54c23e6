"""The actor kernel: mailboxes and routing, actors and their instances, procs, the loop.

A proc owns actors; each actor instance reads its mailbox on the proc's event loop;
the router finds the proc of a destination and hands the envelope to a channel.
`runtime` is the process's one palatine loop (in the main thread of a role, in a
background thread of a user's script); `future` bridges it to plain threads; `comm` is
the cast tree every proc runs to fan a message out to a mesh.
"""
