"""The system layer: registry of worlds, procs and hosts; supervision; eviction; stop.

Layering inside this package (20-system.md §1):

* `palatine.system.messages` — the typed messages of the SystemActor, its events, the
  notices to resolvers and the proc agent's messages;
* `palatine.system.worlds` — world records, host placement and request validation;
* `palatine.system.instructions` — what the sans-IO core asks its actor shell to do;
* `palatine.system.registry` — `SystemRegistry`, the sans-IO state machine: every
  stimulus in, ``(reply, instructions)`` out, clock injected;
* the SystemActor (a thin asyncio shell around the registry) sits on top.

Per-proc liveness records and failure texts live one layer down, in
`palatine.supervision`.
"""
