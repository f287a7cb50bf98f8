"""KServe v2 (Open Inference Protocol) gRPC service over the gateway.

Stock Triton clients (``tritonclient.grpc``) call every berth model with one
tensor contract:

- input ``TEXT``: BYTES, shape [N], one UTF-8 text per element;
- embed models output ``EMBEDDING``: FP32 [N, D];
- classify models output ``PROBABILITIES``: FP32 [N, C] and ``LABEL``:
  BYTES [N], the best label per text.

Inputs may come as ``raw_input_contents`` or typed ``bytes_contents``.
Outputs go out as ``raw_output_contents`` (what Triton does and what
tritonclient reads), or typed contents when the request sets the parameter
``binary_data_output`` (or every requested output's ``binary_data``) to
false. Request parameters ``truncate`` and ``normalize`` map onto berth's
options. Requests share the gateway's admission bound and response cache,
and count in its Prometheus request metrics (api ``kserve`` for ModelInfer,
``kserve_stream`` for ModelStreamInfer; outcomes and stage times as for
berth's own API). ModelStatistics reports the model's statistics
(gateway/metrics.py ``model_stats``), shared with berth's own API: as in
Triton, they are meant to count every inference of the model, whatever API
it came by.

The classification extension works as in Triton: a requested FP32 output
with the parameter ``classification`` = k (tritonclient's ``class_count``)
comes back as BYTES [N, min(k, width)], each row's k highest entries as
"score:index:label" (no label part for EMBEDDING, which has none).
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from importlib import metadata

import grpc
import numpy as np

from gateway import metrics
from gateway.metrics import ModelStats
from gateway.service import TRACER, Gateway, Model
from services.errors import (
    BerthError,
    InvalidInput,
    UnknownModel,
    abort,
    as_berth_error,
)
from services.proto.berth.v1 import berth_pb2
from services.proto.inference import grpc_service_pb2 as pb
from services.proto.inference import grpc_service_pb2_grpc as pb_grpc
from services.server import ServiceServer
from services.streams import serve_stream
from services.telemetry import record_error, server_span

log = logging.getLogger("berth.gateway")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
VERSION = "1"  # every berth model has exactly one version
TEXT, EMBEDDING, PROBABILITIES, LABEL = "TEXT", "EMBEDDING", "PROBABILITIES", "LABEL"
EXTENSIONS = [
    "classification",
    "model_configuration",
    "statistics",
    "binary_tensor_data",
    "parameters",
]
# Request parameters tritonclient may set that change nothing here.
IGNORED_PARAMETERS = {"priority"}
CONTRACT = "TEXT (BYTES, shape [N], one text per element)"


def outputs_of(model: Model) -> list[tuple[str, str, list[int]]]:
    """(name, datatype, shape) of each output; -1 is the number of texts."""
    if model.entry.task == "embed":
        return [(EMBEDDING, "FP32", [-1, model.dimension])]
    return [(PROBABILITIES, "FP32", [-1, len(model.labels)]), (LABEL, "BYTES", [-1])]


def decode_texts(request: pb.ModelInferRequest) -> list[str]:
    """The texts of the TEXT input, raw or typed; raises InvalidInput."""
    if len(request.inputs) != 1 or request.inputs[0].name != TEXT:
        names = ", ".join(repr(i.name) for i in request.inputs) or "none"
        raise InvalidInput(
            f"model {request.model_name!r} takes exactly one input, {CONTRACT}; "
            f"got inputs {names}"
        )
    tensor = request.inputs[0]
    if tensor.datatype != "BYTES":
        raise InvalidInput(f"input TEXT has datatype {tensor.datatype!r}: use BYTES")
    if len(tensor.shape) != 1:
        raise InvalidInput(
            f"input TEXT has shape {list(tensor.shape)}: use [N], one text per element"
        )
    n = tensor.shape[0]
    if request.raw_input_contents:
        if len(request.raw_input_contents) != 1 or tensor.HasField("contents"):
            raise InvalidInput(
                "send TEXT either as one raw_input_contents entry or as "
                "contents.bytes_contents, not both"
            )
        items = split_bytes(request.raw_input_contents[0])
    else:
        items = list(tensor.contents.bytes_contents)
    if len(items) != n:
        raise InvalidInput(f"input TEXT has shape [{n}] but holds {len(items)} texts")
    texts = []
    for i, item in enumerate(items):
        try:
            texts.append(item.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise InvalidInput(f"TEXT[{i}] is not UTF-8: {exc.reason}") from None
    return texts


def split_bytes(raw: bytes) -> list[bytes]:
    """A raw BYTES tensor: each element a 4-byte little-endian length, then it."""
    items: list[bytes] = []
    offset = 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise InvalidInput(
                f"raw TEXT contents end inside a length prefix at byte {offset}"
            )
        (size,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + size > len(raw):
            raise InvalidInput(
                f"raw TEXT element {len(items)} claims {size} bytes, only "
                f"{len(raw) - offset} remain"
            )
        items.append(raw[offset : offset + size])
        offset += size
    return items


def join_bytes(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(b)) + b for b in items)


def class_count(output: str, datatype: str, value: pb.InferParameter) -> int:
    """The k of an output's ``classification`` parameter, refused where Triton
    refuses it (src/grpc/grpc_utils.cc, src/classification.cc); raises
    InvalidInput."""
    kind = value.WhichOneof("parameter_choice")
    if kind != "int64_param":
        got = f"{kind} {getattr(value, kind)!r}" if kind else "nothing"
        raise InvalidInput(
            f"output {output!r}: parameter 'classification' must be an "
            f"int64_param class count, got {got}"
        )
    if value.int64_param <= 0:
        raise InvalidInput(
            f"output {output!r}: classification {value.int64_param} asks for no "
            "classes; give a class count of at least 1"
        )
    if datatype == "BYTES":
        raise InvalidInput(
            f"output {output!r}: class result not available for output due to "
            f"unsupported type 'BYTES'; ask for classification on {PROBABILITIES}"
        )
    return value.int64_param


def top_classes(values: np.ndarray, k: int, labels: list[str]) -> list[bytes]:
    """Each row's k highest entries, best first, as Triton writes them
    (server src/classification.cc): "score:index:label", the score as C's
    ``%f`` (std::to_string), no label part where the index has none. Ties go
    by index, where Triton's std::sort leaves them in no set order."""
    order = np.argsort(-values, axis=1, kind="stable")[:, :k]
    items = []
    for row, indices in zip(values, order, strict=True):
        for i in indices:
            item = f"{float(row[i]):f}:{i}"
            label = labels[i] if i < len(labels) else ""
            items.append((f"{item}:{label}" if label else item).encode())
    return items


def flag(name: str, value: pb.InferParameter) -> bool:
    """A boolean parameter: bool_param, or the strings 'true'/'false'."""
    kind = value.WhichOneof("parameter_choice")
    if kind == "bool_param":
        return value.bool_param
    if kind == "string_param" and value.string_param.lower() in ("true", "false"):
        return value.string_param.lower() == "true"
    raise InvalidInput(f"parameter {name!r} must be a bool, got {kind or 'nothing'}")


@dataclass
class Call:
    """What one ModelInfer request asks for, validated."""

    options: berth_pb2.Options
    outputs: list[tuple[str, str, list[int]]]
    binary: bool
    timeout_s: float | None
    classes: dict[str, int]  # output name -> k of its top-k classification


def parse_call(
    request: pb.ModelInferRequest, model: Model, timeout_s: float | None
) -> Call:
    """Parameters and requested outputs of a request; raises InvalidInput."""
    options = berth_pb2.Options()
    binary = True
    for name, value in request.parameters.items():
        if name == "truncate":
            options.truncate = flag(name, value)
        elif name == "normalize" and model.entry.task == "embed":
            options.normalize = flag(name, value)
        elif name == "binary_data_output":
            binary = flag(name, value)
        elif name == "timeout":  # tritonclient's, in microseconds
            if value.WhichOneof("parameter_choice") != "int64_param":
                raise InvalidInput("parameter 'timeout' must be int64 microseconds")
            if value.int64_param > 0:  # 0 is Triton's "no timeout"
                limit_s = value.int64_param / 1e6
                timeout_s = limit_s if timeout_s is None else min(timeout_s, limit_s)
        elif name not in IGNORED_PARAMETERS:
            known = "truncate" + (", normalize" if model.entry.task == "embed" else "")
            raise InvalidInput(
                f"parameter {name!r} is not understood by {model.entry.task} model "
                f"{model.entry.name!r}; it takes {known}, binary_data_output"
            )
    available = {o[0]: o for o in outputs_of(model)}
    outputs, per_output, classes = [], set(), {}
    for wanted in request.outputs:
        if wanted.name not in available:
            raise InvalidInput(
                f"model {model.entry.name!r} has no output {wanted.name!r}; "
                f"its outputs are {', '.join(available)}"
            )
        output = available[wanted.name]
        for key, value in wanted.parameters.items():
            if key == "binary_data":
                per_output.add(flag(key, value))
            elif key == "classification":
                classes[wanted.name] = class_count(wanted.name, output[1], value)
            else:
                raise InvalidInput(
                    f"output parameter {key!r} is not supported; use binary_data "
                    "or classification"
                )
        outputs.append(output)
    if len(per_output) > 1:
        raise InvalidInput(
            "set binary_data the same on every requested output: raw and typed "
            "outputs cannot be mixed in one response"
        )
    binary = per_output.pop() if per_output else binary
    return Call(
        options, outputs or list(available.values()), binary, timeout_s, classes
    )


def shape_outputs(
    request: pb.ModelInferRequest, model: Model, rows: np.ndarray, call: Call
) -> pb.ModelInferResponse:
    """The response tensors of one call, raw or typed as the call asked."""
    response = pb.ModelInferResponse(
        model_name=model.entry.name, model_version=VERSION, id=request.id
    )
    n = len(rows)
    for name, datatype, shape in call.outputs:
        if name == LABEL:
            labels = [model.labels[i].encode() for i in np.argmax(rows, axis=1)]
            add_bytes(response, name, [n], labels, call.binary)
            continue
        values = rows
        if name == EMBEDDING:
            normalize = (
                call.options.normalize
                if call.options.HasField("normalize")
                else model.entry.normalize
            )
            if normalize:
                norms = np.linalg.norm(rows, axis=1, keepdims=True)
                values = rows / np.maximum(norms, 1e-12)
        values = np.ascontiguousarray(values, dtype="<f4")
        if name in call.classes:  # ranks the FP32 values the output would carry
            k = min(call.classes[name], values.shape[1])
            labels = model.labels if name == PROBABILITIES else []
            items = top_classes(values, k, labels)
            add_bytes(response, name, [n, k], items, call.binary)
            continue
        tensor = response.outputs.add(
            name=name, datatype=datatype, shape=[n, *shape[1:]]
        )
        if call.binary:
            response.raw_output_contents.append(values.tobytes())
        else:
            tensor.contents.fp32_contents.extend(values.ravel().tolist())
    return response


def add_bytes(
    response: pb.ModelInferResponse,
    name: str,
    shape: list[int],
    items: list[bytes],
    binary: bool,
) -> None:
    """A BYTES output: length-prefixed in raw_output_contents, or typed."""
    tensor = response.outputs.add(name=name, datatype="BYTES", shape=shape)
    if binary:
        response.raw_output_contents.append(join_bytes(items))
    else:
        tensor.contents.bytes_contents.extend(items)


def duration(count: int, ns: int) -> pb.StatisticDuration:
    return pb.StatisticDuration(count=count, ns=ns)


def statistics_of(name: str, stats: ModelStats, cached: bool) -> pb.ModelStatistics:
    """A model's statistics as ModelStatistics reports them; the cache
    durations only where the response cache is on."""
    infer_stats = pb.InferStatistics(
        success=duration(stats.success, stats.success_ns),
        fail=duration(stats.fail, stats.fail_ns),
        queue=duration(stats.success, stats.queue_ns),  # a cache hit queues 0 ns
        compute_input=duration(stats.executions, stats.input_ns),
        compute_infer=duration(stats.executions, stats.infer_ns),
        compute_output=duration(stats.executions, stats.output_ns),
    )
    if cached:
        infer_stats.cache_hit.CopyFrom(duration(stats.cache_hits, stats.cache_hit_ns))
        infer_stats.cache_miss.CopyFrom(
            duration(stats.cache_misses, stats.cache_miss_ns)
        )
    return pb.ModelStatistics(
        name=name,
        version=VERSION,
        last_inference=stats.last_ms,
        inference_count=stats.texts,
        execution_count=stats.executions,
        inference_stats=infer_stats,
    )


class KServe:
    """The KServe v2 request path over a Gateway, without gRPC."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    def model(self, name: str, version: str) -> Model:
        model = self.gateway.models.get(name)
        if model is None:
            raise UnknownModel(
                f"unknown model {name!r}; this gateway serves "
                f"{', '.join(sorted(self.gateway.models))}"
            )
        if version not in ("", VERSION):
            raise UnknownModel(
                f"model {name!r} has no version {version!r}; its only version is "
                f"{VERSION} (or leave model_version empty)"
            )
        return model

    async def ready(self, name: str | None = None) -> bool:
        """Whether the batcher has a healthy engine for the model (or all)."""
        if not self.gateway.batcher.ready.is_set():
            return False
        try:
            models = await self.gateway.batcher.models()
        except Exception:  # any failure to ask means not ready
            return False
        healthy = {m.name: m.healthy_engines > 0 for m in models.models}
        wanted = [name] if name is not None else list(self.gateway.models)
        return all(healthy.get(n, False) for n in wanted)

    async def infer(
        self, request: pb.ModelInferRequest, timeout_s: float | None, api: str
    ) -> pb.ModelInferResponse:
        """One request, counted in the gateway's request metrics as berth's
        own calls are (``api``: kserve for ModelInfer, kserve_stream for
        ModelStreamInfer) and in its model's statistics."""
        name = request.model_name
        label = name if name in self.gateway.models else "unknown"
        with metrics.Tally(label, api) as tally:
            response, timings, degraded = await self._infer(request, timeout_s)
            tally.answered(timings, degraded)
        return response

    async def _infer(
        self, request: pb.ModelInferRequest, timeout_s: float | None
    ) -> tuple[pb.ModelInferResponse, berth_pb2.Timings, bool]:
        """The response, its stage timings, and whether it is degraded."""
        model = self.model(request.model_name, request.model_version)
        stats = metrics.model_stats(model.entry.name)
        t0 = time.perf_counter_ns()
        try:
            with self.gateway.admission:
                texts = decode_texts(request)
                metrics.TEXTS.labels(model.entry.name).inc(len(texts))
                call = parse_call(request, model, timeout_s)
                timings = berth_pb2.Timings()
                answer = await self.gateway._run(
                    model, texts, call.options, call.timeout_s, timings
                )
                t1 = time.perf_counter_ns()
                response = shape_outputs(request, model, answer.outputs, call)
                if answer.degraded:  # answered by the CPU fallback (level 3)
                    response.parameters["berth_degraded"].bool_param = True
        except Exception:
            stats.failed(time.perf_counter_ns() - t0)
            raise
        stats.succeeded(len(texts), timings, t1 - t0, time.perf_counter_ns() - t1)
        return response, timings, answer.degraded

    def metadata(self, model: Model) -> pb.ModelMetadataResponse:
        meta = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=model.entry.name,
            versions=[VERSION],
            platform="berth",
            inputs=[meta(name=TEXT, datatype="BYTES", shape=[-1])],
            outputs=[
                meta(name=n, datatype=d, shape=s) for n, d, s in outputs_of(model)
            ],
        )

    def config(self, model: Model) -> pb.ModelConfig:
        types = {"FP32": pb.TYPE_FP32, "BYTES": pb.TYPE_STRING}
        entry = model.entry
        parameters = {
            "task": entry.task,
            "max_tokens": str(entry.max_tokens),
            "max_texts": str(model.encoder.max_texts),
            "buckets": ",".join(map(str, entry.buckets)),
            "pooling": entry.pooling,
            "normalize": str(entry.normalize).lower(),
        }
        return pb.ModelConfig(
            name=entry.name,
            platform="berth",
            backend=entry.backend,
            max_batch_size=0,
            input=[pb.ModelInput(name=TEXT, data_type=pb.TYPE_STRING, dims=[-1])],
            output=[
                pb.ModelOutput(name=n, data_type=types[d], dims=s)
                for n, d, s in outputs_of(model)
            ],
            parameters={
                k: pb.ModelParameter(string_value=v) for k, v in parameters.items()
            },
        )

    def statistics(self, name: str, version: str) -> pb.ModelStatisticsResponse:
        names = [self.model(name, version).entry.name] if name else self.gateway.models
        cached = self.gateway.cache.enabled
        return pb.ModelStatisticsResponse(
            model_stats=[
                statistics_of(n, metrics.model_stats(n), cached) for n in names
            ]
        )


class KServeService(pb_grpc.GRPCInferenceServiceServicer):
    """gRPC adapter of KServe: maps berth errors onto status codes."""

    def __init__(self, gateway: Gateway) -> None:
        self.kserve = KServe(gateway)

    def add_to_server(self, server: ServiceServer) -> None:
        """Registered as berth's own service is (ServiceServer.add_servicer):
        a unary request gRPC cannot parse is INVALID_ARGUMENT, not UNKNOWN."""
        service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
        server.add_servicer(service, self)

    async def ServerLive(
        self, request: pb.ServerLiveRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(
        self, request: pb.ServerReadyRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=await self.kserve.ready())

    async def ModelReady(
        self, request: pb.ModelReadyRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelReadyResponse:
        try:
            model = self.kserve.model(request.name, request.version)
        except UnknownModel:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=await self.kserve.ready(model.entry.name))

    async def ServerMetadata(
        self, request: pb.ServerMetadataRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerMetadataResponse:
        try:
            version = metadata.version("berth")
        except metadata.PackageNotFoundError:
            version = "unknown"
        return pb.ServerMetadataResponse(
            name="berth", version=version, extensions=EXTENSIONS
        )

    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelMetadataResponse:
        try:
            model = self.kserve.model(request.name, request.version)
        except BerthError as exc:
            await abort(context, exc)
            raise
        return self.kserve.metadata(model)

    async def ModelConfig(
        self, request: pb.ModelConfigRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelConfigResponse:
        try:
            model = self.kserve.model(request.name, request.version)
        except BerthError as exc:
            await abort(context, exc)
            raise
        return pb.ModelConfigResponse(config=self.kserve.config(model))

    async def ModelStatistics(
        self, request: pb.ModelStatisticsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelStatisticsResponse:
        try:
            return self.kserve.statistics(request.name, request.version)
        except BerthError as exc:
            await abort(context, exc)
            raise

    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInferResponse:
        with server_span(
            TRACER,
            f"{SERVICE_NAME}/ModelInfer",
            context.invocation_metadata() or (),
            {"berth.model": request.model_name},
        ):
            try:
                return await self.kserve.infer(
                    request, context.time_remaining(), "kserve"
                )
            except BerthError as exc:
                await abort(context, exc)
                raise

    async def ModelStreamInfer(
        self,
        request_iterator: AsyncIterator[pb.ModelInferRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        metadata = context.invocation_metadata() or ()

        async def answer(request: pb.ModelInferRequest) -> pb.ModelStreamInferResponse:
            # A span per request, under the caller's trace (see berth's Stream).
            attributes = {"berth.model": request.model_name}
            name = f"{SERVICE_NAME}/ModelStreamInfer"
            with server_span(TRACER, name, metadata, attributes) as span:
                try:
                    response = await self.kserve.infer(
                        request, context.time_remaining(), "kserve_stream"
                    )
                    return pb.ModelStreamInferResponse(infer_response=response)
                except Exception as exc:
                    # The stream stays open; the id lets the caller match the error.
                    what = f"ModelStreamInfer request {request.id!r}"
                    error = as_berth_error(exc, log, what)
                    if span is not None:  # the error is answered, not raised
                        record_error(span, error)
                    failed = pb.ModelInferResponse(
                        model_name=request.model_name, id=request.id
                    )
                    return pb.ModelStreamInferResponse(
                        error_message=f"{error.code.name}: {error}",
                        infer_response=failed,
                    )

        responses = serve_stream(request_iterator, answer, context, in_order=True)
        async for response in responses:
            yield response
