"""``python -m helpers``: see helpers.cli."""

import sys

from helpers.cli import main

sys.exit(main())
