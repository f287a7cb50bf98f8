"""Flags whose defaults come from BERTH_* environment variables: every value
an operator may write is read as meant, and a wrong one is named."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.cli import build_parser
from tests.stack import ROOT


def serve_args(monkeypatch: pytest.MonkeyPatch, **env: str) -> dict[str, object]:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return vars(build_parser().parse_args(["serve"]))


@pytest.mark.parametrize("raw", ["1", "true", "True", "YES", "on", " true "])
def test_true_spellings(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    args = serve_args(monkeypatch, BERTH_BUILD_MODELS="false")
    assert args["build_models"] is False
    assert serve_args(monkeypatch, BERTH_BUILD_MODELS=raw)["build_models"] is True


@pytest.mark.parametrize("raw", ["0", "false", "False", "NO", "off", " off\n"])
def test_false_spellings(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    assert serve_args(monkeypatch, BERTH_BUILD_MODELS=raw)["build_models"] is False


def test_numbers_and_strings(monkeypatch: pytest.MonkeyPatch) -> None:
    args = serve_args(
        monkeypatch,
        BERTH_PORT="6000",
        BERTH_METRICS_PORT=" 0 ",
        BERTH_HOST="0.0.0.0",
    )
    assert (args["port"], args["metrics_port"], args["host"]) == (6000, 0, "0.0.0.0")
    from batcher.__main__ import parse_args  # float flags

    monkeypatch.setenv("BERTH_MAX_DELAY_MS", "0")
    monkeypatch.setenv("BERTH_HEDGE_RATIO", "0.25")
    args = parse_args([])
    assert (args.max_delay_ms, args.hedge_ratio) == (0.0, 0.25)


def test_an_empty_variable_is_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """`BERTH_X=` (as a compose file or an env file writes it) is no value:
    the flag keeps its default, as OpenTelemetry's own variables do."""
    args = serve_args(
        monkeypatch,
        BERTH_PORT="",
        BERTH_BUILD_MODELS="",
        BERTH_HOST="",
        BERTH_MODEL_REPOSITORY="",
    )
    assert args["port"] == 50051
    assert args["build_models"] is True
    assert args["host"] == "127.0.0.1"
    assert args["model_repository"] == "model_repository"


@pytest.mark.parametrize(
    ("name", "raw", "flag"),
    [
        ("BERTH_PORT", "50051x", "--port"),
        ("BERTH_PORT", "9000.0", "--port"),
        ("BERTH_BUILD_MODELS", "ture", "--build-models"),
    ],
)
def test_a_malformed_variable_is_named(name: str, raw: str, flag: str) -> None:
    """Not a traceback, nor a silent False: the variable, its value and the
    flag it sets."""
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "health", "--help"],
        cwd=ROOT,
        env={**os.environ, name: raw},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert name in done.stderr and repr(raw) in done.stderr, done.stderr
    assert flag in done.stderr, done.stderr


def logging_python(code: str, level: str) -> subprocess.CompletedProcess[str]:
    """``python -c code`` with BERTH_LOG_LEVEL=level."""
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "BERTH_LOG_LEVEL": level},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_log_level(tmp_path: Path) -> None:
    def run(level: str) -> subprocess.CompletedProcess[str]:
        code = "from services.logs import setup_logging; setup_logging('x').info('hi')"
        return logging_python(code, level)

    for level in ("", "info", " debug "):
        done = run(level)
        assert done.returncode == 0 and "hi" in done.stderr, done.stderr
    done = run("verbose")
    assert done.returncode != 0
    assert "BERTH_LOG_LEVEL='verbose'" in done.stderr, done.stderr
    assert "WARNING" in done.stderr, done.stderr  # says what to write instead


def test_chatty_libraries_log_warnings_only_unless_debug(tmp_path: Path) -> None:
    """torch.onnx's exporter (via onnx_ir) logs a line per step at INFO:
    hundreds per export of the default models, burying berth's own lines."""

    def run(level: str) -> str:
        code = (
            "import logging; from services.logs import setup_logging; "
            "setup_logging('x'); "
            "logging.getLogger('onnx_ir.passes.common').info('dedup'); "
            "logging.getLogger('onnx_ir.passes.common').warning('odd'); "
            "logging.getLogger('berth.x').info('ours')"
        )
        done = logging_python(code, level)
        assert done.returncode == 0, done.stderr
        return done.stderr

    quiet = run("info")
    assert "ours" in quiet and "odd" in quiet and "dedup" not in quiet, quiet
    assert "dedup" in run("debug")


def test_a_line_logged_in_a_traced_call_carries_its_trace_id() -> None:
    """A line logged while a call's context is current ends with its trace
    id, so it leads to the trace in Jaeger; one logged outside any carries
    none."""
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    code = (
        "from opentelemetry import context; "
        "from services.logs import setup_logging; "
        "from services.telemetry import extract; "
        "log = setup_logging('x'); log.info('outside'); "
        f"ctx = extract({{'traceparent': '00-{trace_id}-00f067aa0ba902b7-01'}}); "
        "token = context.attach(ctx); log.info('inside'); context.detach(token)"
    )
    done = logging_python(code, "info")
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    (inside,) = [line for line in lines if "inside" in line]
    (outside,) = [line for line in lines if "outside" in line]
    assert inside.endswith(f"inside trace={trace_id}"), inside
    assert "trace=" not in outside, outside
