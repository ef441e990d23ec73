# syntax=docker/dockerfile:1
# The merge coordinator, CPU only (merges and evaluations run on the CPU). Build from the
# repository root:
#   docker build -f deploy/coordinator.Dockerfile -t skillswarm-coordinator .
# Run with a config whose work_dir is /data and whose http_host is 0.0.0.0:
#   docker run -d --init --name skillswarm-coordinator -p 8470:8470 -p 4001:4001 \
#     -v skillswarm-coordinator:/data \
#     -v "$PWD/deploy/configs/coordinator-qwen.toml:/etc/skillswarm/coordinator.toml:ro" \
#     -e SKILLSWARM_OPERATOR_TOKEN \
#     skillswarm-coordinator
# (-e SKILLSWARM_OPERATOR_TOKEN passes the operator API's token from your shell; without it that
# API stays off.)
# deploy/compose.yaml also runs the nodes of a laptop swarm from this image.

FROM python:3.11-slim-bookworm AS build
# fastecdsa (a libp2p dependency) and pycosat are built from source: a C compiler and GMP headers.
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential libgmp-dev \
 && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/skillswarm/venv
ENV PATH=/opt/skillswarm/venv/bin:$PATH
# The CPU build of torch first, then held there so no dependency pulls a CUDA build.
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
 && echo "torch==2.13.0" > /opt/skillswarm/torch-cpu.txt
WORKDIR /src
COPY pyproject.toml README.md ./
COPY protocol protocol
COPY agent agent
COPY node node
COPY merge merge
COPY coordinator coordinator
COPY skillswarm skillswarm
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --constraint /opt/skillswarm/torch-cpu.txt .

FROM python:3.11-slim-bookworm
RUN apt-get update \
 && apt-get install -y --no-install-recommends libgmp10 bubblewrap \
 && rm -rf /var/lib/apt/lists/*
RUN useradd --system --user-group --uid 10001 --home-dir /data --shell /usr/sbin/nologin skillswarm \
 && mkdir -p /data /etc/skillswarm \
 && chown skillswarm:skillswarm /data
COPY --from=build /opt/skillswarm/venv /opt/skillswarm/venv
ENV PATH=/opt/skillswarm/venv/bin:$PATH \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /data
VOLUME /data
# 8470: HTTP API and registry; 4001: libp2p (TCP).
EXPOSE 8470 4001
STOPSIGNAL SIGTERM
# The port is the config's http_port; the first start publishes the base checkpoint (the config's
# base_checkpoint; compose's bootstrap service builds the embedded one), hence the start period.
# bubblewrap is for the CPU nodes deploy/compose.yaml runs from this image (the code sandbox).
HEALTHCHECK --interval=15s --timeout=5s --start-period=180s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8470/healthz', timeout=4)"]
CMD ["skillswarm", "coordinator", "serve", "--config", "/etc/skillswarm/coordinator.toml"]
