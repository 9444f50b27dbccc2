"""`python -m broker.cli` is the `broker` command."""
from broker.cli.commands import main

main()
