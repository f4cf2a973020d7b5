"""``python -m hybridshard`` runs the command-line interface."""

import sys

from hybridshard.cli import main

sys.exit(main())
