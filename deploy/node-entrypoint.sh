#!/bin/sh
# The GPU node image's entry point. A node in this image plays its rollouts with vLLM on a CUDA
# GPU, so `skillswarm node run` stops at once, saying why, when the container sees no GPU; any
# other command runs as given.
set -eu
if [ "${1:-}" = skillswarm ] && [ "${2:-}" = node ] && [ "${3:-}" = run ]; then
  status=0
  python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)' || status=$?
  if [ "$status" = 3 ]; then
    echo "skillswarm node: no GPU is visible in this container, and this image's node runs" \
      "vLLM on a CUDA GPU. Start it with --gpus all (the NVIDIA Container Toolkit on the host," \
      "driver 580 or newer). To train on a CPU, run the CPU image (deploy/coordinator.Dockerfile)" \
      "with a node config whose [inference] backend is \"hf\"." >&2
    exit 1
  elif [ "$status" != 0 ]; then
    echo "skillswarm node: could not check for a GPU (python3 -c 'import torch' exited $status)" >&2
    exit 1
  fi
fi
exec "$@"
