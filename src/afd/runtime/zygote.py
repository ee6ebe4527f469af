"""Ranks forked from one process that has already imported torch: a launch pays that import once, not per rank.

`import torch` is most of a rank's start (2-3 s of CPU on a small host, against ~0.1 s for the rest), and a launch
of A + F ranks paid it A + F times over, on top of the launcher's own. So the launcher starts one zygote per launch
(`Zygote`): `python -m afd.cli.zygote` imports torch and the rank runtime, then forks each rank on request. A
forked rank becomes what `python -m afd worker ...` would have been: its own session (process group), its log as
stdout and stderr, the environment and working directory the launcher gave it, and that command line as its
process title (`setproctitle`, within the zygote's command line, which starts with room for it), so `ps` and the
tests that find ranks by role see it. /proc/PID/environ shows the zygote's environment: the launcher's when it
started the zygote (a launcher whose environment has changed since gets a new zygote), without the run's secret.

Nothing that starts threads, CUDA or a communicator runs before the fork; the zygote imports modules only.

The ranks are the zygote's children, not the launcher's: the zygote reaps them and reports each exit status on
its pipe, and `RankHandle` gives the launcher what it used of `subprocess.Popen` (pid, poll, wait, returncode).
The zygote ends when its launcher does (the launcher's end of the pipe closes with it, however it ends), and each
rank with the zygote (its parent-death signal, set by `afd.runtime.rank.die_with_launcher`, which accepts the
zygote as its parent: `forked_from()`, inherited through the fork).
Off Linux, where no parent-death signal exists, every rank starts as a process of its own.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

from afd import env

log = logging.getLogger(__name__)

READY_S = 180.0  # the zygote's imports, at most (a loaded 2-core host took ~3 s)
ROOM = 32768  # bytes of command line a forked rank can show beyond the zygote's own (its title's room)
ENTRY_MODULE = "afd.cli.zygote"  # its `python -m` entry: `main` here, with the CLI as what a rank runs
REAP_S = 0.02  # how often an idle zygote looks for ranks that ended


class ZygoteError(RuntimeError):
    """The zygote did not start, or is gone."""


def zygote_available() -> bool:
    """Forking ranks needs Linux: a forked rank must die with its zygote (a parent-death signal)."""
    return sys.platform.startswith("linux")


_forked_from: int | None = None  # in a forked rank: the zygote's pid (set before the rank's command runs)


def forked_from() -> int | None:
    """The pid of the zygote that forked this process, or None for a process started on its own."""
    return _forked_from


# ---------------------------------------------------------------- the launcher's side
_shared: Zygote | None = None
_retired: list[Zygote] = []  # replaced while ranks of theirs still ran
_shared_lock = threading.Lock()


def zygote_for_launch() -> Zygote | None:
    """This process's zygote, started now or earlier (`prestart`); None where ranks start as processes of their own.
    One zygote serves every launch of a process (`afd demo` launches each connector in turn); one that died is
    replaced, and so is one started under another environment than this process has now (its ranks show the
    zygote's environment: a test's tag, say). A replaced zygote with ranks still running ends at exit."""
    global _shared
    if not zygote_available():
        return None
    with _shared_lock:
        _retired[:] = [z for z in _retired if not z.close_if_idle()]
        if _shared is not None and not _shared.usable():
            _shared.close()
            _shared = None
        if _shared is not None and _shared.environ != env.child_environ():
            if not _shared.close_if_idle():
                _retired.append(_shared)
            _shared = None
        if _shared is None:
            _shared = Zygote()
        return _shared


def prestart() -> None:
    """Start the zygote now, so its imports run beside the caller's own (the CLI, before it imports torch)."""
    zygote_for_launch()


@atexit.register
def close_shared() -> None:
    """End this process's zygotes, if it has any (at exit; its launches are over)."""
    global _shared
    with _shared_lock:
        for zygote in [*_retired, *([_shared] if _shared is not None else [])]:
            zygote.close()
        _retired.clear()
        _shared = None


class Zygote:
    """A zygote process; `spawn` forks a rank from it. Thread-safe; `close` ends it (after the launch's ranks)."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        self._conn = Connection(os.dup(ours.fileno()))
        ours.close()
        # one poll object for the pipe's life: `Connection.poll` builds a selector on every call (~10 us), and a
        # rank's `poll()` (the server asks on every request whether its ranks live) polls the pipe each time
        self._poller = select.poll()
        self._poller.register(self._conn.fileno(), select.POLLIN)
        fd, name = tempfile.mkstemp(prefix="afd_zygote_", suffix=".log")
        self.log_path = Path(name)
        self.environ = env.child_environ()  # what its ranks show in /proc/PID/environ
        cmd = [sys.executable, "-m", ENTRY_MODULE, str(theirs.fileno()), str(os.getpid()), " " * ROOM]
        # SPT_NOENV: setproctitle writes titles within the command line only, so /proc/PID/environ stays readable
        zygote_env = {**self.environ, "PYTHONUNBUFFERED": "1", "SPT_NOENV": "1"}
        try:
            self.proc = subprocess.Popen(
                cmd,
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=fd,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C at the terminal is the launcher's to handle, not ours
                env=zygote_env,
            )
        finally:
            os.close(fd)
            theirs.close()
        self._lock = threading.Lock()
        self._spawned: list[int | str] = []
        self._live: set[int] = set()  # ranks forked and not yet reported ended
        self._exited: dict[int, int] = {}
        self._lost = False
        self._failed = False  # a spawn failed: the log stays for the user to read

    def usable(self) -> bool:
        return not self._lost and self.proc.poll() is None

    def spawn(self, cmd: list[str], rank_env: dict[str, str], log_path: Path, timeout_s: float = READY_S) -> RankHandle:
        """Fork `cmd` (`[python, -m, afd, ...]`) as a rank; waits for the zygote's imports the first time."""
        if cmd[1:3] != ["-m", "afd"]:
            raise ValueError(f"the zygote runs afd commands only, not {cmd[:3]}")
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._send(("spawn", cmd, rank_env, os.getcwd(), str(log_path)))
            while not self._spawned:
                if self._lost:
                    raise self._error(f"exited (status {self.proc.wait(5)})")
                if not self._receive(max(0.0, deadline - time.monotonic())) and time.monotonic() >= deadline:
                    raise self._error(f"did not fork a rank within {timeout_s:g} s")
            answer = self._spawned.pop(0)
        if isinstance(answer, str):
            raise self._error(f"could not fork a rank ({answer})")
        self._live.add(answer)
        return RankHandle(self, answer, cmd)

    def close_if_idle(self) -> bool:
        """Close the zygote if none of its ranks still runs; returns whether it did (or it was gone)."""
        with self._lock:
            while self._receive(0.0):
                pass
            idle = self._lost or not self._live
        if idle:
            self.close()
        return idle

    def returncode(self, pid: int) -> int | None:
        """The rank's exit status once the zygote has reported it (Popen's convention: -N for signal N)."""
        with self._lock:
            while self._receive(0.0):
                pass
            if pid in self._exited:
                return self._exited[pid]
            from afd.distributed.watchdog import (
                process_alive,  # here: this module is imported before torch (`prestart`)
            )

            if self._lost and not process_alive(pid):  # its exit status went with the zygote
                log.warning("the exit status of rank pid %d is unknown: the zygote that forked it is gone", pid)
                self._exited[pid] = 1
                return 1
            return None

    def close(self, timeout_s: float = 5.0) -> None:
        """End the zygote (its ranks, if any still run, get their parent-death signal); its log goes too unless a
        spawn failed (the error names it)."""
        self._conn.close()
        if self.proc.poll() is None:
            self.proc.terminate()  # it holds nothing to clean up; and it may still be importing
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout_s)
        if not self._failed:
            self.log_path.unlink(missing_ok=True)

    def _error(self, why: str) -> ZygoteError:
        self._failed = True
        return ZygoteError(f"the rank zygote {why}; its log: {self.log_path}")

    def _send(self, message: tuple) -> None:
        try:
            self._conn.send(message)
        except (OSError, ValueError):
            self._lost = True
            raise self._error(f"is gone (exit status {self.proc.poll()})") from None

    def _receive(self, timeout_s: float) -> bool:
        """Take one message from the zygote if one comes within `timeout_s`; False when none did."""
        if self._lost:
            return False
        try:
            if not self._poller.poll(math.ceil(timeout_s * 1000)):  # ms
                return False
            message = self._conn.recv()
        except (OSError, EOFError, ValueError):  # the zygote is gone (its ranks got a parent-death signal)
            self._lost = True
            return False
        kind = message[0]
        if kind in ("spawned", "failed"):
            self._spawned.append(message[1])
        elif kind == "exited":
            self._exited[message[1]] = message[2]
            self._live.discard(message[1])
        return True


class RankHandle:
    """A forked rank as the launcher sees it: what `RankProcess` used of `subprocess.Popen`."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]) -> None:
        self._zygote, self.pid, self.args = zygote, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.returncode(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.005)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# ---------------------------------------------------------------- the zygote's side
def set_title(args: list[str]) -> None:
    """Show `args`, joined by spaces, as this process's title: what `ps`, `pgrep -f` and /proc/PID/cmdline show.
    It fits within the process's original command line (the zygote's is `ROOM` longer than it needs)."""
    import setproctitle

    setproctitle.setproctitle(" ".join(args))


def _serve(conn: Connection) -> tuple | None:
    """The zygote's loop: fork a rank per `spawn`, report each rank's end; returns (in a forked child only) the
    rank's job. Ends when the launcher closes the pipe."""
    children: set[int] = set()
    while True:
        try:
            _report_ended(children, conn)
            if not conn.poll(REAP_S):
                continue
            message = conn.recv()
        except (EOFError, OSError):  # the launcher is gone: so is this zygote (its ranks get their death signal)
            return None
        if message[0] != "spawn":
            continue
        try:
            with warnings.catch_warnings():
                # Python warns that this process has threads: they are OpenBLAS's (numpy's), parked, and OpenBLAS
                # re-makes its pool in a forked child itself (pthread_atfork); no Python thread runs here
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
        except OSError as exc:
            pid, answer = None, ("failed", f"fork: {exc.strerror}")
        if pid == 0:
            conn.close()
            return message[1:]
        if pid is not None:
            children.add(pid)
            answer = ("spawned", pid)
        try:
            conn.send(answer)
        except OSError:
            return None


def _report_ended(children: set[int], conn: Connection) -> None:
    """Reap every rank that ended and send its exit status (Popen's convention: -N for signal N)."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        conn.send(("exited", pid, os.waitstatus_to_exitcode(status)))


def _become_rank(
    run_command: Callable[[list[str]], int], cmd: list[str], rank_env: dict[str, str], cwd: str, log_path: str
) -> int:
    """In the forked child: turn into `cmd`, as `subprocess.Popen(cmd, start_new_session=True, ...)` would have."""
    os.setsid()
    out = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(rank_env)
    global _forked_from
    _forked_from = os.getppid()
    set_title(cmd)
    sys.argv = [cmd[0], *cmd[3:]]
    return run_command(cmd[3:])


def main(run_command: Callable[[list[str]], int]) -> None:
    """The zygote process: `run_command` is what a forked rank runs on its `afd ...` arguments (the CLI's main,
    which `afd.cli.zygote` passes in, having imported the rank runtime, so that this layer needs nothing above
    it)."""
    conn = Connection(int(sys.argv[1]))
    if os.getppid() != int(sys.argv[2]):
        raise SystemExit(f"afd zygote: its launcher (pid {sys.argv[2]}) is gone")
    set_title([sys.executable, "-m", ENTRY_MODULE])
    import torch  # noqa: F401 - the point of the zygote: imported once, before any fork

    job = _serve(conn)
    if job is not None:
        raise SystemExit(_become_rank(run_command, *job))
