"""``python -m services.cli``: the ``berth`` command."""

import sys

from services.cli import main

sys.exit(main())
