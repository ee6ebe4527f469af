"""CPU symmetric heap: one POSIX shared-memory segment per rank, same layout as the GPU window.

Segment names are `afd_<run_token>_<world_rank>`. The run token is minted by world rank 0 and
shared through the store (or passed in by the launcher), so two runs on one host never collide
and the launcher can remove every segment of a crashed run with `cleanup_segments(run_token)`.

Order at init: create + zero own segment → barrier → map peers → barrier → unlink own segment.
After the second barrier every peer holds a mapping of every segment, so each creator unlinks its
name at once: the memory lives on in the mappings and goes away with the last process, so a rank
that crashes afterwards (even `kill -9`) leaves nothing in /dev/shm. Only a crash during init can
leave a name behind; the launcher removes those with `cleanup_segments(run_token)`.

Rejoining. A server's FFN ranks keep their names (`keep_name`, unlinked at close or by the server's
cleanup) so that a restarted attention replica can join the running world: it creates a segment of a
new generation (`afd_<run_token>_<world_rank>.<generation>`), maps only the ranks it writes to
(`peers`), passes no barrier, and drops its name once every one of them mapped it (`remap`).

Segments are opened with shm_open + mmap, not `multiprocessing.shared_memory`: Python's
`resource_tracker` (shared by spawned children) registers every attach and unlinks or warns at
exit about segments the process does not own. Here only the creator unlinks its segment.

Write ordering: payload then flag, in program order, with no fences. That is correct only where
stores become visible in program order (x86 TSO; glibc fences its non-temporal memcpy paths), so a
reader that sees the flag sees the payload. Weaker memory models (aarch64, e.g. Grace hosts) could
show the flag first: `ShmHeap` refuses to run there.
"""

from __future__ import annotations

import glob
import logging
import mmap
import os
import platform
import uuid
from collections.abc import Sequence

import torch
import torch.distributed as dist

from afd.transport.symm_heap import DEFAULT_TIMEOUT_S, SymmetricHeap, store_get

try:  # the POSIX shm_open/shm_unlink that multiprocessing.shared_memory itself uses
    import _posixshmem
except ImportError:  # pragma: no cover - non-POSIX
    _posixshmem = None

logger = logging.getLogger("afd.transport.shm")

SEGMENT_PREFIX = "afd_"
RUN_TOKEN_KEY = "afd_shm/run_token"
_TSO_MACHINES = ("x86_64", "amd64", "i386", "i686")  # total store order: payload-then-flag needs no fence


def check_store_ordering(machine: str | None = None) -> None:
    """Refuse hosts whose stores may become visible out of program order (the window has no fences)."""
    machine = machine if machine is not None else platform.machine()
    if machine.lower() not in _TSO_MACHINES:
        raise RuntimeError(
            f"the async connector's shared-memory window needs x86-64 store ordering but this host is "
            f"{machine or 'of unknown architecture'}: run async on an x86-64 host or use the p2p connector here "
            "(fences for weaker memory models are not supported yet)"
        )


def segment_name(run_token: str, world_rank: int, generation: int = 0) -> str:
    return f"{SEGMENT_PREFIX}{run_token}_{world_rank}" + (f".{generation}" if generation else "")


def new_run_token() -> str:
    return uuid.uuid4().hex[:16]


def read_run_token(store: dist.Store, timeout_s: float = DEFAULT_TIMEOUT_S) -> str:
    """The run token world rank 0 published (the launcher reads it to clean up after a crash)."""
    return store_get(store, RUN_TOKEN_KEY, timeout_s, "the shared-memory run token from world rank 0").decode()


def _shm_open(name: str, flags: int) -> int:
    if _posixshmem is None:  # pragma: no cover
        raise RuntimeError("POSIX shared memory is not available on this platform")
    return _posixshmem.shm_open("/" + name, flags, mode=0o600)


def _shm_unlink(name: str) -> bool:
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        return False
    return True


def cleanup_segments(run_token: str, world_size: int | None = None) -> list[str]:
    """Unlink every shared-memory segment of a run (launcher crash cleanup); returns the names removed.

    Lists /dev/shm where it exists; otherwise tries world ranks 0..world_size-1.
    """
    if not run_token or any(c in run_token for c in "/*?[]"):
        raise ValueError(f"invalid run token {run_token!r}")
    if os.path.isdir("/dev/shm"):
        names = [os.path.basename(p) for p in glob.glob(f"/dev/shm/{SEGMENT_PREFIX}{run_token}_*")]
    else:
        names = [segment_name(run_token, r) for r in range(world_size or 0)]
    removed = sorted(n for n in names if _shm_unlink(n))
    if removed:
        logger.info("removed %d shared-memory segments of run %s", len(removed), run_token)
    return removed


def _map(name: str, nbytes: int, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = _shm_open(name, flags)
    try:
        if create:
            os.ftruncate(fd, nbytes)  # zero-filled
        elif os.fstat(fd).st_size < nbytes:
            raise RuntimeError(
                f"segment {name} is {os.fstat(fd).st_size} bytes but this rank expects {nbytes}; "
                "every rank must be started with the same model and connector settings"
            )
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


class ShmHeap(SymmetricHeap):
    """Symmetric window over POSIX shared memory (single host by construction)."""

    def __init__(
        self,
        store: dist.Store,
        world_rank: int,
        world_size: int,
        nbytes: int,
        *,
        run_token: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        keep_name: bool = False,
        generation: int = 0,
        peers: Sequence[int] | None = None,
    ) -> None:
        """`keep_name`: leave this rank's segment name in place until `close` (a server's FFN rank, which a
        restarted replica maps later). `generation` > 0: join a running world (module docstring), mapping only
        `peers` (default every rank); the name stays until `release_name`."""
        check_store_ordering()
        super().__init__(store, world_rank, world_size, nbytes)
        self.generation = generation
        if run_token is None:
            if world_rank == 0:
                store.set(RUN_TOKEN_KEY, new_run_token())
            run_token = read_run_token(store, timeout_s)
        self.run_token = run_token
        self._maps: dict[int, mmap.mmap] = {}
        self._owns_segment = False
        try:
            self._maps[world_rank] = _map(self.segment, nbytes, create=True)
        except FileExistsError as e:
            raise RuntimeError(
                f"shared-memory segment {self.segment} already exists: another run uses token {run_token}; "
                f"remove it with afd.transport.shm.cleanup_segments('{run_token}')"
            ) from e
        self._owns_segment = True
        try:
            self.local = torch.frombuffer(self._maps[world_rank], dtype=torch.uint8, count=nbytes)  # [nbytes]
            self._views[world_rank] = self.local
            self.barrier("shm_created", timeout_s)
            for r in range(world_size) if peers is None else peers:
                if r != world_rank:
                    self._map_peer(r, segment_name(run_token, r))
            # nobody unlinks before every peer has mapped every segment
            self.barrier("shm_mapped", timeout_s)
            if not (keep_name or generation):
                self._unlink_own()  # every peer holds a mapping now: no crash from here on leaks the segment
        except BaseException:
            self.close()
            raise
        logger.debug("world rank %d mapped %d shared-memory windows of %d bytes", world_rank, world_size, nbytes)

    @property
    def segment(self) -> str:
        return segment_name(self.run_token, self.world_rank, self.generation)

    def _map_peer(self, world_rank: int, name: str) -> None:
        self._maps[world_rank] = _map(name, self.nbytes, create=False)
        self._views[world_rank] = torch.frombuffer(self._maps[world_rank], dtype=torch.uint8, count=self.nbytes)

    def remap(self, world_rank: int, generation: int) -> None:
        """Map the segment of `world_rank`'s restart `generation` in place of its previous one (whose views the
        caller dropped: a view still held keeps the old mapping alive until it goes)."""
        old = self._maps.pop(world_rank, None)
        self._views.pop(world_rank, None)
        if old is not None:
            try:
                old.close()
            except BufferError:
                pass
        self._map_peer(world_rank, segment_name(self.run_token, world_rank, generation))

    def release_name(self) -> None:
        """Unlink this rank's segment name (its peers mapped it): a crash from here on leaves nothing behind."""
        self._unlink_own()

    def _unlink_own(self) -> None:
        if self._owns_segment:
            self._owns_segment = False
            _shm_unlink(self.segment)

    def close(self) -> None:
        """Drop mappings (and unlink own segment if init failed before doing so). Tensors still held
        elsewhere keep their mapping alive."""
        if self._closed:
            return
        self._closed = True
        self._views.clear()
        self.local = torch.empty(0, dtype=torch.uint8)
        for m in self._maps.values():
            try:
                m.close()
            except BufferError:
                pass  # a tensor view is still alive; the mapping goes away with it
        self._maps.clear()
        self._unlink_own()
