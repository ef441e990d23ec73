# The merge coordinator: CPU only. Build from the repository root:
#   docker build -f deploy/coordinator.Dockerfile -t skillswarm-coordinator .
FROM python:3.11-slim
WORKDIR /opt/skillswarm
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY protocol protocol
COPY node node
COPY merge merge
COPY coordinator coordinator
COPY skillswarm skillswarm
RUN pip install --no-cache-dir .
VOLUME /data
EXPOSE 8470 4001
CMD ["skillswarm", "coordinator", "serve", "--config", "/data/coordinator.toml"]
