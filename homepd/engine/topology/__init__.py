"""A mode as an object: each architecture is one module here behind the ``Topology`` protocol.

``topology_for(mode)`` builds it from the ``Mode`` enum (as vLLM builds its scheduling policy from an
enum).  The controller, the service, advise and the app ask it which workers to start, where a request
enters, what capacity it has, when a failed worker makes it unusable, what advise should measure and
which worker advise's recovery scenario kills.  A new mode is a ``Mode`` member, one module here and its
placement rule in ``homepd.hw.placement``.
"""
from homepd.engine.topology.base import Health, Topology, topology_for

__all__ = ["Health", "Topology", "topology_for"]
