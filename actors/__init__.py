"""The Ray actors of raysync: each owns a process-level resource (the hub's registry,
later the transports' segments, agents and process groups). Imported by raysync only
when an actor is created, never at import time."""
