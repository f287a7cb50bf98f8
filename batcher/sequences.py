"""Sequences at the batcher: an entry's check, its waiters, its error answers."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc
import numpy as np

from services.proto.berth.v1 import internal_pb2
from services.telemetry import Span

Deliver = Callable[[internal_pb2.SequenceResult], None]


@dataclass
class Waiter:
    """Who gets the answer of one queued sequence, and its queue span."""

    reply_id: int
    deliver: Deliver
    enqueued_at: float
    span: Span


def error_result(
    reply_id: int, code: grpc.StatusCode, message: str
) -> internal_pb2.SequenceResult:
    """The answer of a sequence that failed: its status code and why."""
    return internal_pb2.SequenceResult(id=reply_id, code=code.value[0], message=message)


def answer_all(
    ids: Iterable[int], code: grpc.StatusCode, message: str, send: Deliver
) -> None:
    """Answer each of ``ids`` with one error."""
    for seq_id in ids:
        send(error_result(seq_id, code, message))


def malformed(group: internal_pb2.Sequences, max_tokens: int) -> str | None:
    """What is wrong with one Sequences entry, naming the field and its value;
    None when it is well-formed.

    The gateway never sends a malformed entry, but another client of the
    internal API (or a bug) may: token bytes that are no whole number of
    int32 (which would make the batcher's stream handler raise, ending the
    stream and every request on it), offsets that do not tile token_ids from
    0 to its end (a sequence's tokens would be cut from the wrong place, or
    the tail ignored), a sequence of no tokens or more than the model takes,
    or an id twice (two answers for one id). Sequences are checked in order
    and the first fault is named by its sequence's id. (The core checks
    lengths and bounds too, as a last line, but names neither ids nor the
    model.)

    It runs for every request: 1.05 µs for one sequence on the dev machine,
    where all of ModelScheduler.submit takes 7 to 8.
    """
    ids = group.ids
    n = len(ids)
    token_bytes, offset_bytes = len(group.token_ids), len(group.offsets)
    if not n:
        return "ids is empty"
    if token_bytes % 4:
        return (
            f"token_ids holds {token_bytes} bytes, not a whole number of int32 "
            "tokens (a multiple of 4)"
        )
    if offset_bytes % 4:
        return (
            f"offsets holds {offset_bytes} bytes, not a whole number of int32 "
            "offsets (a multiple of 4)"
        )
    if offset_bytes // 4 != n + 1:
        return (
            f"offsets holds {offset_bytes // 4} entries; {n} ids need "
            f"len(ids) + 1 = {n + 1}"
        )
    offsets = memoryview(group.offsets).cast("i")
    n_tokens = token_bytes // 4
    if offsets[0] != 0:
        return f"offsets[0] is {offsets[0]}; it must be 0"
    start = 0
    for i in range(n):
        end = offsets[i + 1]
        if end > n_tokens:
            return (
                f"offsets[{i + 1}] = {end} is past the {n_tokens} tokens of "
                f"token_ids (sequence id {ids[i]})"
            )
        if end < start:
            return (
                f"offsets decrease at sequence id {ids[i]}: offsets[{i}] = "
                f"{start} > offsets[{i + 1}] = {end}"
            )
        if end == start:
            return (
                f"sequence id {ids[i]} has no tokens (offsets[{i}] = "
                f"offsets[{i + 1}] = {end})"
            )
        if end - start > max_tokens:
            return (
                f"sequence id {ids[i]} has {end - start} tokens; the model takes "
                f"at most {max_tokens}"
            )
        start = end
    if start != n_tokens:
        return f"offsets end at {start}, but token_ids holds {n_tokens} tokens"
    if len(set(ids)) != n:
        seen: set[int] = set()
        for seq_id in ids:
            if seq_id in seen:
                return f"sequence id {seq_id} appears twice in ids"
            seen.add(seq_id)
    return None


def outside_vocabulary(group: internal_pb2.Sequences, vocab: int) -> dict[int, str]:
    """The sequences (by index in ``group``) holding a token id outside
    [0, vocab), each with what is wrong; empty when all are inside. The
    entry must be well-formed (:func:`malformed`).

    One pass over the ids when all are inside (negative ids are huge as
    uint32): 2 µs for a 128-token request on the dev machine."""
    tokens = np.frombuffer(group.token_ids, dtype="<u4")
    if not tokens.size or int(tokens.max()) < vocab:
        return {}
    offsets = np.frombuffer(group.offsets, dtype="<i4")
    outside = tokens >= vocab
    found: dict[int, str] = {}
    for index in np.flatnonzero(np.logical_or.reduceat(outside, offsets[:-1])):
        start, end = int(offsets[index]), int(offsets[index + 1])
        position = int(np.argmax(outside[start:end]))
        value = int(tokens[start + position : start + position + 1].view("<i4")[0])
        found[int(index)] = (
            f"sequence id {group.ids[index]} has token id {value} at position "
            f"{position}, outside the model's vocabulary [0, {vocab})"
        )
    return found


def without(
    group: internal_pb2.Sequences, drop: Iterable[int]
) -> internal_pb2.Sequences:
    """``group`` less the sequences at the indices ``drop``."""
    dropped = set(drop)
    tokens = np.frombuffer(group.token_ids, dtype="<i4")
    offsets = np.frombuffer(group.offsets, dtype="<i4")
    keep = [i for i in range(len(group.ids)) if i not in dropped]
    parts = [tokens[offsets[i] : offsets[i + 1]] for i in keep]
    kept_offsets = np.zeros(len(keep) + 1, dtype="<i4")
    np.cumsum([part.size for part in parts], out=kept_offsets[1:])
    return internal_pb2.Sequences(
        model=group.model,
        ids=[group.ids[i] for i in keep],
        token_ids=np.concatenate(parts).tobytes() if parts else b"",
        offsets=kept_offsets.tobytes(),
        timeout_ms=group.timeout_ms,
        trace_context=group.trace_context,
    )
