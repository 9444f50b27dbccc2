"""`python -m bench`: the same as `broker bench`."""
import sys

from broker.cli.commands import app

app(["bench", *sys.argv[1:]], prog_name="python -m bench")
