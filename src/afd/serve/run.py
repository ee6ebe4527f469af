"""A whole `afd serve`: bind the HTTP port, start the ranks, wait for every replica's hello, serve, stop.

The order is what makes failures clean: the HTTP port is bound first (a port in use stops everything
before any rank starts), the ranks start next, and the front end starts answering only once every replica
said hello. A rank that dies during start-up fails it at once with that rank's own explanation; one that dies
while serving is restarted (`afd.serve.healing`). SIGTERM, SIGINT and SIGHUP stop the server gracefully
(`server.serve`), then the ranks are stopped and checked.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from afd.config import AFDConfig
from afd.distributed import signals
from afd.runtime.launch import LaunchError
from afd.runtime.link import FrontLink, LinkError
from afd.runtime.spec import RunSpec
from afd.serve import DRAIN_S, loop

if TYPE_CHECKING:  # the serving stack is imported only to serve (`ServerProcess` runs without it)
    from afd.serve.healing import HealPolicy
    from afd.serve.state import ServeOptions, ServerState
    from afd.serve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

RANK_STOP_GRACE_S = 5.0
REPLICA_BYE_S = 5.0
# a graceful stop: the drain, the HTTP teardown, every replica's bye, the ranks' exit (the CLI watchdog's grace)
DRAIN_BUDGET_S = DRAIN_S + 2.0 + REPLICA_BYE_S + 2 * RANK_STOP_GRACE_S + 5.0


class ServeError(Exception):
    """The server could not be started as asked (one sentence); `exit_status` 2 is bad input (a port in use)."""

    def __init__(self, message: str, exit_status: int = 1) -> None:
        super().__init__(message)
        self.exit_status = exit_status


@dataclass
class ServePlan:
    """Everything `afd serve` was asked for, checked by the CLI."""

    spec: RunSpec
    config: AFDConfig | None  # None: connector none, `replicas` whole-model replicas
    replicas: int
    host: str
    port: int
    options: ServeOptions
    tokenizer: Tokenizer
    startup_timeout_s: float = 600.0
    heal: HealPolicy | None = None  # when to restart what died (default: `HealPolicy()`)
    step_limits: str = ""  # the budget, sequences and micro-batches chosen, and why (`afd.runtime.limits`)

    def describe(self) -> str:
        if self.config is None:
            shape = f"connector none, {self.replicas} replica{'s' if self.replicas > 1 else ''}"
        else:
            shape = f"connector {self.config.connector}, {self.config.num_attention_ranks}A{self.config.num_ffn_ranks}F"
        limits = self.step_limits or (
            f"max_num_batched_tokens {self.spec.max_num_batched_tokens}, max_num_seqs {self.spec.cache.max_num_seqs}"
        )
        return f"model {self.options.model_name}, {shape}, {self.spec.dtype} on {self.spec.device}; {limits}"


def bind_http(host: str, port: int) -> socket.socket:
    """The HTTP listening socket, bound before anything starts; ServeError (exit 2) when that is impossible."""
    try:
        infos = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ServeError(f"cannot resolve --host {host!r} ({exc.strerror})", 2) from None
    family, kind, proto, _, addr = sorted(infos, key=lambda info: info[0] != socket.AF_INET)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ServeError(f"port {port} on {host} is already in use; pick another --port", 2) from None
        raise ServeError(f"cannot listen on {host}:{port} ({exc.strerror})", 2) from None
    return sock


def _warn_if_busy_poll_starves(plan: ServePlan) -> None:
    """`--busy-poll` takes a core for the front end and each replica; where the model computes on the CPU, or
    the host has fewer cores than that plus one, the spinning steals the compute's cores (on a 2-core host it
    measured TTFT p50 11.6 s against 16 ms without)."""
    if not plan.spec.busy_poll:
        return
    cores = len(os.sched_getaffinity(0))
    if plan.spec.device == "cpu" or cores < plan.replicas + 2:
        logger.warning(
            "--busy-poll spins a core for the front end and one for each replica (%d), and this server has %d "
            "cores%s: expect it to be slower, not faster",
            plan.replicas,
            cores,
            " and computes on the CPU" if plan.spec.device == "cpu" else "",
        )


def run_server(plan: ServePlan, say: Callable[[str], None]) -> int:
    """Serve until a stop signal; returns the exit status (0: stopped on request with every rank clean)."""
    from dataclasses import replace

    from afd.runtime.servers import new_secret, start_server_ranks
    from afd.serve.frontend import ReplicaPool
    from afd.serve.healing import Healer, HealPolicy
    from afd.serve.state import ServerState

    _warn_if_busy_poll_starves(plan)
    sock = bind_http(plan.host, plan.port)
    secret = new_secret()
    link = FrontLink(secret.encode())  # an abstract Unix socket: every replica runs on this host
    ranks = None
    died_while_serving = False
    try:
        try:
            ranks = start_server_ranks(plan.config, plan.spec, plan.replicas, link.address, secret=secret)
        except LaunchError as exc:
            raise ServeError(str(exc), getattr(exc, "exit_status", 1)) from None
        _await_replicas(link, plan.replicas, ranks.dead, plan.startup_timeout_s)
        pool = ReplicaPool(link.conns, link.hellos)
        policy = replace(plan.heal or HealPolicy(), hello_timeout_s=plan.startup_timeout_s)
        state = ServerState(pool, plan.tokenizer, plan.options, Healer(ranks, pool, policy, link.accept_later))
        url_host = f"[{plan.host}]" if ":" in plan.host else plan.host
        ready = f"afd serve: ready at http://{url_host}:{sock.getsockname()[1]} ({plan.describe()})"
        died_while_serving = _serve_until_signal(state, sock, lambda: say(ready))
    finally:
        sock.close()
        if ranks is not None:
            codes = ranks.stop(1.0 if died_while_serving else RANK_STOP_GRACE_S)  # a broken world: no clean end
            unclean = {name: code for name, code in codes.items() if code != 0}
            if unclean:
                logger.warning("ranks that did not end cleanly: %s", unclean)
        link.close()
    return 1 if died_while_serving else 0


def _await_replicas(link: FrontLink, count: int, dead: Callable[[], list[str]], timeout_s: float) -> None:
    """Until every replica said hello; a rank that stops first fails the start-up with its own words."""
    failure: list[BaseException] = []
    done = threading.Event()

    def accept() -> None:
        try:
            link.accept(count, timeout_s)
        except LinkError as exc:
            failure.append(exc)
        finally:
            done.set()

    threading.Thread(target=accept, name="afd-serve-accept", daemon=True).start()
    while not done.wait(0.1):
        signals.raise_if_signalled()
        stopped = dead()
        if stopped:
            link.close()  # ends the accept thread
            raise ServeError(f"the server did not start: {stopped[0]}")
    if failure:
        raise ServeError(f"the server did not start: {failure[0]}")


def _serve_until_signal(state: ServerState, sock: socket.socket, on_ready: Callable[[], None]) -> bool:
    """Run the event loop until SIGTERM / SIGINT / SIGHUP; True when a rank had died before the stop."""
    from afd.serve.server import serve

    async def main() -> bool:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()

        def on_signal(signum: int, _frame: object) -> None:
            if not stop.is_set():
                logger.warning("%s: stopping the server", signals.signal_name(signum))
            loop.call_soon_threadsafe(stop.set)

        previous = signals.install_handlers(on_signal)  # set the stop event, not raise
        try:
            await serve(state, sock, stop, on_ready)
        finally:
            signals.restore_handlers(previous)
        return state.failed_before_stop

    started = time.monotonic()
    died = loop.run(main())
    logger.info("served for %.0f s", time.monotonic() - started)
    return died


class ServerProcess:
    """`afd serve` as a child process (for `afd bench serve` and tests): started, ready, stopped by SIGTERM.

    Its stdout is read for the ready line (bounded by `timeout_s`); its stderr goes to `log_path` (a temporary file
    without one), whose last line a failed start reports."""

    def __init__(self, argv: list[str], timeout_s: float, log_path: str | None = None) -> None:
        # closed in stop()
        self._log = open(log_path, "w+b") if log_path else tempfile.TemporaryFile()  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "afd", "serve", *argv],
            stdout=subprocess.PIPE,
            stderr=self._log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.url = self._await_ready(timeout_s)

    def _await_ready(self, timeout_s: float) -> str:
        lines: list[str] = []
        got = threading.Event()

        def read() -> None:
            for raw in self.proc.stdout:
                lines.append(raw.decode(errors="replace").strip())
                if lines[-1].startswith("afd serve: ready at "):
                    got.set()
                    break
            got.set()

        threading.Thread(target=read, daemon=True).start()
        if not got.wait(timeout_s) or not lines or not lines[-1].startswith("afd serve: ready at "):
            try:  # its stdout closed: it is exiting, so wait for the status rather than report a timeout
                code = self.proc.wait(10) if got.is_set() else self.proc.poll()
            except subprocess.TimeoutExpired:
                code = None
            why = f"exited with status {code}" if code is not None else f"was not ready within {timeout_s:g} s"
            last = self._last_log_line()
            self.stop()
            raise ServeError(f"afd serve {why}" + (f"; it said: {last}" if last else ""))
        return lines[-1].split("ready at ", 1)[1].split(" ", 1)[0]

    def _last_log_line(self) -> str:
        """The last non-empty line the server wrote to stderr (what a failed start has to say for itself)."""
        self._log.flush()
        self._log.seek(0, os.SEEK_END)
        self._log.seek(max(0, self._log.tell() - 4096))
        lines = [line.strip() for line in self._log.read().decode(errors="replace").splitlines() if line.strip()]
        return lines[-1] if lines else ""

    def stop(self, timeout_s: float = 40.0) -> int:
        """SIGTERM, then SIGKILL (its process group) if it has not exited within `timeout_s`; its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode
