# One image for every berth service; the command picks the role.
# CPU by default; for GPUs build with --build-arg TORCH_SPEC='torch>=2.11'.
FROM python:3.11-slim

ARG TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
WORKDIR /opt/berth
RUN apt-get update && apt-get install -y --no-install-recommends gcc && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir ${TORCH_SPEC}
COPY pyproject.toml setup.py README.md ./
COPY protos protos
COPY services services
COPY batcher batcher
COPY engine engine
COPY gateway gateway
RUN pip install --no-cache-dir . && berth build-models --model-repository /models
ENV BERTH_MODEL_REPOSITORY=/models BERTH_HOST=0.0.0.0 BERTH_METRICS_HOST=0.0.0.0 PYTHONUNBUFFERED=1
EXPOSE 50051 50060 50070
CMD ["python", "-m", "gateway"]
