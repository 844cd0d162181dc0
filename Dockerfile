# One image for every loopmesh service; the command picks which:
#   loopmesh loop-worker | loopmesh tool-worker --pool default | loopmesh gateway
#   | loopmesh exporter | loopmesh webhooks
# Build: docker build -t loopmesh:dev .   (a pool with its own tools: see docs/KUBERNETES.md)
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# An unprivileged user with a fixed uid, so runAsNonRoot can check it (runAsUser: 10001).
RUN groupadd --system --gid 10001 loopmesh \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent loopmesh

WORKDIR /opt/loopmesh
COPY pyproject.toml README.md ./
COPY schemas ./schemas
COPY loopmesh ./loopmesh
COPY loop_worker ./loop_worker
COPY tool_worker ./tool_worker
COPY gateway ./gateway
COPY webhooks ./webhooks
COPY nats_agents ./nats_agents
# [otel]: OTLP trace export, used only when OTEL_EXPORTER_OTLP_ENDPOINT is set
RUN pip install --no-compile '.[otel]' && rm -rf /opt/loopmesh/*

USER 10001:10001
WORKDIR /tmp
ENTRYPOINT ["loopmesh"]
CMD ["--help"]
