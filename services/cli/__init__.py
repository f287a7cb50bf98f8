"""The ``berth`` command: serve, call a running gateway, build models.

Everything the command does beyond the runtime plumbing of services/:
planning and supervising `berth serve`'s processes (plan, topology, ports,
supervisor), the client commands (client) and the default models
(default_models). The runtime plumbing in services/ and the service
processes never import it.
"""

from services.cli.parser import build_parser, main

__all__ = ["build_parser", "main"]
