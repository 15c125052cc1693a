"""``python -m kmgpu demo|bench|launch ...``: the ``kmgpu`` command."""

import sys

from kmgpu.commands.cli import main

sys.exit(main())
