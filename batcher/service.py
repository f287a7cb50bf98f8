"""The batcher's gRPC face: one long-lived Submit stream per gateway."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from batcher.local import LocalBatcher
from batcher.sequences import Deliver, answer_all
from services.proto.berth.v1 import internal_pb2, internal_pb2_grpc

log = logging.getLogger("berth.batcher")

# Results are sent in groups: whatever is ready when the writer wakes, up to
# this many per message, so a busy stream sends few large messages.
MAX_RESULTS_PER_MESSAGE = 512

# A stream's queued sequences: the gateway's sequence id -> (model, key in
# that model's scheduler).
Queued = dict[int, tuple[str, int]]


class BatcherService(internal_pb2_grpc.BatcherServicer):
    """Multiplexes gateways' sequences into the per-model schedulers."""

    def __init__(self, batcher: LocalBatcher) -> None:
        self.batcher = batcher

    async def Models(
        self,
        request: internal_pb2.BatcherModelsRequest,
        context: grpc.aio.ServicerContext,
    ) -> internal_pb2.BatcherModels:
        return self.batcher.describe()

    async def Submit(
        self,
        request_iterator: AsyncIterator[internal_pb2.GatewayMessage],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[internal_pb2.BatcherMessage]:
        out: asyncio.Queue[internal_pb2.SequenceResult | None] = asyncio.Queue()
        queued: Queued = {}

        answered = asyncio.Event()  # set once nothing is left queued

        def deliver(result: internal_pb2.SequenceResult) -> None:
            queued.pop(result.id, None)
            out.put_nowait(result)
            if not queued:
                answered.set()

        async def read() -> None:
            try:
                async for message in request_iterator:
                    for group in message.sequences:
                        self._submit(group, deliver, out.put_nowait, queued)
                    for seq_id in message.cancel.ids:
                        entry = queued.pop(seq_id, None)
                        if entry is not None:
                            self.batcher.cancel(*entry)
                # The gateway closed its side only (a hang-up cancels this
                # task): it still reads, so what it sent is answered first.
                while queued:
                    answered.clear()
                    await answered.wait()
            finally:
                # The gateway hung up: nobody is left to answer.
                for model, key in queued.values():
                    self.batcher.cancel(model, key)
                out.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (first := await out.get()) is not None:
                results = [first]
                while not out.empty() and len(results) < MAX_RESULTS_PER_MESSAGE:
                    item = out.get_nowait()
                    if item is None:
                        out.put_nowait(None)
                        break
                    results.append(item)
                yield internal_pb2.BatcherMessage(results=results)
        finally:
            reader.cancel()

    def _submit(
        self,
        group: internal_pb2.Sequences,
        deliver: Deliver,
        reply: Deliver,
        queued: Queued,
    ) -> None:
        """Queue one entry with its model's scheduler, which answers it at
        once if malformed (:func:`batcher.sequences.malformed`) or refused
        (:meth:`batcher.local.LocalBatcher.submit`).

        ``deliver`` answers a queued id and forgets it; ``reply`` only sends
        the answer. An id this stream still waits on is refused through
        ``reply``: its queued namesake keeps its place in ``queued``, so that
        it can still be cancelled, and the stream waits for its answer.

        An error queuing the entry (a bug) fails its ids alone: raised in the
        stream's reader it would end the whole stream, every request of the
        gateway in flight on it, for one bad entry."""
        try:
            if not queued.keys().isdisjoint(group.ids):
                code = grpc.StatusCode.INVALID_ARGUMENT
                answer_all(group.ids, code, reused(group, queued), reply)
                return
            for seq_id, key in self.batcher.submit(group, deliver):
                queued[seq_id] = (group.model, key)
        except Exception as exc:
            log.exception("queuing sequences %s for %r failed", group.ids, group.model)
            message = (
                f"batcher failed to queue sequences for model {group.model!r}: "
                f"{type(exc).__name__}: {exc}"
            )
            answer_all(group.ids, grpc.StatusCode.INTERNAL, message, reply)


def reused(group: internal_pb2.Sequences, queued: Queued) -> str:
    """Why an entry with an id this stream still waits on is refused."""
    taken = next(seq_id for seq_id in group.ids if seq_id in queued)
    return (
        f"malformed Sequences for model {group.model!r}: sequence id "
        f"{taken} is already queued on this stream (ids must be unique "
        "among a stream's unanswered sequences)"
    )
