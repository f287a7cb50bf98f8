"""Hypothesis strategies for protobuf requests, built from descriptors alone,
and the services a live gRPC server offers, read by server reflection.

:class:`Fuzz` walks a message descriptor: every scalar type at its bounds
(ints at their type's limits, floats with nan and infinities, open enums
with numbers they do not name), strings of any code point but the
surrogates (empty, control characters, thousands of characters), bytes,
repeated fields short and long, nested messages to a bounded depth, oneofs
(at most one member set) and maps. ``vocabulary`` strings and per-field
``hints`` are mixed in so that requests name what the server knows (a
served model, a tensor name) and get past its first lookups; ``seeds``,
valid messages in protobuf text format, are drawn as they are and with a
field or two replaced, so that requests also reach the deeper paths.

:func:`served` reads the services from the server itself, into a descriptor
pool of its own: the messages are the server's, and a process that imports
other stubs of the same protobuf names (tritonclient's ``inference``) holds
both.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import descriptor_pool, message_factory, text_format
from google.protobuf.descriptor import (
    Descriptor,
    FieldDescriptor,
    MethodDescriptor,
)
from google.protobuf.message import Message
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from hypothesis import strategies as st

FD = FieldDescriptor
_SIGNED32 = (-(2**31), 2**31 - 1)
_SIGNED64 = (-(2**63), 2**63 - 1)
INT_BOUNDS = {
    FD.TYPE_INT32: _SIGNED32,
    FD.TYPE_SINT32: _SIGNED32,
    FD.TYPE_SFIXED32: _SIGNED32,
    FD.TYPE_UINT32: (0, 2**32 - 1),
    FD.TYPE_FIXED32: (0, 2**32 - 1),
    FD.TYPE_INT64: _SIGNED64,
    FD.TYPE_SINT64: _SIGNED64,
    FD.TYPE_SFIXED64: _SIGNED64,
    FD.TYPE_UINT64: (0, 2**64 - 1),
    FD.TYPE_FIXED64: (0, 2**64 - 1),
}
# A huge-ish string: up to 3 characters repeated up to this many times
# (past the gateway's character guard of a 256-token model, 8192).
HUGE_REPEATS = 8_000
# A long repeated field: a few drawn entries repeated up to this many (past
# the gateway's --max-texts, 256), none of them a huge string; of messages,
# up to LONG_MESSAGES. (A Tokenize call of 256 texts of 16,000 characters,
# under a 512-token model's guard, raised the gateway's resident memory by
# 115 to 170 MiB on the dev machine, and took seconds.)
LONG_LIST = 300
LONG_MESSAGES = 32
# What a failing example shows of its message.
SHOWN_CHARS = 1500
# Characters of every code point but the surrogates (not UTF-8).
CHARACTERS = st.characters(codec="utf-8")


@dataclass(frozen=True)
class Wire:
    """One request as sent: its bytes, the message they were made of and
    how they were changed after (a failing example shows both)."""

    raw: bytes
    message: Message | None = None
    changed: str = ""

    def __repr__(self) -> str:
        made = "" if self.message is None else f" of {shown(self.message)}"
        return f"Wire({len(self.raw)} bytes{made}{self.changed})"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        """How Hypothesis shows it in a failing example: as repr() does,
        not field by field (the bytes may be megabytes)."""
        printer.text(repr(self))


@dataclass(frozen=True)
class Method:
    """One RPC of a served service, its messages from the server's pool."""

    path: str
    descriptor: MethodDescriptor

    @property
    def streaming(self) -> bool:
        return self.descriptor.client_streaming or self.descriptor.server_streaming

    def response(self, raw: bytes) -> Message:
        return message_factory.GetMessageClass(self.descriptor.output_type).FromString(
            raw
        )


def served(channel: grpc.Channel, skip: Sequence[str] = ("grpc.",)) -> list[Method]:
    """Every method of every service the server behind ``channel`` lists by
    reflection, but those of services whose names start with a ``skip``
    prefix."""
    database = ProtoReflectionDescriptorDatabase(channel)
    pool = descriptor_pool.DescriptorPool(database)
    methods = []
    for name in sorted(database.get_services()):
        if name.startswith(tuple(skip)):
            continue
        service = pool.FindServiceByName(name)
        methods += [Method(f"/{name}/{m.name}", m) for m in service.methods]
    return methods


def shown(message: Message) -> str:
    text = text_format.MessageToString(message, as_one_line=True)
    if len(text) > SHOWN_CHARS:
        text = f"{text[:SHOWN_CHARS]}... ({len(text)} characters)"
    return f"{message.DESCRIPTOR.full_name} {{{text}}}"


def _bounded(lo: int, hi: int) -> st.SearchStrategy[int]:
    """Integers of [lo, hi], its edges and small numbers often."""
    edges = [v for v in (lo, lo + 1, -1, 0, 1, 2, hi - 1, hi) if lo <= v <= hi]
    return st.one_of(
        st.sampled_from(sorted(set(edges))),
        st.integers(max(lo, -3), min(hi, 300)),
        st.integers(lo, hi),
    )


def _stretched(items: list[Any], n: int) -> list[Any]:
    """``items`` repeated to ``n`` entries."""
    return (items * (n // len(items) + 1))[:n]


def _is_map(field: FieldDescriptor) -> bool:
    message = field.message_type
    return message is not None and message.GetOptions().map_entry


def _assign(message: Message, field: FieldDescriptor, value: Any) -> None:
    target = getattr(message, field.name)
    if _is_map(field):
        holds_messages = field.message_type.fields_by_name["value"].message_type
        for key, item in value.items():
            if holds_messages:
                target[key].CopyFrom(item)
            else:
                target[key] = item
    elif field.is_repeated:
        target.extend(value)
    elif field.type == FD.TYPE_MESSAGE:
        target.CopyFrom(value)
    else:
        setattr(message, field.name, value)


class Fuzz:
    """Strategies for messages of any descriptor (see the module's doc)."""

    def __init__(
        self,
        vocabulary: Sequence[str] = (),
        hints: Mapping[str, st.SearchStrategy[Any]] | None = None,
        seeds: Mapping[str, Sequence[str]] | None = None,
        depth: int = 4,
    ) -> None:
        """``hints``: a field's full name or its name -> values mixed into
        the field's; ``seeds``: a message's full name -> valid messages in
        text format; ``depth``: nested messages below it are left unset."""
        self.vocabulary = [*vocabulary, ""]
        self.hints = dict(hints or {})
        self.seeds = dict(seeds or {})
        self.depth = depth
        self._messages: dict[tuple[str, int], st.SearchStrategy[Message]] = {}

    def wire(self, descriptor: Descriptor) -> st.SearchStrategy[Wire]:
        """A message's bytes; one in three cut short or with bytes after
        it (unknown fields, or no protobuf at all)."""
        messages = self.message(descriptor)

        @st.composite
        def build(draw: st.DrawFn) -> Wire:
            message = draw(messages)
            raw, changed = message.SerializeToString(), ""
            how = draw(st.integers(0, 5))
            if how == 4:
                cut = draw(st.integers(0, len(raw)))
                raw, changed = raw[:cut], f", cut at byte {cut}"
            elif how == 5:
                tail = draw(st.binary(min_size=1, max_size=16))
                raw, changed = raw + tail, f", then {tail!r}"
            return Wire(raw, message, changed)

        return build()

    def message(
        self, descriptor: Descriptor, depth: int = 0
    ) -> st.SearchStrategy[Message]:
        """Fresh messages; where ``descriptor`` has seeds, also the seeds, as
        they are and with a field or two replaced by fuzzed values."""
        key = (descriptor.full_name, depth)
        if key not in self._messages:
            values = {
                f.name: s
                for f in descriptor.fields
                if (s := self._field(f, depth)) is not None
            }
            made = self._fresh(descriptor, values)
            seeds = self.seeded(descriptor)
            if seeds:
                made = st.one_of(
                    made, st.sampled_from(seeds), self._mutants(seeds, values)
                )
            self._messages[key] = made
        return self._messages[key]

    def seeded(self, descriptor: Descriptor) -> list[Message]:
        """The seeds of ``descriptor``'s messages, parsed."""
        cls = message_factory.GetMessageClass(descriptor)
        return [
            text_format.Parse(t, cls())
            for t in self.seeds.get(descriptor.full_name, ())
        ]

    def _fresh(
        self, descriptor: Descriptor, values: dict[str, st.SearchStrategy[Any]]
    ) -> st.SearchStrategy[Message]:
        """Messages with each field set or not (a proto2 required one always),
        at most one of each oneof."""
        cls = message_factory.GetMessageClass(descriptor)
        plain = [
            f
            for f in descriptor.fields
            if f.containing_oneof is None and f.name in values
        ]
        choices = [
            st.sampled_from([None, *(f for f in o.fields if f.name in values)])
            for o in descriptor.oneofs
        ]

        @st.composite
        def build(draw: st.DrawFn) -> Message:
            message = cls()
            chosen = [f for f in plain if f.is_required or draw(st.booleans())]
            chosen += [f for c in choices if (f := draw(c)) is not None]
            for field in chosen:
                _assign(message, field, draw(values[field.name]))
            return message

        return build()

    def _mutants(
        self, seeds: list[Message], values: dict[str, st.SearchStrategy[Any]]
    ) -> st.SearchStrategy[Message]:
        """A seed with one or two of its fields replaced (or cleared)."""
        names = [f for f in seeds[0].DESCRIPTOR.fields if f.name in values]
        if not names:
            return st.sampled_from(seeds)
        fields = st.sampled_from(names)

        @st.composite
        def build(draw: st.DrawFn) -> Message:
            message = type(seeds[0])()
            message.CopyFrom(draw(st.sampled_from(seeds)))
            for _ in range(draw(st.integers(1, 2))):
                field = draw(fields)
                message.ClearField(field.name)
                _assign(message, field, draw(values[field.name]))
            return message

        return build()

    def _field(
        self, field: FieldDescriptor, depth: int
    ) -> st.SearchStrategy[Any] | None:
        """A whole field's values (a list, a dict for a map); None for a
        message field below the depth bound."""
        if _is_map(field):
            entry = field.message_type.fields_by_name
            key = self._single(entry["key"], depth)
            value = self._single(entry["value"], depth)
            if key is None or value is None:
                return None
            return st.dictionaries(key, value, max_size=4)
        one = self._single(field, depth)
        if one is None or not field.is_repeated:
            return one
        few, most = one, LONG_MESSAGES
        small = self._single(field, depth, huge=False)
        if field.type != FD.TYPE_MESSAGE and small is not None:
            few, most = small, LONG_LIST
        long = st.builds(
            _stretched, st.lists(few, min_size=1, max_size=3), st.integers(16, most)
        )
        return st.one_of(st.lists(one, max_size=4), long)

    def _single(
        self, field: FieldDescriptor, depth: int, huge: bool = True
    ) -> st.SearchStrategy[Any] | None:
        """One value of the field's type (one entry of a repeated field);
        ``huge``: strings and bytes may be huge-ish."""
        kind = field.type
        if kind == FD.TYPE_MESSAGE:
            if depth + 1 >= self.depth:
                return None
            return self.message(field.message_type, depth + 1)
        plain: st.SearchStrategy[Any]
        if kind in INT_BOUNDS:
            plain = _bounded(*INT_BOUNDS[kind])
        elif kind == FD.TYPE_ENUM:
            named = st.sampled_from([v.number for v in field.enum_type.values])
            closed = field.enum_type.is_closed  # proto2: unknown numbers refused
            plain = named if closed else st.one_of(named, _bounded(*_SIGNED32))
        elif kind == FD.TYPE_BOOL:
            plain = st.booleans()
        elif kind in (FD.TYPE_FLOAT, FD.TYPE_DOUBLE):
            plain = st.floats(width=32 if kind == FD.TYPE_FLOAT else 64)
        elif kind == FD.TYPE_STRING:
            plain = self._text(huge)
        else:
            plain = st.one_of(self._text(huge).map(str.encode), st.binary(max_size=24))
        hint = self._hint(field)
        return plain if hint is None else st.one_of(hint, plain)

    def _hint(self, field: FieldDescriptor) -> st.SearchStrategy[Any] | None:
        return self.hints.get(field.full_name, self.hints.get(field.name))

    def _text(self, huge: bool) -> st.SearchStrategy[str]:
        """The vocabulary's, any characters, control characters; huge-ish."""
        texts = [
            st.sampled_from(self.vocabulary),
            st.text(CHARACTERS, max_size=24),
            st.text(st.characters(max_codepoint=0x1F), max_size=8),
        ]
        if huge:
            repeated = st.text(CHARACTERS, min_size=1, max_size=3)
            texts.append(
                st.builds(operator.mul, repeated, st.integers(1_000, HUGE_REPEATS))
            )
        return st.one_of(*texts)
