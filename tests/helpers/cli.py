"""The command line run in this process: `afd`'s exit status and stderr without an interpreter start."""

from __future__ import annotations

import pytest

from afd.cli import main as cli


def main_exit(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str]:
    """`afd.cli.main.main` in this process (no interpreter start): its exit status and stderr."""
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:  # argparse rejects a flag's value
        code = exc.code
    return code, capsys.readouterr().err
