"""`berth serve` while its children start: one that dies is restarted with
back-off; one that cannot start at all makes serve exit non-zero, naming it,
instead of waiting for good; bad flags are refused up front."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.stack import ROOT, Stack, _free_run, children, free_ports


def test_a_child_that_dies_while_starting_is_restarted(repository: Path) -> None:
    # engine-0's /metrics port (base + 2) is taken after serve checked its
    # ports (a port taken before that is refused: test_serve_ports.py) and
    # before engine-0 listens on it (held stopped meanwhile): it exits.
    base = _free_run(4)
    held = socket.socket()
    stack = Stack(repository, extra_args=["--metrics-port", str(base)])
    try:
        engine = engine_pid(stack)
        os.kill(engine, signal.SIGSTOP)
        try:
            held.bind(("127.0.0.1", base + 2))
            held.listen()
        finally:
            os.kill(engine, signal.SIGCONT)
        deadline = time.monotonic() + 60
        while "engine-0 exited with code 1" not in stack.logs():
            assert stack.proc.poll() is None, stack.logs()
            assert time.monotonic() < deadline, f"no restart:\n{stack.logs()}"
            time.sleep(0.2)
        said = [line for line in stack.logs().splitlines() if "--metrics-port" in line]
        in_use = f":{base + 2}: Address already in use"
        assert any(in_use in line for line in said), stack.logs()
        held.close()  # free again: the restarted engine starts
        stack.wait_serving(timeout=60)
    finally:
        held.close()
        code = stack.stop()
    assert code == 0, stack.logs()


def engine_pid(stack: Stack, timeout: float = 30) -> int:
    """engine-0's pid, as soon as serve has started it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        started = re.search(r"started engine-0 \(pid (\d+)\)", stack.logs())
        if started:
            return int(started.group(1))
        assert stack.proc.poll() is None, stack.logs()
        time.sleep(0.01)
    raise TimeoutError(f"engine-0 not started:\n{stack.logs()}")


def test_a_child_that_cannot_start_fails_serve(tmp_path: Path) -> None:
    entry = tmp_path / "repository" / "m"
    entry.mkdir(parents=True)
    (entry / "berth.json").write_text(
        json.dumps({"name": "m", "task": "embedd", "checkpoint": "."})
    )
    stack = Stack(entry.parent)
    try:
        kids: set[int] = set()
        deadline = time.monotonic() + 90
        while stack.proc.poll() is None and time.monotonic() < deadline:
            kids |= set(children(stack.proc.pid))
            time.sleep(0.2)
        code = stack.proc.poll()
    finally:
        stack.stop()
    logs = stack.logs()
    assert code not in (None, 0), f"berth serve still running or exited 0:\n{logs}"
    assert "task must be one of" in logs  # the child's own reason is shown...
    assert "before berth served: giving up" in logs, logs  # ...and serve's
    alive = [pid for pid in kids if Path(f"/proc/{pid}").exists()]
    assert not alive, f"left behind: {alive}"


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--engines", "-1"], "--engines"),
        (["--gateways", "-2"], "--gateways"),
        (["--batchers", "-1"], "--batchers"),
    ],
)
def test_bad_counts_are_refused(flags: list[str], says: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "serve", *flags],
        cwd=ROOT,
        env={**os.environ, "BERTH_BUILD_MODELS": "0"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert says in done.stderr, done.stderr


def test_a_children_s_variable_does_not_change_the_topology(repository: Path) -> None:
    """BERTH_ENGINES is the batcher's (and an inline gateway's) engine list;
    set where serve runs (say, as a count of engines), it must not turn
    serve's gateway into an inline one batching to address "2". Nor may
    BERTH_GPU_BUCKETS make the batcher batch to GPU lengths its CPU engines
    do not serve."""
    stack = Stack(repository, env={"BERTH_ENGINES": "2", "BERTH_GPU_BUCKETS": "1"})
    try:
        stack.wait_serving(timeout=60)
    finally:
        code = stack.stop()
    assert code == 0, stack.logs()
    assert "'minilm': [12, 16, 24, 32, 48, 64, 96, 128, 256]" in stack.logs()


def test_a_batcher_told_its_engines_are_gpus_batches_to_gpu_buckets(
    tmp_path: Path,
) -> None:
    """`--gpu-buckets` (serve passes it when its engines are GPUs): each model's
    gpu_buckets, the lengths a GPU engine captures graphs for. A repository of
    its own: one built before gpu_buckets (make does not rebuild it) has none."""
    from services.cli.default_models import minilm_checkpoint

    repository = tmp_path / "repo"
    (repository / "m").mkdir(parents=True)
    (repository / "m" / "berth.json").write_text(
        json.dumps(
            {
                "name": "m",
                "task": "embed",
                "checkpoint": str(minilm_checkpoint()),
                "buckets": [12, 24],
                "gpu_buckets": [64, 16],
                "max_tokens": 128,
            }
        )
    )
    port, metrics = free_ports(2)
    with subprocess.Popen(
        [
            *(sys.executable, "-m", "batcher", "--gpu-buckets"),
            *("--port", str(port), "--metrics-port", str(metrics)),
            *("--engines", "127.0.0.1:1", "--model-repository", str(repository)),
        ],
        cwd=ROOT,
        env={**os.environ, "BERTH_LOG_LEVEL": "INFO"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as proc:
        assert proc.stdout is not None
        line = ""
        for line in proc.stdout:
            if "batcher core:" in line:
                break
        proc.terminate()
    assert "'m': [16, 64, 128]" in line, line
