"""A2A (protocol 1.0, as the ``a2a-sdk`` speaks it): every named agent served at
``/a2a/<agent>``, a task a turn and a context a session, tasks kept in JetStream.

The SDK's server side does the protocol: its JSON-RPC dispatcher and its request
handler (:class:`~a2a.server.request_handlers.DefaultRequestHandlerV2`). loopmesh gives
it what it asks for:

- :mod:`.routes`: the routes, behind the gateway's key, rate limit and size checks;
  :mod:`.card`, each agent's card;
- :mod:`.executor`, the SDK's agent executor: a message runs a turn and follows its
  events; :mod:`.messages`, what a message becomes (its session, the turn's input);
- :mod:`.projection`, the one translation of a turn's events into task updates;
- :mod:`.store`, the SDK's versioned task store over a KV bucket, which folds the
  turn's events into a task read after its gateway went away; :mod:`.events`, the SDK's
  cross-replica event stream, read from loopmesh's events stream;
- :mod:`.handler`, the SDK's handler with loopmesh's checks and a cancel that reaches
  any turn; :mod:`.push`, push-notification configurations and their delivery under
  the egress rule; :mod:`.caller`, who calls.

docs/AGENTS.md ("A2A") says how to use it, docs/ARCHITECTURE.md why it is built so.
"""

from .routes import A2A

__all__ = ["A2A"]
