"""`python -m components.cli ...`: the `sao` command."""

import sys

from components.cli.main import main

sys.exit(main())
