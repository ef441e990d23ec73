# syntax=docker/dockerfile:1
# A training node for a CUDA GPU box: the project with the `gpu` extra (vLLM rollouts). Build from
# the repository root:
#   docker build -f deploy/node.Dockerfile -t skillswarm-node .
# Run (NVIDIA Container Toolkit on the host; the torch and vLLM wheels are CUDA 13 builds, so the
# driver must be 580 or newer), with a config whose work_dir is /var/lib/skillswarm. The code
# domain's sandbox (bubblewrap) creates user namespaces, which Docker's default seccomp profile
# refuses: allow them (or run under gVisor, --runtime=runsc; see docs/security.md):
#   docker run -d --init --gpus all --name skillswarm-node \
#     --security-opt seccomp=unconfined --security-opt apparmor=unconfined \
#     -v skillswarm-node:/var/lib/skillswarm \
#     -v "$PWD/deploy/configs/node-gpu.toml:/etc/skillswarm/node.toml:ro" \
#     skillswarm-node
# The node only dials out (HTTP to the coordinator, libp2p to its peer): no port to publish.

FROM nvidia/cuda:13.0.1-runtime-ubuntu24.04
# The compiler and Python headers stay in the image: fastecdsa (a libp2p dependency) builds from
# source, and Triton, under vLLM, compiles small launchers with them at run time.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      python3 python3-venv python3-dev build-essential libgmp-dev bubblewrap \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/skillswarm/venv
ENV PATH=/opt/skillswarm/venv/bin:$PATH \
    PYTHONUNBUFFERED=1
WORKDIR /opt/skillswarm/src
COPY pyproject.toml README.md ./
COPY protocol protocol
COPY agent agent
COPY node node
COPY merge merge
COPY coordinator coordinator
COPY skillswarm skillswarm
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install '.[gpu]'
# HOME is the work dir, so the caches of Hugging Face, vLLM and Triton land on the volume.
RUN useradd --system --user-group --uid 10001 --home-dir /var/lib/skillswarm \
      --shell /usr/sbin/nologin skillswarm \
 && mkdir -p /var/lib/skillswarm /etc/skillswarm \
 && chown skillswarm:skillswarm /var/lib/skillswarm
USER 10001:10001
WORKDIR /var/lib/skillswarm
VOLUME /var/lib/skillswarm
# On SIGTERM the node stops once the training in progress ends: `docker stop -t 900`.
STOPSIGNAL SIGTERM
# The entry point refuses to start a node where no GPU is visible (a `docker run` without
# --gpus), saying so, instead of failing later inside vLLM; other commands run as given.
COPY --chmod=0755 deploy/node-entrypoint.sh /usr/local/bin/skillswarm-node-entrypoint
ENTRYPOINT ["skillswarm-node-entrypoint"]
CMD ["skillswarm", "node", "run", "--config", "/etc/skillswarm/node.toml"]
