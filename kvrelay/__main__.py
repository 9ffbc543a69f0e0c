"""``python -m kvrelay`` is the ``kvrelay`` command."""

import sys

from kvrelay.cli import main

sys.exit(main())
