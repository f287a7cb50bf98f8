"""Asyncio gRPC server bootstrap shared by gateway, batcher and engine.

Every service gets the stock ``grpc.health.v1`` servicer, server reflection,
and a SIGTERM/SIGINT drain: report NOT_SERVING, keep serving for a lame-duck
period (a front door: see run_until_signalled), let the service finish what
it holds, then stop the server with a grace period for in-flight calls.
"""

from __future__ import annotations

import asyncio
import errno
import inspect
import logging
import os
import signal
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection

from services.channels import server_options
from services.config import env
from services.errors import BerthError, InvalidInput, abort
from services.logs import Throttled
from services.sockets import bound, listen_addresses

# A front door's lame duck after turning NOT_SERVING (the gateway's
# --lame-duck-s; see ServiceServer.run_until_signalled).
LAME_DUCK_S = 0.5

log = logging.getLogger("berth.server")

OVERALL = ""  # the health service name that stands for the whole server
HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"]

# A request that cannot be parsed is the caller's doing and can be repeated
# at will: at most one line a minute says so, with how many there were.
unparsed = Throttled(log, period_s=60.0)


class ListenError(OSError):
    """A service cannot listen where it was told to (services.loop.run ends
    the process with this message and exit code 1, no traceback)."""


def why_not_listening(address: str, reuse_port: bool) -> str:
    """Why gRPC could not listen on ``address`` (host:port), found by binding
    each address it stands for as gRPC binds it: gRPC says no more than that
    the bind failed, and a port in use is not the only cause (a --host that
    does not resolve or is not this machine's, a port below 1024)."""
    host, _, port = address.rpartition(":")
    try:
        addresses = listen_addresses(host, int(port))
    except socket.gaierror as exc:
        return f"cannot resolve {host!r} ({exc.strerror}): check --host"
    for family, where, required in addresses:
        try:
            # (sharing: beside the ones meant to share the port)
            bound(family, where, hold=False, share=reuse_port).close()
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                break
            if not required:
                continue  # the wildcard of a family that is off here
            if exc.errno == errno.EADDRNOTAVAIL:
                return f"{where[0]} is not an address of this machine: check --host"
            if exc.errno == errno.EACCES:
                return (
                    "permission denied (a port below 1024 needs root or "
                    "CAP_NET_BIND_SERVICE)"
                )
            return f"{exc.strerror} (on {where[0]})"
    else:
        # Every address binds now: the listener in the way just went, or
        # gRPC's own log line above says what else failed.
        return "gRPC could not bind it (its log line above says why)"
    if reuse_port:
        return "another process listens there"
    return (
        "another process listens there (only processes started with "
        "BERTH_REUSE_PORT=1, as berth serve starts its own, share a port)"
    )


class ServiceServer:
    """One gRPC server with health, reflection and graceful drain.

    gRPC listens with SO_REUSEPORT unless told not to, so a second process
    started on a port another one serves would join it without an error,
    and the kernel would split the callers between the two. A service binds
    its port alone unless ``reuse_port`` (default: BERTH_REUSE_PORT, off):
    `berth serve` turns it on for its children, whose gateways share their
    port on purpose and which bind next to serve's hold on their ports
    (services/sockets.py)."""

    def __init__(
        self,
        name: str,
        address: str,
        service_names: Iterable[str],
        max_message_bytes: int | None = None,
        reuse_port: bool | None = None,
        also: Iterable[str] = (),
        public: bool | None = None,
        credentials: grpc.ServerCredentials | None = None,
    ) -> None:
        """Listens on ``address`` and on each of ``also`` (a gateway's own
        port beside the port it shares), with TLS when given
        ``credentials`` (services/tls.py). ``public``: the front door, whose
        connections are aged out (services/channels.py server_options);
        unless given, a server with a ``max_message_bytes`` of its own (the
        gateway) is one."""
        self.name = name
        self.credentials = credentials
        if reuse_port is None:
            reuse_port = env("reuse_port", False)
        if public is None:
            public = max_message_bytes is not None
        # (BERTH_KEEPALIVE_* and the connection limits are read now)
        options = server_options(public=public)
        options.append(("grpc.so_reuseport", int(reuse_port)))
        if max_message_bytes is not None:
            # A public front door accepts less than the internal hops.
            key = "grpc.max_receive_message_length"
            options = [o for o in options if o[0] != key] + [(key, max_message_bytes)]
        self.server = grpc.aio.server(options=options)
        self.health = health.aio.HealthServicer()
        # Not health_pb2_grpc.add_HealthServicer_to_server: gRPC would parse
        # the request, and answer bytes that are no HealthCheckRequest
        # UNKNOWN with a traceback in the log, one per call.
        self.add_servicer(HEALTH, self.health)
        self.service_names = list(service_names)
        reflection.enable_server_reflection(
            [
                *self.service_names,
                HEALTH.full_name,
                reflection.SERVICE_NAME,
            ],
            self.server,
        )
        self.port, *also_ports = (
            self._listen(where, reuse_port) for where in (address, *also)
        )
        self.address = f"{address.rsplit(':', 1)[0]}:{self.port}"
        self.also = [
            f"{where.rsplit(':', 1)[0]}:{port}"
            for where, port in zip(also, also_ports, strict=True)
        ]
        self._stop = asyncio.Event()
        # What health answers for the whole server (an HTTP surface's too).
        self.serving = False

    def _listen(self, address: str, reuse_port: bool) -> int:
        port_text = address.rpartition(":")[2]
        if not port_text.isdigit() or int(port_text) > 65535:
            # gRPC takes a port modulo 65536 (70000 listened on 4464).
            raise ListenError(
                f"{self.name}: cannot listen on {address}: {port_text!r} is not a "
                "port (0-65535)"
            )
        try:
            if self.credentials is None:
                port = self.server.add_insecure_port(address)
            else:
                port = self.server.add_secure_port(address, self.credentials)
        except RuntimeError:  # gRPC's "Failed to bind to address"
            port = 0
        if port == 0:
            why = why_not_listening(address, reuse_port)
            raise ListenError(f"{self.name}: cannot listen on {address}: {why}")
        return int(port)

    def add_servicer(self, service: ServiceDescriptor, servicer: object) -> None:
        """Register ``servicer``'s methods of ``service``, as the generated
        ``add_*Servicer_to_server`` does, but with the request of each method
        that takes one request parsed in its handler (:func:`parsed_in_handler`).

        grpc.aio parses a request before any handler runs; one it cannot
        parse (bad wire format, a string that is not UTF-8) it answers
        UNKNOWN ("Unexpected DecodeError"), though the caller sent it, and
        logs a traceback for every such call. Registered without a
        deserializer, a handler gets the bytes and answers such a request
        INVALID_ARGUMENT, as the streams answer a message they cannot read
        (services/streams.py until_unreadable). Methods that take a request
        stream keep gRPC's parse: a handler gets the error as it reads."""
        handlers = {}
        for method in service.methods:
            request = message_factory.GetMessageClass(method.input_type)
            response = message_factory.GetMessageClass(method.output_type)
            behaviour = getattr(servicer, method.name)
            serialize = response.SerializeToString
            if not method.client_streaming:
                make_one = (
                    grpc.unary_stream_rpc_method_handler
                    if method.server_streaming
                    else grpc.unary_unary_rpc_method_handler
                )
                handlers[method.name] = make_one(
                    parsed_in_handler(behaviour, request),
                    request_deserializer=None,  # the handler gets the bytes
                    response_serializer=serialize,
                )
                continue
            make = (
                grpc.stream_stream_rpc_method_handler
                if method.server_streaming
                else grpc.stream_unary_rpc_method_handler
            )
            handlers[method.name] = make(
                behaviour,
                request_deserializer=request.FromString,
                response_serializer=serialize,
            )
        generic = grpc.method_handlers_generic_handler(service.full_name, handlers)
        self.server.add_generic_rpc_handlers((generic,))
        self.server.add_registered_method_handlers(service.full_name, handlers)

    async def start(self) -> None:
        await self.set_serving(False)
        await self.server.start()
        log.info(
            "%s listening on %s (event loop: %s, gRPC experiments: %s)",
            self.name,
            ", ".join((self.address, *self.also)),
            type(asyncio.get_running_loop()).__module__.split(".")[0],
            os.environ.get("GRPC_EXPERIMENTS") or "gRPC's defaults",
        )

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in (OVERALL, *self.service_names):
            await self.health.set(service, status)
        self.serving = serving
        mark_ready(serving)

    def request_stop(self) -> None:
        self._stop.set()

    async def run_until_signalled(
        self,
        drain: Callable[[], Awaitable[None]] | None = None,
        grace_s: float = 10.0,
        lame_duck_s: float = 0.0,
    ) -> None:
        """Serve until SIGTERM/SIGINT (or request_stop), then drain and stop.

        For ``lame_duck_s`` after turning NOT_SERVING the server still takes
        and answers calls. grpc.aio picks up the calls gRPC core has received
        one at a time, an event-loop turn each; ``server.stop`` answers every
        call still queued in core CANCELLED, grace period or not
        (grpc/grpc#41785). A burst that reaches a busy process just before
        the signal would be lost that way (tests/chaos/test_drain_queue.py);
        the lame duck lets the loop take the queue in, and clients that watch
        health move away. Internal hops whose callers stop first need none.
        """
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        await self._stop.wait()
        log.info("%s draining: NOT_SERVING, finishing in-flight work", self.name)
        await self.health.enter_graceful_shutdown()
        self.serving = False
        if lame_duck_s > 0:
            await asyncio.sleep(lame_duck_s)
        if drain is not None:
            try:
                await asyncio.wait_for(drain(), grace_s)
            except TimeoutError:
                log.warning(
                    "%s: drain did not finish within %.0f s", self.name, grace_s
                )
        await self.server.stop(grace_s)
        log.info("%s stopped", self.name)


def mark_ready(serving: bool) -> None:
    """Mirror the health status in the file BERTH_READY_FILE names, if set:
    it exists while the server is SERVING. `berth serve` reads it for a
    gateway with TLS, whose port it cannot call without a certificate."""
    path = os.environ.get("BERTH_READY_FILE")
    if not path:
        return
    try:
        if serving:
            with open(path, "w") as f:
                f.write(f"{os.getpid()}\n")
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("cannot write BERTH_READY_FILE %s: %s", path, exc)


def parsed_in_handler(
    behaviour: Callable[..., Any], request_type: type[Message]
) -> Any:
    """A handler of a method that takes one request: it parses the request
    bytes itself, then runs ``behaviour`` on the message (a coroutine
    function, or an async generator function for a method that answers with
    a stream). Bytes that are not a ``request_type`` are answered
    INVALID_ARGUMENT naming it and the parse error, and logged at most once
    a minute (:data:`unparsed`)."""
    name = request_type.DESCRIPTOR.full_name

    async def parse(raw: bytes, context: grpc.aio.ServicerContext) -> Message:
        try:
            return request_type.FromString(raw)
        except Exception as exc:  # a DecodeError is the caller's; else a bug
            kind = InvalidInput if isinstance(exc, DecodeError) else BerthError
            unparsed.warning(
                "a request from %s could not be parsed as %s: %s",
                context.peer(),
                name,
                exc,
            )
            await abort(
                context, kind(f"the request could not be parsed as {name}: {exc}")
            )
            raise  # unreachable: abort raises

    if inspect.isasyncgenfunction(behaviour):

        async def stream(
            raw: bytes, context: grpc.aio.ServicerContext
        ) -> AsyncIterator[Message]:
            async for reply in behaviour(await parse(raw, context), context):
                yield reply

        return stream

    async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> Message:
        reply: Message = await behaviour(await parse(raw, context), context)
        return reply

    return handle
