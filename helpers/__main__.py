"""``python -m helpers``: see helpers.course.cli."""

import sys

from helpers.course.cli import main

sys.exit(main())
