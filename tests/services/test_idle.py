"""`berth serve --idle-cpus spin` (services/idle.py): a SCHED_IDLE spinner
pinned to each CPU, so idle CPUs run instead of halting. The serve-level
check (one spinner per CPU in a running stack, gone after it stops) is in
tests/test_inline.py, whose stack runs with the flag."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.cli.supervisor import Child, python_module
from services.cli.topology import spinners
from services.idle import cpu_quota


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


def test_a_child_whose_cpu_left_serves_set_restarts_on_serves_cpus() -> None:
    """serve's CPU set can shrink while it runs (a cpuset changed under it):
    a spinner (or a --cpu-affinity spread child) restarted after its CPU
    left failed to pin in the fork, and the error ended serve and its whole
    stack. It runs on serve's CPUs instead."""
    allowed = os.sched_getaffinity(0)
    gone = max(allowed) + 1  # a CPU serve may not use
    child = Child("idle-gone", python_module("services.idle"), cpus=[gone])
    child.start()
    assert child.proc is not None
    try:
        assert child.proc.poll() is None
        assert os.sched_getaffinity(child.proc.pid) == allowed
    finally:
        child.proc.kill()
        child.proc.wait()


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cpu_quota_reads_the_cgroups_cfs_quota(tmp_path: Path) -> None:
    own = tmp_path / "cgroup"
    root = tmp_path / "sys"
    # v2, Kubernetes: the container's quota and the pod's; the smaller counts.
    write(own, "0::/kubepods/pod1/ctr\n")
    write(root / "kubepods/pod1/ctr/cpu.max", "150000 100000\n")
    write(root / "kubepods/pod1/cpu.max", "400000 100000\n")
    write(root / "kubepods/cpu.max", "max 100000\n")
    assert cpu_quota(root, own) == 1.5
    write(root / "kubepods/pod1/ctr/cpu.max", "max 100000\n")
    write(root / "kubepods/pod1/cpu.max", "max 100000\n")
    assert cpu_quota(root, own) is None
    # v1 inside a container without a cgroup namespace: the path is the
    # host's, the container's cgroup is the mount itself.
    write(own, "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n")
    write(root / "cpu,cpuacct/cpu.cfs_quota_us", "50000\n")
    write(root / "cpu,cpuacct/cpu.cfs_period_us", "100000\n")
    assert cpu_quota(root, own) == 0.5
    write(root / "cpu,cpuacct/cpu.cfs_quota_us", "-1\n")
    assert cpu_quota(root, own) is None
    assert cpu_quota(root, tmp_path / "no-such-file") is None


def test_serve_refuses_to_spin_under_a_cpu_quota(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """A quota counts SCHED_IDLE time too: under Kubernetes CPU limits the
    spinners spent the quota on every idle CPU and the whole cgroup, berth
    with it, was throttled for the rest of each period."""
    from services.cli import main, serve

    cpus = len(os.sched_getaffinity(0))
    monkeypatch.setattr(serve, "cpu_quota", lambda: cpus - 0.5)
    argv = ["serve", "--idle-cpus", "spin", "--model-repository", str(tmp_path)]
    assert main(argv) == 2
    assert f"under a CPU quota of {cpus - 0.5:.2f} CPU(s)" in caplog.text
    assert "--idle-cpus sleep" in caplog.text
