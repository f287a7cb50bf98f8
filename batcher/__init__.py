"""Batcher: length-bucketed queues that pack padded token batches for engines."""
