"""`python -m aqpipe` is the `aqpipe` command."""

from aqpipe.cli import console

console()
