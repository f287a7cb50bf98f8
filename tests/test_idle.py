"""`berth serve --idle-cpus spin` (services/idle.py): a SCHED_IDLE spinner
pinned to each CPU, so idle CPUs run instead of halting. The serve-level
check (one spinner per CPU in a running stack, gone after it stops) is in
tests/test_inline.py, whose stack runs with the flag."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from services.cli import spinners
from services.supervisor import Child, python_module


def wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def test_one_pinned_spinner_per_cpu() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    kids = spinners()
    assert [k.cpus for k in kids] == [[c] for c in cpus]
    assert [k.name for k in kids] == [f"idle-{c}" for c in cpus]
    serve = ("--parent", str(os.getpid()))
    assert all(k.argv == python_module("services.idle", *serve) for k in kids)


def test_a_spinner_is_idle_class_pinned_and_stops_on_sigterm() -> None:
    cpu = min(os.sched_getaffinity(0))
    child = Child("idle", python_module("services.idle"), cpus=[cpu])
    child.start()
    assert child.proc is not None
    try:
        deadline = time.monotonic() + 10
        # The spinner lowers itself once its interpreter is up.
        while os.sched_getscheduler(child.proc.pid) != os.SCHED_IDLE:
            assert child.proc.poll() is None, "the spinner exited"
            assert time.monotonic() < deadline, "never became SCHED_IDLE"
            time.sleep(0.05)
        assert os.sched_getaffinity(child.proc.pid) == {cpu}
        child.stop()
        assert child.wait(5) == -15
    finally:
        child.proc.kill()


def test_a_spinner_whose_parent_is_gone_exits() -> None:
    """Behind the supervisor's PR_SET_PDEATHSIG, the spinner itself notices
    its parent is gone (here nothing sets the signal: a plain Popen)."""
    parent = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os, subprocess, sys; "
            "p = subprocess.Popen([sys.executable, '-m', 'services.idle', "
            "'--parent', str(os.getpid())], "
            "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
            "print(p.pid)",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    spinner = int(parent.stdout.strip())
    try:
        assert wait_gone(spinner, 10), "the orphaned spinner kept spinning"
    finally:
        if not wait_gone(spinner, 0):
            os.kill(spinner, 9)
