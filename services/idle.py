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
under a CPU quota (Kubernetes CPU limits): a quota counts SCHED_IDLE time too.

    python -m services.idle [--parent PID]   # spin until PID is gone
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

# Choices of `berth serve --idle-cpus`.
IDLE_CHOICES = ("sleep", "spin")


def become_idle_class() -> None:
    """Put this process under SCHED_IDLE: it runs only on a CPU nothing else
    wants. (Any user may lower their own process to SCHED_IDLE.)"""
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def spin(parent: int) -> None:
    """Run until the parent (berth serve) is gone. The loop is Python's own
    bytecode; it checks the parent a few times a second, behind the
    PR_SET_PDEATHSIG that the supervisor sets for every child."""
    while True:
        for _ in range(2_000_000):
            pass
        if os.getppid() != parent:
            return


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--parent",
        type=int,
        help="exit once this process is gone (default: the parent at start; "
        "berth serve passes its pid, so a serve that died before the spinner "
        "started is noticed too)",
    )
    args = parser.parse_args()
    become_idle_class()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    spin(args.parent or os.getppid())
    return 0


if __name__ == "__main__":
    sys.exit(main())
