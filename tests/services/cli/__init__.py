"""Tests of the `berth` command (services/cli/)."""
