"""``python -m dspark_core.cli``: the ``dspark`` command (torchrun and subprocess launches use it)."""

import sys

from dspark_core.cli.main import main

sys.exit(main())
