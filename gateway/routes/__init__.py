"""The gateway's routes, one module per resource. Each has a class of handlers over the
shared :class:`~gateway.core.Gateway` whose ``operations()`` lists its routes with their
OpenAPI entries; :func:`gateway.app.create_app` assembles them.

- :mod:`.sessions`: sessions and their turns (``/v1/sessions``, ``.../turns``);
- :mod:`.branches`: fork a session at a turn, rewind it to one;
- :mod:`.session_data`: a session's title and labels, and its erase (``PATCH``, ``DELETE``);
  :mod:`.audit`: the tenant's audit records (``/v1/audit``);
- :mod:`.events`: a session's live SSE stream and the tenant's latest events;
- :mod:`.controls`: cancel, pause and resume a turn; approve or deny a tool call;
- :mod:`.tools`: the tool catalog; :mod:`.agents`: the named agents;
- :mod:`.usage`: LLM usage per day; :mod:`.schedules`: ``/v1/schedules``;
- :mod:`.health`: ``/healthz``, ``/readyz``, ``/metrics``, ``/openapi.json``, ``/docs``.
"""
