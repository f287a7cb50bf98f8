"""`berth` client commands and build-models, run as a user runs them: exit
status, answers on stdout, errors on stderr (never a traceback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.stack import ROOT, Stack, free_ports


def berth(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        cwd=ROOT,
        env=os.environ,
        capture_output=True,
        text=True,
        timeout=300,
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
