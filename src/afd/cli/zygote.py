"""The zygote's entry, `python -m afd.cli.zygote FD PID ROOM`: `afd.runtime.zygote.main` with the CLI as what each
forked rank runs, and the rank runtime (torch, engine, model, connectors) imported once before any fork."""

import afd.runtime.worker  # noqa: F401 - the rank runtime, shared by every forked rank
from afd.cli.main import main as cli_main
from afd.runtime.zygote import main

if __name__ == "__main__":
    main(cli_main)
