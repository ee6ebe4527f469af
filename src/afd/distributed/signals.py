"""Signals end any afd command cleanly: one line, `finally` blocks run, exit status 128 + signum.

SIGINT (Ctrl-C), SIGTERM and SIGHUP (a closed terminal) raise `Interrupted` in the main thread. The
launcher raises the same exception after stopping its ranks, so the CLI handles both alike. A
watchdog thread is the last line of defence when the exception cannot reach the main thread in time.
"""

from __future__ import annotations

import _thread
import os
import signal
import threading
from collections.abc import Callable

# After a signal, the main thread gets this long to unwind (a launcher stops its ranks within ~10 s) before
# the watchdog ends the process itself; a rank gets less, since its launcher SIGKILLs it after 5 s.
SIGNAL_GRACE_S = 30.0
WORKER_SIGNAL_GRACE_S = 3.0
HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    """A signal that ends the command; `signum` sets the exit status (128 + signum)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal_name(signum)}")
        self.signum = signum


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


_signal_seen: int | None = None  # the last signal this process turned into Interrupted


def last_signal() -> int | None:
    """The last signal turned into Interrupted since `install_handlers`, or None."""
    return _signal_seen


REPLAY_S = 0.05  # a signal held back out of an import is played again this often until the import is over
_pending: int | None = None  # a signal held back out of an import, not raised yet
_replayed = False  # the next handler call is a held-back signal played again, not a new one
_replay_scheduled = threading.Lock()  # held while a replay is scheduled: one at a time, however many signals came


def _in_import(frame) -> bool:
    """Whether `frame` runs under an import: Python's importlib frames are on its stack."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _replay_later() -> None:
    if not _replay_scheduled.acquire(blocking=False):
        return

    def again() -> None:
        global _replayed
        _replay_scheduled.release()
        if _pending is not None:
            _replayed = True
            _thread.interrupt_main(_pending)  # the main thread's handler again; nothing once handlers are restored

    timer = threading.Timer(REPLAY_S, again)
    timer.daemon = True
    timer.start()


def _raise_interrupted(signum: int, frame) -> None:
    """Raise Interrupted, except inside an import: an exception raised there can cross a C extension's frames
    (torch's import runs Python from C++, which then aborts the process with a stack dump), so the signal is
    held back and played again shortly, raised once the import is over (`raise_if_signalled` sees it meanwhile)."""
    global _signal_seen, _pending, _replayed
    if _replayed:
        _replayed = False
        if _pending is None:
            return  # raised meanwhile (`raise_if_signalled`)
    _signal_seen = signum
    if _in_import(frame):
        _pending = signum
        _replay_later()
        return
    _pending = None
    raise Interrupted(signum)


def raise_if_signalled() -> None:
    """Raise Interrupted again if a signal came and its exception was swallowed (a bare `except:` in some
    library's import did that: Ctrl-C during the imports was lost and the run went on). Called before
    every long phase."""
    global _pending
    if _signal_seen is not None:
        _pending = None
        raise Interrupted(_signal_seen)


def install_handlers(handler=None) -> dict:
    """SIGINT, SIGTERM and SIGHUP raise `Interrupted` for the whole command (or call `handler`), so `finally`
    blocks run and the exit status says which signal it was. A signal ignored when afd started (nohup) stays
    ignored; only the main thread can install handlers (elsewhere nothing happens). Returns the previous
    handlers, for `restore_handlers`."""
    global _signal_seen, _pending
    _signal_seen = _pending = None
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {}
    for sig in HANDLED_SIGNALS:
        current = signal.getsignal(sig)
        if current is not signal.SIG_IGN:
            previous[sig] = current
            signal.signal(sig, handler or _raise_interrupted)
    return previous


def restore_handlers(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


class SignalWatchdog:
    """Ends the process when a signal's exception does not: the last line of defence.

    Python runs a handler only between bytecodes of the main thread, so a rank blocked in a gloo/NCCL wait
    or a store rendezvous does not see SIGTERM until that call returns (up to its timeout), and a library
    may swallow the exception. The C-level handler still writes the signal number to the wakeup fd; this
    thread reads it, gives the main thread `grace_s` to unwind, then says one line and leaves with
    128 + signum.
    """

    def __init__(self) -> None:
        self.grace_s = SIGNAL_GRACE_S
        self.say: Callable[[str], None] = lambda line: os.write(2, f"afd: {line}\n".encode())
        self.leave: Callable[[int], None] = os._exit
        self._write_fd = -1
        self._previous_fd = -1
        self._stopped = threading.Event()

    def configure(self, grace_s: float, say: Callable[[str], None], leave: Callable[[int], None]) -> None:
        self.grace_s, self.say, self.leave = grace_s, say, leave

    def start(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._previous_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        self._stopped.clear()
        threading.Thread(target=self._watch, args=(read_fd,), name="afd-signal-watchdog", daemon=True).start()

    def stop(self) -> None:
        """The command is over: no expiry, and the thread ends (it reads EOF)."""
        if self._write_fd < 0:
            return
        self._stopped.set()
        signal.set_wakeup_fd(self._previous_fd)
        os.close(self._write_fd)
        self._write_fd = -1

    def _watch(self, read_fd: int) -> None:
        try:
            while data := os.read(read_fd, 64):
                signums = [s for s in data if s in HANDLED_SIGNALS]
                if signums and not self._stopped.wait(self.grace_s):
                    self.say(f"interrupted by {signal_name(signums[0])} (still busy {self.grace_s:g} s later)")
                    self.leave(128 + signums[0])
        finally:
            os.close(read_fd)
