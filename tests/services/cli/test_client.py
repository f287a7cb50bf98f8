"""`berth` client commands and build-models, run as a user runs them: exit
status, answers on stdout, errors on stderr (never a traceback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from services.proto.berth.v1 import berth_pb2, berth_pb2_grpc
from tests.stack import ROOT, Stack, free_ports


def berth_stdin(stdin: bytes, *args: str) -> subprocess.CompletedProcess[str]:
    """`berth ARGS` with ``stdin`` as raw bytes; its output as text."""
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        cwd=ROOT,
        env=os.environ,
        input=stdin,
        capture_output=True,
        timeout=300,
    )
    return subprocess.CompletedProcess(
        done.args, done.returncode, done.stdout.decode(), done.stderr.decode()
    )


def berth(*args: str) -> subprocess.CompletedProcess[str]:
    return berth_stdin(b"", *args)


class Echo(berth_pb2_grpc.BerthServicer):
    """Embed answers each text with its length as its token count and its
    first character's code point as its embedding; a text with "bad" in it
    is refused as the gateway refuses one, by its index in the call, and so
    is a call of more than ``max_texts``."""

    def __init__(self, max_texts: int = 256) -> None:
        self.max_texts = max_texts

    def Embed(self, request: Any, context: grpc.ServicerContext) -> Any:
        if len(request.texts) > self.max_texts:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"too many texts: {len(request.texts)} in one call, the limit is "
                f"{self.max_texts} (gateway flag --max-texts)",
            )
        for i, text in enumerate(request.texts):
            if "bad" in text:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"texts[{i}] has 999 tokens, over the limit of 512",
                )
        return berth_pb2.EmbedResponse(
            embeddings=[
                berth_pb2.Embedding(values=[float(ord(t[0]))], tokens=len(t))
                for t in request.texts
            ]
        )


def serve_echo(servicer: Echo) -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(2))
    berth_pb2_grpc.add_BerthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None)


@pytest.fixture
def echo() -> Iterator[str]:
    yield from serve_echo(Echo())


@pytest.fixture
def echo_100() -> Iterator[str]:
    """As a gateway started with --max-texts 100."""
    yield from serve_echo(Echo(max_texts=100))


def test_per_call_fits_stdin_to_a_gateways_max_texts(echo_100: str) -> None:
    lines = "".join(f"text {n}\n" for n in range(250)).encode()
    refused = berth_stdin(lines, "embed", "-", "--address", echo_100)
    assert refused.returncode == 1 and "the limit is 100" in refused.stderr
    done = berth_stdin(lines, "embed", "-", "--per-call", "100", "--address", echo_100)
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)) == 250
    bad = berth_stdin(lines, "embed", "-", "--per-call", "0", "--address", echo_100)
    assert bad.returncode == 2, bad.stderr
    assert "'0' is not a whole number of 1 or more" in bad.stderr


def test_stdin_is_utf8_with_its_byte_order_mark_dropped(echo: str) -> None:
    """A file saved with a BOM sent U+FEFF as its first text's first
    character; CRLF line ends and blank lines are not texts."""
    done = berth_stdin(
        "\ufeffab\r\n\r\n  \r\n你好吗\r\n".encode(), "embed", "-", "--address", echo
    )
    assert done.returncode == 0, done.stderr
    answers = json.loads(done.stdout)
    assert [a["tokens"] for a in answers] == [2, 3]
    assert answers[0]["embedding"] == [float(ord("a"))]


def test_stdin_that_is_not_utf8_is_refused_naming_its_line(echo: str) -> None:
    done = berth_stdin(b"fine\nla\xe9tude\n", "embed", "-", "--address", echo)
    assert done.returncode == 1 and done.stdout == "", done
    assert "Traceback" not in done.stderr, done.stderr
    assert "stdin is not UTF-8 text: line 2 has the byte 0xe9" in done.stderr


def test_an_error_names_the_stdin_line_not_the_index_in_its_call(echo: str) -> None:
    """Stdin goes in calls of 256 texts, and the gateway's texts[i] counts
    within a call: the 290th line (after one blank one) was "texts[32]"."""
    lines = [f"text {n}" for n in range(1, 300)]
    lines[9] = ""  # line 10: skipped
    lines[289] = "a bad one"  # line 290: the 289th text, the second call's 33rd
    done = berth_stdin("\n".join(lines).encode(), "embed", "-", "--address", echo)
    assert done.returncode == 1 and done.stdout == "", done
    assert "Traceback" not in done.stderr, done.stderr
    assert "error: INVALID_ARGUMENT: stdin line 290 has 999 tokens" in done.stderr, (
        done.stderr
    )


def test_build_models_names_a_bad_entry(tmp_path: Path) -> None:
    """A user's bad berth.json stops build-models with its file, field and
    value on stderr and exit status 1, not a traceback."""
    (tmp_path / "m").mkdir()
    config = tmp_path / "m" / "berth.json"
    config.write_text(json.dumps({"name": "m", "task": "embedd", "checkpoint": "."}))
    done = berth("build-models", "--model-repository", str(tmp_path))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert f"error: {config}: task" in done.stderr, done.stderr
    assert "'embedd'" in done.stderr, done.stderr


def test_client_commands(stack: Stack) -> None:
    address = ("--address", stack.gateway)
    done = berth("embed", *address, "hello world", "你好")
    assert done.returncode == 0, done.stderr
    answers = json.loads(done.stdout)
    assert [a["tokens"] for a in answers] == [4, 4]
    assert len(answers[0]["embedding"]) == 384

    done = berth("classify", *address, "set an alarm for 7 am", "--top-k", "2")
    assert done.returncode == 0, done.stderr
    (answer,) = json.loads(done.stdout)
    assert answer["label"] == "alarm" and len(answer["top"]) == 2

    # Refused requests: status and message on stderr, nothing on stdout.
    for args, expected in (
        (("embed", ""), "INVALID_ARGUMENT"),
        (("embed", "--model", "intent", "x"), "call Classify"),
        (("classify", "--model", "nope", "x"), "unknown model 'nope'"),
    ):
        done = berth(*args, *address)
        assert done.returncode == 1 and done.stdout == "", done
        assert expected in done.stderr and "Traceback" not in done.stderr, done

    (nowhere,) = free_ports(1)
    done = berth("embed", "--address", f"127.0.0.1:{nowhere}", "--timeout", "5", "x")
    assert done.returncode == 1 and "UNAVAILABLE" in done.stderr, done.stderr
