# One image for every service: `python -m services.receiver` (the default command),
# `services.coalescer`, `services.responder`, and `shared.migrate` for the one-shot
# migration. Build: docker build -t chatqueue:0.1.0 .
# No `# syntax=` line: the classic builder and BuildKit both build this file as it is,
# with no frontend image to pull (a registry-less build, tests/containers/run.sh).
#
# The base is pinned by version; pin it by digest too in your registry mirror
# (python:3.11.10-slim-bookworm@sha256:...) once you have pulled it.
ARG PYTHON_IMAGE=python:3.11.10-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m venv /opt/chatq
# Dependencies first, pinned by constraints.txt, so code and README changes reuse this
# layer (the package's metadata needs a README file, not its text).
COPY pyproject.toml constraints.txt ./
RUN mkdir -p shared services && touch README.md shared/__init__.py services/__init__.py \
 && /opt/chatq/bin/pip install -c constraints.txt . \
 && /opt/chatq/bin/pip uninstall -y chatqueue
COPY README.md ./
COPY shared ./shared
COPY services ./services
COPY platforms ./platforms
COPY chatq ./chatq
COPY stores ./stores
RUN /opt/chatq/bin/pip install --no-deps -c constraints.txt . \
 && /opt/chatq/bin/python -m compileall -q /opt/chatq/lib

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="chatqueue" \
      org.opencontainers.image.description="Durable, coalescing, exactly-one-reply pipeline between chat platforms and a bot"
RUN groupadd --system --gid 10001 chatq \
 && useradd --system --uid 10001 --gid chatq --no-create-home --home-dir /nonexistent chatq
COPY --from=build /opt/chatq /opt/chatq
ENV PATH=/opt/chatq/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    CHATQ_HTTP_HOST=0.0.0.0
WORKDIR /app
USER 10001:10001
# 8080: receiver webhooks (and everything, without CHATQ_ADMIN_PORT); 8081: the receiver's
# admin API, /ops, /metrics with CHATQ_ADMIN_PORT=8081; 9100: /healthz /readyz /metrics
# of the workers.
EXPOSE 8080 8081 9100
# The services drain on SIGTERM (stop consuming, finish and ack in-flight work, close)
# within CHATQ_SHUTDOWN_GRACE_SECONDS; give the container at least that plus a margin.
STOPSIGNAL SIGTERM
ENTRYPOINT ["python", "-m"]
CMD ["services.receiver"]
