"""The application floor: the `broker` command (commands.py) and what only it runs: its settings, the embedded
PostgreSQL, the processes it starts, `broker status`, `broker diagnose` and the demo.  The library floor (the rest
of package broker) never imports it."""
