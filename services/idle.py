"""``berth serve --idle-cpus spin``: keep idle CPUs running instead of halted.

A request crosses several processes and threads (client -> gateway's gRPC
poller -> its event loop -> batcher -> engine and back), and each hand-off
wakes a thread that is usually asleep on another CPU. On a virtual machine
whose idle CPUs halt (the H200 machine: a Firecracker guest, cpuidle driver
"none", so every idle vCPU executes HLT and leaves the guest), waking one
costs a round trip through the host: `benchmarks/grpc_floor.py` there, one
call in flight, made 1,468-1,480 unary calls/s with idle CPUs halting and
2,549-2,648 with them spinning (stream messages 4,000-4,176 against
6,053-6,293/s).

A spinner is one process per CPU, pinned to it, under the SCHED_IDLE policy:
the scheduler runs it only when nothing else wants that CPU and preempts it
at once when something does, and a CPU running only SCHED_IDLE tasks counts
as idle where the kernel places a woken task. So the vCPU never halts, and a
wake-up lands on a running one. The price is power (and, on a shared host,
the host cores the spinning vCPUs hold): every CPU shows as 100 % busy.
Use it on a machine (or a pod with dedicated CPUs) that serves berth; never
under a CPU quota (Kubernetes CPU limits): a quota counts SCHED_IDLE time too,
so the spinners would spend it and the cgroup would be throttled (`berth
serve` refuses spin where cpu_quota finds one smaller than its CPUs).

    python -m services.idle [--parent PID]   # spin until PID is gone
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path, PurePosixPath

# Choices of `berth serve --idle-cpus`.
IDLE_CHOICES = ("sleep", "spin")


def _quota_at(folder: Path) -> float | None:
    """The CPUs' worth of the CFS quota one cgroup folder sets (v2's
    cpu.max, v1's cpu.cfs_quota_us), None for none."""
    try:
        if (folder / "cpu.max").exists():
            quota, period = (folder / "cpu.max").read_text().split()
        else:
            quota = (folder / "cpu.cfs_quota_us").read_text().strip()
            period = (folder / "cpu.cfs_period_us").read_text().strip()
        return None if quota in ("max", "-1") else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def cpu_quota(
    root: Path = Path("/sys/fs/cgroup"), own: Path = Path("/proc/self/cgroup")
) -> float | None:
    """The CPUs' worth of time this process's cgroup may use: the smallest
    CFS quota of its cgroup and their parents (Kubernetes sets one on the
    container and the pod), or None without a quota or where none is read."""
    try:
        lines = own.read_text().splitlines()
    except OSError:
        return None
    folders = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if not path.startswith("/"):
            continue
        if controllers == "":  # cgroup v2
            mounts = [root]
        elif "cpu" in controllers.split(","):  # v1
            mounts = [root / controllers, root / "cpu"]
        else:
            continue
        inside = PurePosixPath(path).relative_to("/")
        # In a container without a cgroup namespace the path is the host's,
        # and the container's own cgroup is mounted as the root: "." too.
        folders += [m / f for m in mounts for f in (inside, *inside.parents)]
    quotas = [q for f in dict.fromkeys(folders) if (q := _quota_at(f)) is not None]
    return min(quotas, default=None)


def become_idle_class() -> None:
    """Put this process under SCHED_IDLE: it runs only on a CPU nothing else
    wants. (Any user may lower their own process to SCHED_IDLE.)"""
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def spin(parent: int) -> None:
    """Run until the parent (berth serve) is gone. The loop is Python's own
    bytecode; it checks the parent every 2,000,000 turns (tens of
    milliseconds), behind the PR_SET_PDEATHSIG that the supervisor sets for
    every child."""
    while True:
        for _ in range(2_000_000):
            pass
        if os.getppid() != parent:
            return


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--parent",
        type=int,
        help="exit once this process is gone (default: the parent at start; "
        "berth serve passes its pid, so a serve that died before the spinner "
        "started is noticed too)",
    )
    return parser


def main() -> int:
    args = build_parser().parse_args()
    become_idle_class()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    spin(args.parent or os.getppid())
    return 0


if __name__ == "__main__":
    sys.exit(main())
