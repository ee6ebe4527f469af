"""`afd serve`'s HTTP application over in-process replicas: threads that each run the real replica loop
(`afd.runtime.online.serve_replica`) over a real `Engine` on the tiny model, behind the real server on a free port
(uvicorn, real sockets). Greedy tokens compare with `afd.engine.generate.generate` in seconds."""

from __future__ import annotations

import asyncio
import socket
import threading
from email.message import Message

from helpers.http_client import http_request, sse_events

MODEL = "tiny"
SECRET = b"test-secret"


class InProcessServer:
    """`afd.serve.server.serve` on a free port in a thread, over `num_replicas` replica threads."""

    def __init__(self, num_replicas: int = 2, *, max_num_seqs: int = 8, healer=None, **options) -> None:
        """`healer(pool, link)`: the `afd.serve.healing.Healer` to serve with (None: none, as before)."""
        from afd.engine.engine import Engine, LocalExchange
        from afd.model.weights import load_attention_model, load_ffn_model, load_model_config
        from afd.runtime.link import FrontLink
        from afd.serve.frontend import ReplicaPool
        from afd.serve.state import ServeOptions, ServerState
        from afd.serve.tokenizer import load_tokenizer

        link = FrontLink(SECRET)
        self.link = link
        self.max_num_seqs = max_num_seqs
        self.engines = []
        self.threads = []
        for r in range(num_replicas):
            engine = Engine(
                load_attention_model(MODEL), LocalExchange(load_ffn_model(MODEL)), 256, max_num_seqs=max_num_seqs
            )
            self.engines.append(engine)
            self.threads.append(None)
            self.start_replica(r)
        link.accept(num_replicas, timeout_s=30)
        pool = ReplicaPool(link.conns, link.hellos)
        config = load_model_config(MODEL)
        options = ServeOptions(model_name=MODEL, **options)
        healer = healer(pool, link) if healer is not None else None
        self.state = ServerState(pool, load_tokenizer(MODEL, config.vocab_size), options, healer)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.ready = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(30), "the in-process server did not start"

    def start_replica(self, r: int) -> None:
        """Replica r's loop in a thread of its own (again, after its link was cut: a restart), over its engine."""
        from afd.runtime.link import ReplicaLink
        from afd.runtime.online import serve_replica

        engine = self.engines[r]
        hello = {
            "replica": r,
            "max_num_seqs": self.max_num_seqs,
            "max_model_len": engine.max_model_len,
            "vocab_size": engine.model.config.vocab_size,
            "num_cache_tokens": engine.kv_cache.num_tokens,
        }

        def run() -> None:
            replica_link = ReplicaLink(self.link.address, SECRET, hello)
            try:
                serve_replica(engine, replica_link)
            finally:
                replica_link.close()

        self.threads[r] = threading.Thread(target=run, daemon=True)
        self.threads[r].start()

    def cut(self, r: int) -> None:
        """Break replica r's link from the front end's side, as a replica process that died would."""
        sock = socket.socket(fileno=self.link.conns[r].fileno())
        sock.shutdown(socket.SHUT_RDWR)
        sock.detach()

    def _run(self) -> None:
        from afd.serve.server import serve

        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            self.stop = asyncio.Event()
            await serve(self.state, self.sock, self.stop, self.ready.set)

        asyncio.run(main())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(30)
        for t in self.threads:
            t.join(10)
        self.link.close()

    def request(self, method: str, path: str, body=None, headers=None) -> tuple[int, dict | str, Message]:
        return http_request(self.port, method, path, body, headers)

    def post(self, path: str, body, **kw):
        return self.request("POST", path, body, **kw)

    def stream(self, path: str, body: dict) -> list[dict | str]:
        return sse_events(self.port, path, body)
