"""``python -m scalestate``: the same as the ``scalestate`` command."""

import sys

from scalestate.cli import main

sys.exit(main())
