"""Tests of the runtime plumbing in services/."""
