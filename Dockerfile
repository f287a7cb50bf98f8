# One image for every berth service; the command picks the role.
# CPU by default; for GPUs build with --build-arg TORCH_SPEC='torch>=2.11'
# (PyPI's default build, with its CUDA wheels).
# Every version comes from constraints.txt (torch's too); the build of berth
# takes its grpcio-tools from it as well (--build-constraint).
FROM python:3.11-slim

# The CPU build from PyTorch's index, without its dependencies: those come
# from PyPI, pinned, with berth's below.
ARG TORCH_SPEC="torch --no-deps --index-url https://download.pytorch.org/whl/cpu"
WORKDIR /opt/berth
RUN apt-get update && apt-get install -y --no-install-recommends gcc && rm -rf /var/lib/apt/lists/*
COPY constraints.txt ./
RUN pip install --no-cache-dir -c constraints.txt --upgrade pip setuptools
RUN pip install --no-cache-dir -c constraints.txt ${TORCH_SPEC}
COPY pyproject.toml setup.py README.md ./
COPY protos protos
COPY services services
COPY batcher batcher
COPY engine engine
COPY gateway gateway
RUN pip install --no-cache-dir -c constraints.txt --build-constraint constraints.txt . \
    && berth build-models --model-repository /models
ENV BERTH_MODEL_REPOSITORY=/models BERTH_HOST=0.0.0.0 BERTH_METRICS_HOST=0.0.0.0 PYTHONUNBUFFERED=1
EXPOSE 50051 50060 50070
CMD ["python", "-m", "gateway"]
