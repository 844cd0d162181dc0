"""The HTTP gateway: sessions, turns, SSE event streams and controls over HTTP, for
people and programs that do not speak NATS (``loopmesh gateway``; docs/GATEWAY.md).

``app`` holds the handlers and their operation table (which also generates
``/openapi.json``), ``backend`` the NATS side, ``stream`` one SSE client's event
stream, ``auth`` keys and per-key limits, ``checks`` request checks, ``server`` the
running server and ``cli`` the command.
"""
