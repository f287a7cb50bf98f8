"""SIGTERM drains: in-flight calls finish, then every process exits cleanly.

This stack runs the batcher's pure-Python twin (BERTH_PURE_PYTHON=1), so the
whole path is exercised with both batcher implementations.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import grpc

from services.proto.berth.v1 import berth_pb2, berth_pb2_grpc
from tests.stack import Stack


def test_sigterm_finishes_in_flight_calls(repository: Path) -> None:
    stack = Stack(repository, engines=2, env={"BERTH_PURE_PYTHON": "1"})
    try:
        stack.wait_serving()
        assert "batcher core: python" in stack.logs()
        outcomes: list[str] = []
        finished: list[float] = []
        lock = threading.Lock()
        # ~250 tokens each (minilm takes 256), 20 a call: seconds of work for
        # two CPU engines, so the calls are still running when the gateway's
        # lame duck ends.
        text = " ".join(["a long enough sentence to take the engine a while"] * 25)

        def call() -> None:
            with grpc.insecure_channel(stack.gateway) as channel:
                stub = berth_pb2_grpc.BerthStub(channel)
                try:
                    reply = stub.Embed(
                        berth_pb2.EmbedRequest(
                            model="minilm",
                            texts=[f"{i} {text}" for i in range(20)],
                        ),
                        timeout=90,
                    )
                    result = f"ok:{len(reply.embeddings)}"
                except grpc.RpcError as exc:
                    result = exc.code().name
            with lock:
                outcomes.append(result)
                finished.append(time.monotonic())

        threads = [threading.Thread(target=call) for _ in range(6)]
        for t in threads:
            t.start()
        time.sleep(0.5)  # the calls are in flight
        signalled = time.monotonic()
        stack.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(90)
        code = stack.proc.wait(90)
    finally:
        stack.stop()
    after = [round(t - signalled, 2) for t in finished]
    print("outcomes after SIGTERM:", outcomes, "finished after it (s):", after)
    # The drain held calls that outlived the gateway's 0.5 s lame duck.
    assert max(after) > 1.0, "no call outlived the lame duck: the test proves nothing"
    assert outcomes == ["ok:20"] * 6
    assert code == 0, stack.logs()
    logs = stack.logs()
    for name in ("gateway", "batcher", "engine-0", "engine-1"):
        assert f"{name} stopped (exit code 0)" in logs, logs
