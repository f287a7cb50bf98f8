"""Shared plumbing for berth's services: config, servers, channels, errors."""
