"""Batcher: length-bucketed queues that pack padded token batches for engines.

What other packages use of it (a gateway that batches inline): the batcher's
work in one process (:class:`LocalBatcher`) and its settings with their flags.
"""

from batcher.local import LocalBatcher
from batcher.options import SchedulerConfig, add_scheduler_flags, scheduler_config

__all__ = ["LocalBatcher", "SchedulerConfig", "add_scheduler_flags", "scheduler_config"]
