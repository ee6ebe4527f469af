"""The `afd` command line. It only builds validated objects and calls the library; each command's flags and
handler live in their own module, and this one assembles them.

Bad input is one sentence on stderr and exit status 2, never a traceback. A signal (Ctrl-C, SIGTERM,
SIGHUP) ends any command with one line and exit status 128 + the signal number, as shells expect.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence

from afd.cli import bench as cli_bench
from afd.cli import export as cli_export
from afd.cli import generate as cli_generate
from afd.cli import info as cli_info
from afd.cli import planning as cli_planning
from afd.cli import serve as cli_serve
from afd.cli import worker as cli_worker
from afd.cli.input import UsageError
from afd.config import InputError
from afd.distributed import signals

EXIT_USAGE = 2


class _HelpFormatter(argparse.HelpFormatter):
    """Every flag's help ends with its default, when it has one worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        hidden = default is None or default is False or default == argparse.SUPPRESS  # 0 is shown, False is not
        if action.option_strings and "%(default)" not in text and not hidden:
            text += " (default: %(default)s)"
        return text


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"afd: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="afd", description="Attention-FFN disaggregated serving of DeepSeek-V2/V3 MoE models.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level (every rank's log lines)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    cli_info.add_info_parsers(sub)  # topology, config
    cli_generate.add_generate_parsers(sub)  # generate, launch
    cli_worker.add_worker_parser(sub)
    cli_serve.add_serve_parser(sub)
    cli_generate.add_demo_parser(sub)
    cli_bench.add_bench_parser(sub)  # bench, and under it step, exchange, serve
    cli_export.add_export_parser(sub)
    cli_planning.add_planning_parsers(sub)  # simulate, plan, profile
    return parser


# ---------------------------------------------------------------- main
watchdog = signals.SignalWatchdog()  # the running command's (its handler reaches it as args.signal_watchdog)


def main(argv: Sequence[str] | None = None) -> int:
    global watchdog
    watchdog = signals.SignalWatchdog()
    previous: dict = {}
    try:  # a signal may land while the handlers and the watchdog start: that is one line too
        previous = signals.install_handlers()
        watchdog.start()
        return _run(argv)
    except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM, SIGHUP: here or inside the launcher
        signum = int(getattr(exc, "signum", signal.SIGINT))
        print(f"afd: interrupted by {signals.signal_name(signum)}", file=sys.stderr)
        return 128 + signum
    except Exception:
        seen = signals.last_signal()
        if seen is None:
            raise
        # the interrupt hit an import and came out as another error (numpy: "cannot load module more than once")
        print(f"afd: interrupted by {signals.signal_name(seen)}", file=sys.stderr)
        return 128 + seen
    finally:
        watchdog.stop()
        signals.restore_handlers(previous)


def _run(argv: Sequence[str] | None) -> int:
    """The command itself. torch and the runtime are imported only in here, after the signal handlers are
    in place: a Ctrl-C during those seconds of imports is then one line too, not a traceback."""
    args = build_parser().parse_args(argv)
    args.signal_watchdog = watchdog  # the command's handler may lengthen its grace (a server's drain)
    logging.basicConfig(
        level=logging.INFO
        if args.verbose or args.command == "worker"
        else logging.WARNING,  # a rank logs like a server
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    if getattr(args, "starts_ranks", False):  # the ranks' zygote imports torch beside this process's own imports
        from afd.runtime.zygote import prestart

        prestart()
    try:
        return args.func(args)
    except (UsageError, InputError) as exc:
        print(f"afd: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:
        launch = sys.modules.get("afd.runtime.launch")  # loaded whenever a LaunchError can have been raised
        if launch is None or not isinstance(exc, launch.LaunchError):
            raise
        print(f"afd: error: {exc}", file=sys.stderr)
        return getattr(exc, "exit_status", 1)
