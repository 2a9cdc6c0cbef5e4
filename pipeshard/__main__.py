"""`python -m pipeshard`: the `pipeshard` command."""

import sys

from pipeshard.cli import main

sys.exit(main())
