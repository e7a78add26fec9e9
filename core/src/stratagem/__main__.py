"""``python -m stratagem`` is the ``stratagem`` command."""

import sys

from stratagem.cli import main

sys.exit(main())
