"""KServe v2 (Open Inference Protocol) gRPC service over the gateway.

Every berth model takes and gives tensors of one contract
(gateway.kserve_tensors). Requests share the gateway's admission bound and
response cache, and count in its Prometheus request metrics (api ``kserve``
for ModelInfer, ``kserve_stream`` for ModelStreamInfer; outcomes and stage
times as for berth's own API). ModelStatistics reports the model's
statistics (gateway/metrics.py ``model_stats``), shared with berth's own
API: as in Triton, they are meant to count every inference of the model,
whatever API it came by.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from importlib import metadata

import grpc

from gateway import auth, metrics
from gateway.berth import check_pair_options
from gateway.calls import (
    STREAM_WINDOW,
    AbortOnError,
    serve_requests,
    serve_unary,
    tenant_of,
)
from gateway.echo import quoted
from gateway.intake import Intake, add_service
from gateway.kserve_tensors import (
    FINAL_RESPONSE,
    QUERY,
    TEXT,
    VERSION,
    decode_inputs,
    field_of,
    final_response_wanted,
    inputs_of,
    outputs_of,
    parse_call,
    shape_outputs,
)
from gateway.metrics import ModelStats
from gateway.pipeline import Gateway, Model
from services.errors import BerthError, InvalidInput, UnknownModel, abort
from services.proto.berth.v1 import berth_pb2
from services.proto.inference import grpc_service_pb2 as pb
from services.proto.inference import grpc_service_pb2_grpc as pb_grpc
from services.server import ServiceServer

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
EXTENSIONS = [
    "classification",
    "model_configuration",
    "statistics",
    "binary_tensor_data",
    "parameters",
]
_LOADING = (
    "berth loads its models from its model repository at start-up and does "
    "not load or unload them while it serves"
)
_SHARED_MEMORY = (
    "berth takes and gives tensors in the messages only (contents or "
    "raw_input_contents / raw_output_contents), not in shared memory"
)
# Triton's RPCs of the service that berth does not serve, and why: a call
# gets UNIMPLEMENTED saying so (UnservedMethods).
UNSERVED = {
    "RepositoryModelLoad": _LOADING,
    "RepositoryModelUnload": _LOADING,
    **{
        f"{kind}SharedMemory{verb}": _SHARED_MEMORY
        for kind in ("System", "Cuda")
        for verb in ("Status", "Register", "Unregister")
    },
    "TraceSetting": "berth traces with OpenTelemetry, set at start-up by the "
    "OTEL_* environment variables",
    "LogSettings": "berth's log level is set at start-up by BERTH_LOG_LEVEL",
}
# The fields naming the model and its version: in ModelInferRequest, and in
# the requests of ModelReady, ModelMetadata, ModelConfig and ModelStatistics.
INFER_FIELDS = ("model_name", "model_version")
MODEL_FIELDS = ("name", "version")
# What a ModelStreamInfer message refused unread keeps (gateway.intake):
# enough for its answer to name its request.
STREAM_CAPTURES = frozenset({"model_name", "id"})


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


def _stream_error(
    request: pb.ModelInferRequest, error: BerthError
) -> pb.ModelStreamInferResponse:
    """A ModelStreamInfer request's error, answered in the stream (which
    stays open); the request's id lets the caller match it."""
    failed = pb.ModelInferResponse(model_name=request.model_name, id=request.id)
    if final_response_wanted(request):
        failed.parameters[FINAL_RESPONSE].bool_param = True
    return pb.ModelStreamInferResponse(
        error_message=f"{error.code.name}: {error}", infer_response=failed
    )


class Unimplemented(BerthError):
    """An RPC this server does not serve."""

    code = grpc.StatusCode.UNIMPLEMENTED
    reason = "UNIMPLEMENTED"


class UnservedMethods(grpc.GenericRpcHandler):
    """Answers a call of any other method of the service UNIMPLEMENTED with
    a message naming the method, why it is not served (UNSERVED) and the
    methods that are, instead of gRPC's bare "Method not found!"."""

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        service, _, name = str(details.method).lstrip("/").rpartition("/")
        if service != SERVICE_NAME:
            return None
        served = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods
        why = UNSERVED.get(name, "it is not a method of the KServe v2 protocol")
        error = Unimplemented(
            f"{SERVICE_NAME}/{name} is not served: {why}. This gateway serves "
            f"{', '.join(m.name for m in served)}"
        )

        async def refuse(request: bytes, context: grpc.aio.ServicerContext) -> None:
            await abort(context, error)

        return grpc.unary_unary_rpc_method_handler(refuse)


class KServe:
    """The KServe v2 request path over a Gateway, without gRPC."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    def model(
        self, name: str, version: str, fields: tuple[str, str] = INFER_FIELDS
    ) -> Model:
        """The model named, if the call's API key may use it; ``fields``:
        the request's fields of the name and the version, which an error
        names."""
        auth.allow(name)
        model = self.gateway.models.get(name)
        if model is None:
            raise UnknownModel(
                f"unknown model {quoted(name)}; this gateway serves "
                f"{', '.join(sorted(self.gateway.models))}",
                field=fields[0],
            )
        if version not in ("", VERSION):
            raise UnknownModel(
                f"model {name!r} has no version {quoted(version)}; its only "
                f"version is {VERSION} (or leave {fields[1]} empty)",
                field=fields[1],
            )
        return model

    async def ready(self, name: str | None = None) -> bool:
        """Whether the batcher has a healthy engine for the model (or all)."""
        healthy = await self.healthy()
        wanted = [name] if name is not None else list(self.gateway.models)
        return all(healthy.get(n, False) for n in wanted)

    async def healthy(self) -> dict[str, bool]:
        """Whether each model the batcher knows has a healthy engine; none
        while the batcher is not connected or cannot be asked."""
        if not self.gateway.batcher.ready.is_set():
            return {}
        try:
            models = await self.gateway.batcher.models()
        except Exception:  # any failure to ask means not ready
            return {}
        return {m.name: m.healthy_engines > 0 for m in models.models}

    async def index(
        self, request: pb.RepositoryIndexRequest
    ) -> pb.RepositoryIndexResponse:
        """The models the call's API key may use, each READY or UNAVAILABLE
        (only the READY ones where ``ready`` is set); raises InvalidInput."""
        if request.repository_name:
            raise InvalidInput(
                f"unknown repository {quoted(request.repository_name)}: berth "
                "serves one model repository; leave repository_name empty",
                field="repository_name",
            )
        healthy = await self.healthy()
        index = pb.RepositoryIndexResponse()
        for name in sorted(n for n in self.gateway.models if auth.allowed(n)):
            if healthy.get(name, False):
                index.models.add(name=name, version=VERSION, state="READY")
            elif not request.ready:
                reason = "no engine of the model is connected and healthy"
                index.models.add(
                    name=name, version=VERSION, state="UNAVAILABLE", reason=reason
                )
        return index

    async def infer(
        self,
        request: pb.ModelInferRequest,
        timeout_s: float | None,
        api: str,
        tenant: str = "",
    ) -> pb.ModelInferResponse:
        """One request, counted in the gateway's request metrics as berth's
        own calls are (``api``: kserve for ModelInfer, kserve_stream for
        ModelStreamInfer) and in its model's statistics."""
        name = request.model_name
        label = name if name in self.gateway.models else "unknown"
        with metrics.Tally(label, api) as tally:
            response, timings, degraded = await self._infer(request, timeout_s, tenant)
            tally.answered(timings, degraded)
        return response

    async def _infer(
        self, request: pb.ModelInferRequest, timeout_s: float | None, tenant: str
    ) -> tuple[pb.ModelInferResponse, berth_pb2.Timings, bool]:
        """The response, the stage timings it took, and whether it is
        degraded."""
        model = self.model(request.model_name, request.model_version)
        stats = metrics.model_stats(model.entry.name)
        t0 = time.perf_counter_ns()
        try:
            with self.gateway.admission:
                inputs = decode_inputs(request, model)
                texts = inputs[TEXT]
                metrics.TEXTS.labels(model.entry.name).inc(len(texts))
                call = parse_call(request, model, timeout_s)
                query = inputs[QUERY][0] if QUERY in inputs else None
                if query is not None:
                    check_pair_options(model.entry.name, call.options)
                timings = berth_pb2.Timings()
                answer = await self.gateway.run(
                    model, texts, call.options, call.timeout_s, timings, tenant, query
                )
                t1 = time.perf_counter_ns()
                response = shape_outputs(request, model, answer.outputs, call)
                if answer.degraded:  # answered by the CPU fallback (level 3)
                    response.parameters["berth_degraded"].bool_param = True
        except Exception as error:
            stats.failed(time.perf_counter_ns() - t0)
            if isinstance(error, BerthError):  # named as KServe names it
                error.field = field_of(request, error.field)
            raise
        measured = answer.measured
        stats.succeeded(len(texts), measured, t1 - t0, time.perf_counter_ns() - t1)
        return response, measured, answer.degraded

    def metadata(self, model: Model) -> pb.ModelMetadataResponse:
        meta = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=model.entry.name,
            versions=[VERSION],
            platform="berth",
            inputs=[
                meta(name=n, datatype="BYTES", shape=s) for n, s in inputs_of(model)
            ],
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
            # The names the request parameter prompt_name takes.
            "prompts": ",".join(sorted(entry.prompts)),
            "default_prompt_name": entry.default_prompt_name or "",
        }
        return pb.ModelConfig(
            name=entry.name,
            platform="berth",
            backend=entry.backend,
            max_batch_size=0,
            # Texts of concurrent requests are batched together (the
            # batcher's flags set how); answers keep their requests' order.
            dynamic_batching=pb.ModelDynamicBatching(preserve_ordering=True),
            response_cache=pb.ModelResponseCache(enable=self.gateway.cache.enabled),
            input=[
                pb.ModelInput(name=n, data_type=pb.TYPE_STRING, dims=s)
                for n, s in inputs_of(model)
            ],
            output=[
                pb.ModelOutput(name=n, data_type=types[d], dims=s)
                for n, d, s in outputs_of(model)
            ],
            parameters={
                k: pb.ModelParameter(string_value=v) for k, v in parameters.items()
            },
        )

    def statistics(self, name: str, version: str) -> pb.ModelStatisticsResponse:
        if name:
            names = [self.model(name, version, MODEL_FIELDS).entry.name]
        else:
            names = [n for n in self.gateway.models if auth.allowed(n)]
        cached = self.gateway.cache.enabled
        return pb.ModelStatisticsResponse(
            model_stats=[
                statistics_of(n, metrics.model_stats(n), cached) for n in names
            ]
        )


class KServeService(pb_grpc.GRPCInferenceServiceServicer):
    """gRPC adapter of KServe: maps berth errors onto status codes."""

    def __init__(self, gateway: Gateway, stream_window: int = STREAM_WINDOW) -> None:
        self.kserve = KServe(gateway)
        self.stream_window = stream_window

    def add_to_server(self, server: ServiceServer, intake: Intake) -> None:
        """Registered as berth's own service is (gateway.intake.add_service):
        requests counted before they are parsed, and one gRPC cannot parse
        is INVALID_ARGUMENT, not UNKNOWN."""
        service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
        add_service(server, service, self, intake, STREAM_CAPTURES)
        server.server.add_generic_rpc_handlers((UnservedMethods(),))

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
        async with AbortOnError(context):
            auth.allow(request.name)
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
        model = await self._model(request, context)
        return self.kserve.metadata(model)

    async def ModelConfig(
        self, request: pb.ModelConfigRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelConfigResponse:
        model = await self._model(request, context)
        return pb.ModelConfigResponse(config=self.kserve.config(model))

    async def _model(
        self,
        request: pb.ModelMetadataRequest | pb.ModelConfigRequest,
        context: grpc.aio.ServicerContext,
    ) -> Model:
        """The model a request names; an unknown one ends the call NOT_FOUND."""
        async with AbortOnError(context):
            return self.kserve.model(request.name, request.version, MODEL_FIELDS)

    async def ModelStatistics(
        self, request: pb.ModelStatisticsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelStatisticsResponse:
        async with AbortOnError(context):
            return self.kserve.statistics(request.name, request.version)

    async def RepositoryIndex(
        self, request: pb.RepositoryIndexRequest, context: grpc.aio.ServicerContext
    ) -> pb.RepositoryIndexResponse:
        async with AbortOnError(context):
            return await self.kserve.index(request)

    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInferResponse:
        tenant = tenant_of(context)
        work = self.kserve.infer(request, context.time_remaining(), "kserve", tenant)
        method = f"{SERVICE_NAME}/ModelInfer"
        return await serve_unary(context, method, request.model_name, work)

    async def ModelStreamInfer(
        self,
        request_iterator: AsyncIterator[pb.ModelInferRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        tenant = tenant_of(context)

        async def call(request: pb.ModelInferRequest) -> pb.ModelStreamInferResponse:
            timeout_s = context.time_remaining()
            response = await self.kserve.infer(
                request, timeout_s, "kserve_stream", tenant
            )
            # Every request has exactly one response, so it is the last one.
            if final_response_wanted(request):
                response.parameters[FINAL_RESPONSE].bool_param = True
            return pb.ModelStreamInferResponse(infer_response=response)

        responses = serve_requests(
            request_iterator,
            context,
            f"{SERVICE_NAME}/ModelStreamInfer",
            call,
            _stream_error,
            model_of=lambda request: request.model_name,
            named=lambda request: f"ModelStreamInfer request {quoted(request.id)}",
            in_order=True,
            window=self.stream_window,
        )
        async for response in responses:
            yield response
