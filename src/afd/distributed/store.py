"""The world store of a run: hosted on one address only, and split per run by a shared secret.

torch's TCPStore server would listen on every interface; `host_store` binds the listening socket to
the configured host itself and hands it over (`master_listen_fd`). A shared secret (`AFD_SECRET`,
`afd.env.secret()`; `afd launch` mints one per run) yields, by HMAC-SHA256, a private namespace
(every world key lives under it, so two runs on one store never meet), a public run tag that the
store's creator writes under `RUN_TAG_KEY` (a rank that finds another tag stops at once:
`ForeignRunError`), and a key that signs arrival, done and failure records: a record that does not
verify is logged and never trusted, so nobody without the secret can stop the run or pose as a rank.
TCPStore can list its keys: the namespace keeps runs apart, it is not hidden; on an untrusted network,
bind a private address.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from afd import env

logger = logging.getLogger(__name__)

RUN_TAG_KEY = "afd/run_tag"  # the one key outside every run's namespace: who the store belongs to


class RendezvousError(RuntimeError):
    """The world could not be formed (missing rank, mismatched sizes, unreachable store)."""

    exit_status = 1


class ForeignRunError(RendezvousError):
    """The store at host:port belongs to another run (another secret): a usage error, exit status 2."""

    exit_status = 2


class PortInUseError(RendezvousError):
    """The store's port is taken on that address (another run, or another program): exit status 2."""

    exit_status = 2


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.02) -> None:
    """Poll `predicate` until true; after `timeout_s` raise TimeoutError saying what was awaited."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"gave up after {timeout_s:.1f}s waiting for {what}")
        time.sleep(poll_s)


def accepts_connections(host: str, port: int) -> bool:
    """Whether something accepts TCP connections at host:port now."""
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


STORE_POLL_S = 0.05  # how often a client looks for a store that is not listening yet


def connect_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A client of the store at host:port, once it listens: plain sockets every `STORE_POLL_S` first, then the
    client. torch's client alone backs off seconds between attempts (a rank that starts before the store's host
    joined ~1.6 s after it came) and overshoots its timeout (4 s took 9 s); this one joins within a poll and keeps
    to `timeout_s`. TimeoutError when nothing listens in time."""
    deadline = time.monotonic() + timeout_s
    wait_until(lambda: accepts_connections(host, port), timeout_s, f"the store at {host}:{port}", STORE_POLL_S)
    left = max(1.0, deadline - time.monotonic())
    return dist.TCPStore(host, port, None, False, timedelta(seconds=left), wait_for_workers=False)


# ---------------------------------------------------------------- the run's keys
@dataclass(frozen=True)
class RunKeys:
    """What the shared secret yields: a private key namespace, a public run tag and a record-signing key.

    All three are HMAC-SHA256 of the secret under distinct labels, so none reveals another or the secret.
    """

    namespace: str
    tag: str
    _mac_key: bytes

    @classmethod
    def from_secret(cls, secret: str) -> RunKeys:
        def derive(label: str) -> bytes:
            return hmac.new(secret.encode(), label.encode(), hashlib.sha256).digest()

        return cls(
            namespace=f"afd/{derive('afd-namespace').hex()[:32]}/",
            tag=derive("afd-run-tag").hex(),
            _mac_key=derive("afd-records"),
        )

    def _mac(self, key: str, body: str) -> str:
        return hmac.new(self._mac_key, f"{key}\0{body}".encode(), hashlib.sha256).hexdigest()

    def sign(self, key: str, body: str) -> str:
        """The value to store under `key`: `body` with an HMAC over key and body."""
        return json.dumps({"body": body, "mac": self._mac(key, body)})

    def verify(self, key: str, raw: bytes | str) -> str | None:
        """The body of a signed record, or None when it was not signed with this run's secret."""
        try:
            record = json.loads(raw)
            body, mac = record["body"], record["mac"]
        except (ValueError, TypeError, KeyError):
            return None
        if not isinstance(body, str) or not isinstance(mac, str) or not hmac.compare_digest(mac, self._mac(key, body)):
            return None
        return body


_REFUSED: set[tuple[str, bytes]] = set()  # records already logged as refused (log each once)


def read_record(store: dist.Store, keys: RunKeys, key: str) -> str | None:
    """A verified record's body; None when absent; a record that does not verify is logged and ignored."""
    if not store.check([key]):
        return None
    raw = store.get(key)
    body = keys.verify(key, raw)
    if body is None and (key, raw) not in _REFUSED:
        _REFUSED.add((key, raw))
        logger.warning("ignoring store record %s: it is not signed with this run's secret", key)
    return body


def publish_failure(store: dist.Store, keys: RunKeys, world_rank: int, msg: str) -> None:
    """Record `msg` as world rank's failure; the failure with the lowest sequence number is the run's."""
    seq = int(store.add("failures", 1))
    key = f"failed/{world_rank}"
    store.set(key, keys.sign(key, json.dumps({"seq": seq, "msg": msg})))


def read_first_failure(store: dist.Store, keys: RunKeys, world_size: int) -> str | None:
    """The run's first verified failure, or None when there is none (yet)."""
    if int(store.add("failures", 0)) == 0:
        return None
    first: dict | None = None
    for r in range(world_size):
        body = read_record(store, keys, f"failed/{r}")
        if body is not None:
            record = json.loads(body)
            if first is None or record["seq"] < first["seq"]:
                first = record
    return None if first is None else str(first["msg"])


def departed(store: dist.Store, keys: RunKeys, world_rank: int) -> bool:
    """Whether a rank has said it is done or has failed (verified records only)."""
    return any(read_record(store, keys, f"{what}/{world_rank}") is not None for what in ("done", "failed"))


# ---------------------------------------------------------------- the store
def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host:port` only, listening; one sentence when that is impossible."""
    try:
        infos = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise RendezvousError(f"cannot resolve the store host {host!r} ({exc.strerror})") from None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)  # IPv4 first, as TCPStore clients try it first
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT only: a listener still refuses
        sock.bind(addr)
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortInUseError(
                f"port {port} on {host} is already in use (another afd run, or another program); "
                "pick another port, or leave --port out to get a free one"
            ) from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise RendezvousError(
                f"{host} is not an address of this machine, so the world store cannot listen on it; "
                "the store host must be this machine's own address"
            ) from None
        raise RendezvousError(f"cannot listen on {host}:{port} for the world store ({exc.strerror})") from None
    return sock


def host_store(host: str, port: int, timeout_s: float, secret: str | None = None) -> dist.TCPStore:
    """Host the world store on `host:port` only (never every interface) and write the run's tag.

    The returned store is the server; keep it referenced for as long as any rank may use it.
    """
    keys = RunKeys.from_secret(env.secret() if secret is None else secret)
    sock = listening_socket(host, port)
    fd = sock.detach()  # the store's server owns the socket from here on
    try:
        store = dist.TCPStore(
            host,
            port,
            None,
            True,
            timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=fd,
            use_libuv=True,
        )
    except Exception as exc:  # noqa: BLE001 - torch raises several types here
        os.close(fd)
        raise RendezvousError(f"could not host the AFD world store on {host}:{port}: {exc}") from exc
    store.set(RUN_TAG_KEY, keys.tag)
    logger.info("hosting the AFD world store on %s:%d", host, port)
    return store


def check_run_tag(store: dist.Store, keys: RunKeys, host: str, port: int, timeout_s: float, who: str) -> None:
    """Refuse, in one sentence, a store that belongs to another run."""
    try:
        wait_until(lambda: store.check([RUN_TAG_KEY]), timeout_s, f"the run tag of the store at {host}:{port}")
        tag = store.get(RUN_TAG_KEY).decode(errors="replace")
    except TimeoutError:
        raise RendezvousError(
            f"{who}: the server at {host}:{port} shows no afd run tag after {timeout_s:.1f}s; "
            "is it an AFD world store of this afd version?"
        ) from None
    if not hmac.compare_digest(tag, keys.tag):
        raise ForeignRunError(
            f"{who}: the world store at {host}:{port} belongs to another run: its ranks use a different "
            "AFD_SECRET; give every rank of one run the same AFD_SECRET, or use another port"
        )
