"""The system layer: registry of worlds, procs and hosts; supervision; eviction; stop.

Layering inside this package, bottom up:

* `palatine.protocol.system` — typed messages of the SystemActor, its subscription
  events and the notices to resolvers; `palatine.protocol.agent` — the proc
  agent's messages;
* `palatine.system.worlds` — world records, host placement and request validation;
* `palatine.system.instructions` — what the sans-IO core asks its actor shell to do;
* `palatine.system.registry` — `SystemRegistry`, the whole sans-IO state machine
  (every stimulus in, ``(reply, instructions)`` out, clock injected): its tables,
  failure detection, stop and eviction, joins, worlds and queries;
* `palatine.system.actor` — the SystemActor, a thin asyncio shell around the registry.

Per-proc liveness records and failure texts live one layer down, in
`palatine.protocol.supervision`.
"""
