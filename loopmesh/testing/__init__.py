"""What tests and benches share to run loopmesh for real, with nothing faked but the
model: a fake OpenAI-compatible server (``fake_llm``, its scripted replies in
``fake_replies`` and their streaming in ``fake_stream``) and the durable mesh's helpers
(``durable``: short-lived JetStream set-ups, stored events, services as processes), and
an OTLP/HTTP traces receiver (``otlp``, which needs the ``otel`` extra's protobuf types).

It imports ``schemas`` and ``loopmesh`` only: services are started as subprocesses by
module name. ``python -m loopmesh.testing.fake_llm --port N`` serves the fake model.
"""
