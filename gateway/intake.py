"""Public requests read off the wire: counted before they are built.

A protobuf request is cheap to send and dear to parse: 2 million empty texts
are 4 MB on the wire and hundreds of MB once parsed into a message and a
list, all of it on the event loop. The public services are registered here
with raw-bytes request handlers (:func:`add_service`), so each message is
first walked in its wire format, field by field, without building anything
(:func:`scan`): the walk counts the texts (berth's ``texts``, KServe's BYTES
elements, typed or raw) and every field, and stops once there are more than
any valid request holds. A request over ``--max-texts`` is refused
INVALID_ARGUMENT before it is parsed; one the walk accepts is parsed, on a
thread when it is large. gRPC itself refuses a message over
``--max-message-mb`` before any of this (RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, ServiceDescriptor
from google.protobuf.message import DecodeError, Message

from gateway.auth import CALLER, ApiKeys, Unauthenticated
from services.errors import BerthError, InvalidInput, abort
from services.server import ServiceServer

# Fields whose every entry is one text.
TEXT_FIELDS = frozenset(
    {
        "berth.v1.EmbedRequest.texts",
        "berth.v1.ClassifyRequest.texts",
        "berth.v1.RerankRequest.texts",
        "berth.v1.TokenizeRequest.texts",
        "inference.InferTensorContents.bytes_contents",
    }
)
# Fields whose every entry is a raw BYTES tensor: 4-byte lengths, each
# followed by one element.
RAW_TEXT_FIELDS = frozenset({"inference.ModelInferRequest.raw_input_contents"})
# Beyond its texts, a valid request has a handful of fields (model, options,
# KServe's tensor metadata and parameters); a walk past this many more stops.
OTHER_FIELDS = 1024
# A message up to this size is parsed on the event loop (microseconds); a
# larger one on the parse threads.
PARSE_INLINE_BYTES = 64 * 1024
# Scalars captured for a refused stream message's answer keep this much.
CAPTURE_BYTES = 4096

_PACKED_FIXED = {
    FieldDescriptor.TYPE_FIXED32: 4,
    FieldDescriptor.TYPE_SFIXED32: 4,
    FieldDescriptor.TYPE_FLOAT: 4,
    FieldDescriptor.TYPE_FIXED64: 8,
    FieldDescriptor.TYPE_SFIXED64: 8,
    FieldDescriptor.TYPE_DOUBLE: 8,
}
_CONTINUATION_BYTES = bytes(range(0x80, 0x100))


class _Malformed(Exception):
    """Not protobuf: the parser, which says why, reports it."""


class _Stop(Exception):
    """The walk went past the most fields a valid request has."""


@dataclass
class Scan:
    """What a walk over one message found."""

    texts: int = 0
    fields: int = 0
    # Stopped early: more texts or fields than counted here.
    stopped: bool = False
    # path -> value of the scalars asked for (a message: b"" where present).
    captured: dict[str, bytes | int] = field(default_factory=dict)


def _varint(raw: bytes, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise _Malformed
        byte = raw[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _raw_elements(raw: bytes, pos: int, end: int, most: int) -> int:
    """Elements of a raw BYTES tensor, counted up to ``most`` + 1 (a tensor
    it cannot read is left to the decoder, which says why)."""
    n = 0
    while pos + 4 <= end and n <= most:
        pos += 4 + int.from_bytes(raw[pos : pos + 4], "little")
        n += 1
    return n


class _Walk:
    def __init__(
        self, raw: bytes, max_texts: int, captures: frozenset[str], scan: Scan
    ) -> None:
        self.raw = raw
        self.max_texts = max_texts
        # Texts past the limit are counted on, up to as many again, so the
        # refusal says how many a caller sent one or a few too many.
        self.max_fields = 2 * max_texts + OTHER_FIELDS
        self.captures = captures
        self.scan = scan

    def count(self, fields: int) -> None:
        self.scan.fields += fields
        if self.scan.fields > self.max_fields:
            raise _Stop

    def message(self, pos: int, end: int, descriptor: Descriptor, path: str) -> None:
        raw, scan = self.raw, self.scan
        while pos < end:
            tag, pos = _varint(raw, pos, end)
            wire = tag & 7
            known = descriptor.fields_by_number.get(tag >> 3)
            name = f"{path}{known.name}" if known is not None else ""
            self.count(1)
            if wire == 0:
                value, pos = _varint(raw, pos, end)
                if name in self.captures:
                    scan.captured[name] = value
                continue
            if wire in (1, 5):
                pos += 8 if wire == 1 else 4
                continue
            if wire != 2:  # groups: no berth or KServe message has one
                raise _Malformed
            size, pos = _varint(raw, pos, end)
            stop = pos + size
            if stop > end:
                raise _Malformed
            if known is not None:
                self.field(known, pos, stop, name)
            pos = stop
        if pos != end:
            raise _Malformed

    def field(self, known: FieldDescriptor, pos: int, stop: int, name: str) -> None:
        scan = self.scan
        full = known.full_name
        if known.type == FieldDescriptor.TYPE_MESSAGE:
            if name in self.captures:
                scan.captured[name] = b""
            self.message(pos, stop, known.message_type, f"{name}.")
        elif full in TEXT_FIELDS:
            scan.texts += 1
        elif full in RAW_TEXT_FIELDS:
            scan.texts += _raw_elements(self.raw, pos, stop, self.max_texts)
            if scan.texts > self.max_texts:  # (counted no further)
                raise _Stop
        elif known.type in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES):
            if name in self.captures:
                scan.captured[name] = self.raw[pos : min(stop, pos + CAPTURE_BYTES)]
        elif known.type in _PACKED_FIXED:  # packed: one field, many entries
            self.count((stop - pos) // _PACKED_FIXED[known.type])
        else:  # packed varints: one entry per byte under 0x80
            self.count(len(self.raw[pos:stop].translate(None, _CONTINUATION_BYTES)))


def scan(
    raw: bytes,
    descriptor: Descriptor,
    max_texts: int,
    captures: frozenset[str] = frozenset(),
) -> Scan:
    """Walk ``raw``, a ``descriptor`` message, without parsing it: its texts
    and fields counted, stopping past the most any valid request has, and
    the scalars at ``captures`` (dotted field paths) kept. Wire data it
    cannot read ends the walk quietly: the parser reports it."""
    found = Scan()
    try:
        _Walk(raw, max_texts, captures, found).message(0, len(raw), descriptor, "")
    except _Stop:
        found.stopped = True
    except _Malformed:
        pass
    return found


def refusal(found: Scan, descriptor: Descriptor, max_texts: int) -> InvalidInput | None:
    """Why a request with what ``found`` counted is refused unparsed; None
    when it may be parsed."""
    if found.texts > max_texts:
        more = "at least " if found.stopped else ""
        return InvalidInput(
            f"too many texts: {more}{found.texts} in one call, the limit is "
            f"{max_texts} (gateway flag --max-texts)"
        )
    if found.stopped:
        return InvalidInput(
            f"the request has more than {found.fields} fields; a "
            f"{descriptor.full_name} has at most {max_texts} texts (gateway flag "
            f"--max-texts) and {OTHER_FIELDS} other fields"
        )
    return None


Request = TypeVar("Request", bound=Message)


@dataclass
class Refused(Generic[Request]):
    """A stream message refused unparsed: a stand-in holding the scalars
    that identify it (model, request id), and why it was refused."""

    request: Request
    error: BerthError


def stand_in(message_type: type[Request], captured: dict[str, bytes | int]) -> Request:
    """A ``message_type`` holding only the captured scalars."""
    message = message_type()
    for path, value in captured.items():
        *parents, last = path.split(".")
        target: Any = message
        for parent in parents:
            target = getattr(target, parent)
        known = target.DESCRIPTOR.fields_by_name[last]
        try:
            if known.type == FieldDescriptor.TYPE_MESSAGE:
                getattr(target, last).SetInParent()
            elif known.type == FieldDescriptor.TYPE_STRING:
                assert isinstance(value, bytes)
                setattr(target, last, value.decode("utf-8", "replace"))
            else:
                setattr(target, last, value)
        except (TypeError, ValueError):  # (an out-of-range varint)
            continue
    return message


class Intake:
    """Reads the public services' requests: scanned, then parsed; with
    ``keys``, only a call that carries one of them (gateway/auth.py), checked
    before its first message is read."""

    def __init__(self, max_texts: int, keys: ApiKeys | None = None) -> None:
        self.max_texts = max_texts
        self.keys = keys
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="parse")

    async def admit(self, context: grpc.aio.ServicerContext) -> None:
        """The call's caller (gateway.auth.CALLER) from its API key; a call
        without a valid key ends UNAUTHENTICATED."""
        if self.keys is None:
            return
        try:
            caller = self.keys.caller(context.invocation_metadata() or ())
        except Unauthenticated as exc:
            await abort(context, exc)
            raise  # unreachable: abort raises
        CALLER.set(caller)

    async def parse(self, raw: bytes, message_type: type[Request]) -> Request:
        """Parse ``raw``: on the loop when small, else on the parse threads."""
        if len(raw) <= PARSE_INLINE_BYTES:
            return message_type.FromString(raw)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, message_type.FromString, raw)

    async def read(
        self,
        raw: bytes,
        message_type: type[Request],
        captures: frozenset[str] = frozenset(),
    ) -> Request | Refused[Request]:
        """The message, or (over a limit) a Refused stand-in; raises
        DecodeError for bytes that are not a ``message_type``."""
        descriptor = message_type.DESCRIPTOR
        found = scan(raw, descriptor, self.max_texts, captures)
        error = refusal(found, descriptor, self.max_texts)
        if error is not None:
            return Refused(stand_in(message_type, found.captured), error)
        return await self.parse(raw, message_type)

    def unary(
        self,
        behaviour: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Message]],
        message_type: type[Message],
    ) -> Callable[[bytes, grpc.aio.ServicerContext], Awaitable[Message]]:
        """A unary handler over the request bytes: a request over a limit,
        or not a ``message_type``, ends the call INVALID_ARGUMENT."""
        name = message_type.DESCRIPTOR.full_name

        async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> Message:
            await self.admit(context)
            try:
                request = await self.read(raw, message_type)
            except DecodeError as exc:
                problem = InvalidInput(
                    f"the request could not be parsed as {name}: {exc}"
                )
                await abort(context, problem)
                raise  # unreachable: abort raises
            if isinstance(request, Refused):
                await abort(context, request.error)
            return await behaviour(request, context)

        return handle

    def stream(
        self,
        behaviour: Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Message]],
        message_type: type[Message],
        captures: frozenset[str],
    ) -> Callable[[AsyncIterator[bytes], grpc.aio.ServicerContext], Any]:
        """A bidi handler over request bytes: ``behaviour`` reads parsed
        messages, and Refused stand-ins (with ``captures``) for those over a
        limit; bytes that are not a ``message_type`` end its request stream
        with the DecodeError (services/streams.py until_unreadable)."""

        async def messages(raw: AsyncIterator[bytes]) -> AsyncIterator[Any]:
            async for one in raw:
                yield await self.read(one, message_type, captures)

        async def handle(
            raw: AsyncIterator[bytes], context: grpc.aio.ServicerContext
        ) -> AsyncIterator[Message]:
            await self.admit(context)
            async for response in behaviour(messages(raw), context):
                yield response

        return handle


def add_service(
    server: ServiceServer,
    service: ServiceDescriptor,
    servicer: object,
    intake: Intake,
    stream_captures: frozenset[str] = frozenset(),
) -> None:
    """Register ``servicer``'s methods of ``service`` on ``server`` with
    raw-bytes requests read by ``intake`` (unary and bidi methods only, as
    berth.v1 and KServe have); ``stream_captures``: the scalars a refused
    stream message's stand-in keeps."""
    handlers = {}
    for method in service.methods:
        request = message_factory.GetMessageClass(method.input_type)
        response = message_factory.GetMessageClass(method.output_type)
        behaviour = getattr(servicer, method.name)
        serialize = response.SerializeToString
        if not method.client_streaming and not method.server_streaming:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                intake.unary(behaviour, request),
                request_deserializer=None,
                response_serializer=serialize,
            )
        elif method.client_streaming and method.server_streaming:
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                intake.stream(behaviour, request, stream_captures),
                request_deserializer=None,
                response_serializer=serialize,
            )
        else:
            raise ValueError(f"{method.full_name}: only unary and bidi methods")
    generic = grpc.method_handlers_generic_handler(service.full_name, handlers)
    server.server.add_generic_rpc_handlers((generic,))
    server.server.add_registered_method_handlers(service.full_name, handlers)
