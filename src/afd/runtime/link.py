"""The line between the HTTP front end and its engine replicas: one local socket per replica.

Why a socket of our own and not the world store: requests arrive and tokens leave every step, and the
store is the control plane of the ranks, not a message queue. `multiprocessing.connection` gives framing
and an HMAC challenge on the run's secret (`AFD_SECRET`), so only processes of this run can connect
(the messages are pickled: the challenge is what makes that safe).

Messages are dicts with a `"type"`:

front end -> replica
- `add`: `rid` (str), `prompt_ids` (list[int]), `max_tokens` (int), `sampling` (dict of `SamplingParams`
  fields), `stop_token_ids` (list[int]; generation stops after emitting one), `prompt_logprobs` (bool)
- `abort`: `rid` — stop generating, free its cache; the replica answers with `finished`, reason `abort`
- `shutdown`: finish nothing more, answer `bye`, exit 0

replica -> front end
- `hello`: `replica` (attention rank), `max_num_seqs`, `max_model_len`, `vocab_size`, `num_cache_tokens`
- `tokens`: `items`: list of `[rid, token_id, logprob]`, everything one step produced, in step order;
  `engine_stamps`: {rid: [took, stepped]} for the requests whose first token this is: when the replica took
  their `add` and when the step ended, on the host's `time.perf_counter()` clock (CLOCK_MONOTONIC, one per
  machine). The difference is the replica's own time to the first token, so the front end's share of TTFT is
  measured in the same run; a client on the same host can cut TTFT into stages at them.
- `finished`: `rid`, `reason`: `"stop"` (a stop token), `"length"` (max_tokens), `"abort"`, or `"error"`
  with `message` (one sentence: the request was refused, e.g. it can never fit the cache)
- `load`: `running`, `waiting`, `cache_usage` (0..1) — after every step that changed them
- `bye`
"""

from __future__ import annotations

import logging
import math
import os
import pickle
import secrets
import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener

logger = logging.getLogger(__name__)

Message = dict
# Where a front end listens: (host, port) over TCP, or a Unix socket, a path or (a leading NUL) Linux's abstract
# namespace, which leaves no file behind. `afd serve` uses an abstract one: its replicas run on its host, and a Unix
# socket's hop is shorter than loopback TCP's (measured on the CPU host, one small message to a polling reader:
# 43 against 83 us; with a request's pickled `add`, 145 against 202 us)
LinkAddress = tuple[str, int] | str
# What one `recv` asks for. Not more: `recv(n)` allocates n bytes first, and a large buffer costs a large allocation
# and its release every call (measured on the CPU host, a 300-byte message: 2.2 us with 64 KiB, 15.6 us with 1 MiB)
RECV_BYTES = 1 << 16
# The longest a lingering `ReplicaLink.poll` goes on reading (a step in flight waits for its host meanwhile)
LINGER_MAX_S = 0.02


def format_address(address: LinkAddress) -> str:
    """As `--serve-address` takes it: HOST:PORT (an IPv6 host in brackets), a socket path, or @NAME (abstract)."""
    if isinstance(address, str):
        return "@" + address[1:] if address.startswith("\0") else address
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_address(text: str) -> LinkAddress:
    """The inverse of `format_address`; ValueError in one sentence for anything else."""
    if text.startswith("@") and len(text) > 1:
        return "\0" + text[1:]
    if text.startswith("/"):
        return text
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT with a port between 1 and 65535, a socket path or @NAME, got {text!r}")
    return host, int(port)


class LinkError(RuntimeError):
    """The other end of a link went away or never came."""


def no_delay(conn: Connection) -> None:
    """Turn Nagle's algorithm off on a link's TCP socket. Why: a replica sends several small messages per step
    (tokens, finished, load), and with Nagle each one after the first waited for the peer's delayed ACK: ~40 ms
    on Linux (measured on loopback: 41.7 ms p50 for the second of two messages, 0.04 ms without Nagle)."""
    sock = socket.socket(fileno=conn.fileno())
    try:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    finally:
        sock.detach()  # the Connection keeps its descriptor


# ---------------------------------------------------------------- the frames, as `multiprocessing.connection` has them
# The front end reads and writes its links on its event loop (no thread hand-offs on a request's path), so it
# frames messages itself, byte for byte as `Connection.send` / `recv` do: a signed 4-byte big-endian length (or -1
# and an 8-byte length beyond 2 GiB), then the pickle. The replicas keep their `Connection`.
_SHORT, _LONG = struct.Struct("!i"), struct.Struct("!Q")


def encode_frame(message: Message) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    if len(payload) > 0x7FFFFFFF:
        return _SHORT.pack(-1) + _LONG.pack(len(payload)) + payload
    return _SHORT.pack(len(payload)) + payload


def decode_frames(buffer: bytearray) -> list[Message]:
    """Every whole message at the front of `buffer`, removed from it; a partial one stays for the next bytes."""
    messages, pos = [], 0
    while len(buffer) - pos >= 4:
        (size,) = _SHORT.unpack_from(buffer, pos)
        head = 4
        if size == -1:
            if len(buffer) - pos < 12:
                break
            (size,), head = _LONG.unpack_from(buffer, pos + 4), 12
        if len(buffer) - pos - head < size:
            break
        messages.append(pickle.loads(memoryview(buffer)[pos + head : pos + head + size]))
        pos += head + size
    del buffer[:pos]
    return messages


class FrameSender:
    """Writes frames to a non-blocking socket in order: at once when the socket takes them whole (the common
    case: a request's `add`, a few hundred bytes), else the rest goes to a thread that waits for the socket, so a
    replica busy with a long step never blocks the caller (the event loop). Thread-safe; `on_broken()` is called
    (from whichever thread saw it) when the socket fails."""

    def __init__(self, sock: socket.socket, on_broken, name: str) -> None:
        self._sock, self._on_broken = sock, on_broken
        self._backlog: deque[memoryview] = deque()
        self._cond = threading.Condition()
        self._closed = self.broken = False
        self._thread = threading.Thread(target=self._drain, name=name, daemon=True)
        self._thread.start()

    def send(self, frame: bytes) -> bool:
        """Queue one frame; False when the socket is broken or closed."""
        with self._cond:
            if self.broken or self._closed:
                return False
            data = memoryview(frame)
            if not self._backlog:
                try:
                    data = data[self._sock.send(data) :]
                except BlockingIOError:
                    pass
                except OSError:
                    self._break()
                    return False
                if not data:
                    return True
            self._backlog.append(data)
            self._cond.notify()
        return True

    def _drain(self) -> None:
        """Write the backlog, all of what is queued at once: one frame per pass would hand the GIL back and forth
        a few times a frame with an event loop that holds it, and a burst of a thousand `add`s then crossed at
        some ten frames a replica step (measured: `scripts/front_end_fanout.py --prompt-len 1024`)."""
        while True:
            with self._cond:
                while not self._backlog and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                taken = len(self._backlog)
                data = self._backlog[0] if taken == 1 else memoryview(b"".join(self._backlog))
            try:  # outside the lock: the loop may queue more meanwhile, behind these
                while data and not self._closed:
                    select.select([], [self._sock], [], 0.5)
                    try:
                        data = data[self._sock.send(data) :]
                    except BlockingIOError:
                        continue
            except (OSError, ValueError):  # ValueError: the socket was closed under us
                with self._cond:
                    self._break()
                return
            with self._cond:
                for _ in range(min(taken, len(self._backlog))):
                    self._backlog.popleft()
                self._cond.notify_all()

    def _break(self) -> None:
        if not self.broken and not self._closed:
            self.broken = True
            self._backlog.clear()
            self._on_broken()

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop; what is still queued after `timeout_s` is dropped (the replica is being stopped anyway)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._backlog and not self.broken and time.monotonic() < deadline:
                self._cond.wait(0.05)
            self._closed = True
            self._cond.notify_all()
        self._thread.join(1.0)


class FrontLink:
    """The front end's listener: every replica connects once and says `hello` with its index. `address`: where to
    listen (default: a fresh abstract Unix socket, for replicas on this host; ("127.0.0.1", 0): loopback TCP)."""

    def __init__(self, authkey: bytes, address: LinkAddress | None = None) -> None:
        address = address if address is not None else f"\0afd-link-{secrets.token_hex(8)}"
        self._listener = Listener(address, authkey=authkey)  # the family follows the address
        self._unix_address = address if isinstance(address, str) else None  # the listener gives it back as bytes
        self.conns: dict[int, Connection] = {}
        self.hellos: dict[int, Message] = {}
        self._closed = False

    @property
    def address(self) -> LinkAddress:
        return self._unix_address or self._listener.address  # TCP: with the port bound

    def accept(self, num_replicas: int, timeout_s: float) -> None:
        """Wait until replicas 0..num_replicas-1 have connected and said hello; bounded by `timeout_s`."""
        done = threading.Event()
        failure: list[BaseException] = []

        def accept_all() -> None:
            try:
                while len(self.conns) < num_replicas:
                    got = self._accept_one()
                    if got is not None:
                        self.conns[got[0]], self.hellos[got[0]] = got[1], got[2]
            except (OSError, EOFError) as exc:  # the listener closed under us: the timeout below fired
                failure.append(exc)
            finally:
                done.set()

        thread = threading.Thread(target=accept_all, name="afd-link-accept", daemon=True)
        thread.start()
        if not done.wait(timeout_s) or len(self.conns) < num_replicas:
            missing = sorted(set(range(num_replicas)) - set(self.conns))
            self.close()
            raise LinkError(f"replicas {missing} did not connect to the front end within {timeout_s:g} s")

    def accept_later(self, on_hello: Callable[[int, Connection, Message], None]) -> None:
        """From now until `close`, hand every replica that connects and says hello (a restarted one) to
        `on_hello(replica, conn, hello)`, from a thread of its own."""

        def accept_all() -> None:
            while True:
                try:
                    got = self._accept_one()
                except (OSError, EOFError):
                    if self._closed:
                        return
                    continue  # a replica that died between its connect and its hello
                if got is not None:
                    previous = self.conns.get(got[0])
                    self.conns[got[0]], self.hellos[got[0]] = got[1], got[2]
                    if previous is not None:
                        previous.close()  # the link of the replica this one replaces
                    on_hello(*got)

        threading.Thread(target=accept_all, name="afd-link-accept-later", daemon=True).start()

    def _accept_one(self) -> tuple[int, Connection, Message] | None:
        """One connection and its hello; None for a peer without the key or without a hello."""
        try:
            conn = self._listener.accept()
        except AuthenticationError:  # not one of this run's processes: keep waiting for ours
            logger.warning("refused a connection to the front end's link that did not know the key")
            return None
        no_delay(conn)
        try:
            hello = conn.recv()
        except (OSError, EOFError):
            conn.close()
            raise
        if not isinstance(hello, dict) or hello.get("type") != "hello":
            conn.close()
            return None
        return int(hello["replica"]), conn, hello

    def close(self) -> None:
        self._closed = True
        for conn in self.conns.values():
            conn.close()
        self._listener.close()


class ReplicaLink:
    """A replica's end: connect, say hello, then drain requests between steps and send what each step made."""

    def __init__(self, address: LinkAddress, authkey: bytes, hello: Message) -> None:
        try:
            self._conn = Client(address, authkey=authkey)  # the connection and the key's challenge
        except (OSError, EOFError, AuthenticationError) as exc:
            raise LinkError(f"cannot reach the front end at {format_address(address)}: {exc}") from None
        no_delay(self._conn)
        # then frames of our own over the socket (`encode_frame` / `decode_frames`, the front end's): one `recv` for
        # whatever arrived and one `pickle` call per message, where `Connection.recv` reads a frame in two `recv`s
        # through a BytesIO and its own pickler class; a request's `add` is taken up sooner
        self._sock = socket.socket(fileno=os.dup(self._conn.fileno()))
        self._inbuf = bytearray()
        # one poll object for the link's life: `Connection.poll` builds a selector on every call, ~10 us of Python
        # that a busy-polling replica paid on each turn of its loop (half of it, on average, before a request's
        # `add` was taken up)
        self._poller = select.poll()
        self._poller.register(self._sock.fileno(), select.POLLIN)
        # sends never block the replica: a front end behind on a step's tokens (a thousand streams) would otherwise
        # stall the replica's loop on a full socket, and with it the launch of the next step (the device idle)
        self._sock.setblocking(False)
        self._broken = False
        self._sender = FrameSender(self._sock, self._on_broken, "afd-replica-send")
        self.send({"type": "hello", **hello})

    def _on_broken(self) -> None:
        self._broken = True

    def poll(
        self, timeout_s: float = 0.0, linger_ms: int = 0, device_busy: Callable[[], bool] | None = None
    ) -> list[Message]:
        """Every message waiting now; with `timeout_s` > 0, wait that long for the first one (an idle replica).

        `linger_ms` > 0 (a replica whose step is in flight, where waiting costs the device nothing): once something
        came, go on reading until nothing more comes for `linger_ms`, within `LINGER_MAX_S`, so a burst larger than
        the socket holds (hundreds of long prompts' `add`s at once) is read while the sender refills it. Read once
        per step instead, such a burst would take one step per socketful (seconds, for a thousand long prompts).
        `device_busy`: lingering stops once it says False (the step in flight ended: the device would wait).
        """
        messages: list[Message] = []
        started = 0.0
        wait_ms = math.ceil(timeout_s * 1000)  # ms, rounded up
        try:
            while self._poller.poll(wait_ms):
                try:
                    data = self._sock.recv(RECV_BYTES)
                except BlockingIOError:  # readable, yet nothing to read after all
                    break
                if not data:
                    raise EOFError
                self._inbuf += data
                messages += decode_frames(self._inbuf)
                started = started or time.monotonic()
                lingering = time.monotonic() - started < LINGER_MAX_S and (device_busy is None or device_busy())
                wait_ms = linger_ms if lingering else 0
        except (OSError, EOFError):
            raise LinkError("the front end closed its link") from None
        return messages

    def send(self, message: Message) -> None:
        """Queue `message` for the front end, in order, without waiting for the socket (`FrameSender`)."""
        if self._broken or not self._sender.send(encode_frame(message)):
            raise LinkError("the front end closed its link")

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued (within `timeout_s`), then close."""
        self._sender.close(timeout_s)
        self._sock.close()
        self._conn.close()
