"""`python -m aqpipe` is the `aqpipe` command."""

import sys

from aqpipe.cli import main

sys.exit(main())
