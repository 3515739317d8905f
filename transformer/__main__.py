"""`python -m transformer ...` runs the `transformer` command."""

import sys

from .cli import main

sys.exit(main())
