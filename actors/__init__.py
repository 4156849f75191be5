"""The Ray actors of raysync, installed as ``raysync.actors``: each owns a process-level
resource (the hub's registry; the transports' segments, agents and process groups).
This package imports the library; the library finds these classes by role through
entry points (:mod:`raysync.actor_classes`), never by importing them."""
