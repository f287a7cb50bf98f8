# berth's images, one build file with two final stages (--target):
#   serve   gateway and batcher: no torch, no onnxruntime (neither imports
#           them); `docker build --target serve -t berth .`
#   engine  the engine, with torch; CPU by default:
#           `docker build --target engine -t berth-engine:cpu .`
#           For NVIDIA GPUs, PyPI's default torch build (CUDA wheels):
#           `docker build --target engine --build-arg TORCH_SPEC=torch -t berth-engine:cuda .`
# Every version comes from constraints.txt (torch's too; the CUDA-only
# nvidia-* wheels are not pinned there); the build of berth takes its
# grpcio-tools from it as well (--build-constraint). Compilers stay in the
# build stage. Both final stages run as the user berth (10001) and carry the
# default models (built with torch in the engine's environment) in a layer
# of their own.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
# Debian's security updates replace a pinned version within days: the
# compiler is left unpinned, and it never reaches a final stage.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY constraints.txt ./
RUN pip install -c constraints.txt --upgrade pip setuptools
COPY pyproject.toml setup.py README.md ./
COPY protos protos
COPY services services
COPY batcher batcher
COPY engine engine
COPY gateway gateway
# The wheel: generated stubs and the compiled batcher core inside.
RUN pip wheel --no-deps -c constraints.txt --build-constraint constraints.txt \
    --wheel-dir /wheels .

# The engine's environment: torch and every dependency of berth.
FROM build AS engine-env
ARG TORCH_SPEC="torch --no-deps --index-url https://download.pytorch.org/whl/cpu"
RUN python -m venv /opt/venv
# TORCH_SPEC is a list of pip arguments: split on purpose.
RUN /opt/venv/bin/pip install -c constraints.txt --upgrade pip setuptools \
    && /opt/venv/bin/pip install -c constraints.txt ${TORCH_SPEC} \
    && /opt/venv/bin/pip install -c constraints.txt --build-constraint constraints.txt \
       /wheels/berth-*.whl

# The default models and their CPU fallbacks.
FROM engine-env AS models
RUN /opt/venv/bin/berth build-models --model-repository /models

# The gateway's and batcher's environment: what they import, no torch.
FROM build AS serve-env
RUN python -m venv /opt/venv \
    && /opt/venv/bin/pip install -c constraints.txt --upgrade pip setuptools \
    && /opt/venv/bin/pip install -c constraints.txt --build-constraint constraints.txt \
       --no-deps /wheels/berth-*.whl \
    && /opt/venv/bin/pip install -c constraints.txt numpy grpcio grpcio-health-checking \
       grpcio-reflection protobuf googleapis-common-protos tokenizers safetensors \
       opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp-proto-grpc \
       prometheus-client uvloop aiohttp

FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="berth" \
      org.opencontainers.image.description="gRPC inference serving for transformer encoders (BERT family): embeddings and classification" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.source="https://github.com/berth/berth" \
      org.opencontainers.image.base.name="docker.io/library/python:3.11-slim-bookworm"
RUN groupadd --gid 10001 berth \
    && useradd --uid 10001 --gid 10001 --home-dir /home/berth --create-home \
       --shell /usr/sbin/nologin berth \
    && install -d -o berth -g berth /home/berth/.cache
ENV PATH=/opt/venv/bin:$PATH HOME=/home/berth PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    BERTH_MODEL_REPOSITORY=/models BERTH_HOST=0.0.0.0 BERTH_METRICS_HOST=0.0.0.0
WORKDIR /home/berth

FROM runtime AS engine
LABEL org.opencontainers.image.title="berth-engine"
COPY --from=engine-env /opt/venv /opt/venv
COPY --from=models /models /models
USER 10001:10001
EXPOSE 50070 9466
# A GPU engine turns SERVING after its warm-up (a CUDA graph per batch
# shape, a first model export): minutes.
HEALTHCHECK --interval=10s --timeout=5s --start-period=30m --retries=3 \
    CMD ["python", "-m", "services.cli", "health", "--address", "127.0.0.1:50070"]
CMD ["python", "-m", "engine", "--port", "50070", "--metrics-port", "9466"]

# Last: a plain `docker build .` gives this one.
FROM runtime AS serve
COPY --from=serve-env /opt/venv /opt/venv
COPY --from=models /models /models
USER 10001:10001
EXPOSE 50051 8080 50060 9464 9465
# The gateway's port; a batcher container overrides it (docker-compose.yml).
HEALTHCHECK --interval=10s --timeout=5s --start-period=30m --retries=3 \
    CMD ["python", "-m", "services.cli", "health", "--address", "127.0.0.1:50051"]
CMD ["python", "-m", "gateway", "--port", "50051", "--metrics-port", "9464"]
