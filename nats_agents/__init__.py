"""loopmesh's named agents on the NATS Agent Protocol (Synadia, protocol version 0.3).

Every agent in the agents bucket is registered as a protocol agent (a NATS micro service
named ``agents``), so that any NATS client finds it with ``Agents(nc=nc).discover()``
from ``synadia-ai-agents``; a prompt runs a turn of that agent through the turns stream and
streams the turn's reply back as the protocol's response chunks. ``service.py`` keeps
one :class:`~.host.AgentHost` per agent; ``request.py`` makes a turn of a prompt,
``reply.py`` makes response chunks and errors of the turn's events.
docs/AGENTS.md ("The NATS Agent Protocol") says how to reach an agent.
"""
