"""How much more a Python path costs when it runs once a second than back to back, on this host.

The front end's share of TTFT at 1 request/s is Python that runs once a second. This times one
request's front-end work (the body parsed and checked, the `add` pickled and unpickled) once every
`--every` seconds ("cold") and 200 times back to back ("warm"), in three settings: the process busy polling
(an asyncio loop that never sleeps, as a busy-polling server's), sleeping between runs, and busy polling pinned to
one CPU. Then one link hop: a pickled `add` over a Unix socket pair to a busy-polling process and back,
cold and warm. Prints one JSON object.

    python scripts/cold_path.py [--samples 20] [--every 1.0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pickle
import select
import socket
import statistics
import time

from afd.runtime.link import decode_frames, encode_frame
from afd.serve.protocol import parse_completion

BODY = json.dumps(
    {"model": "m", "prompt": list(range(1, 129)), "max_tokens": 32, "temperature": 0, "stream": True}
).encode()
ADD = {"type": "add", "rid": "cmpl-0", "prompt_ids": list(range(128)), "max_tokens": 32, "sampling": {}}


def work() -> None:
    parse_completion(json.loads(BODY)).generation()
    list(decode_frames(bytearray(encode_frame(ADD))))


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


async def cold(samples: int, every: float, spin: bool) -> list[float]:
    async def spinner() -> None:
        while True:
            await asyncio.sleep(0)

    task = asyncio.create_task(spinner()) if spin else None
    out = []
    for _ in range(samples):
        await asyncio.sleep(every)
        out.append(timed(work))
    if task:
        task.cancel()
    return out


def summary(values: list[float]) -> dict:
    return {"p50_us": statistics.median(values) * 1e6, "min_us": min(values) * 1e6}


def echo(sock: socket.socket) -> None:
    """The other process: busy polls its end, answers every message with the message."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    while True:
        if poller.poll(0):
            data = sock.recv(1 << 20)
            if not data:
                return
            sock.sendall(data)


def hop(samples: int, every: float) -> dict:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:
        a.close()
        echo(b)
        os._exit(0)
    b.close()
    frame = pickle.dumps(ADD)

    def round_trip() -> float:
        t = time.perf_counter()
        a.sendall(frame)
        got = 0
        while got < len(frame):
            got += len(a.recv(1 << 20))
        return time.perf_counter() - t

    warm = [round_trip() for _ in range(200)][50:]
    cold_rt = []
    for _ in range(samples):
        end = time.perf_counter() + every
        while time.perf_counter() < end:  # busy, as the front end's loop is
            pass
        cold_rt.append(round_trip())
    a.close()
    os.waitpid(pid, 0)
    return {"warm": summary(warm), "cold": summary(cold_rt)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--every", type=float, default=1.0)
    args = parser.parse_args()
    for _ in range(300):
        work()
    warm = [timed(work) for _ in range(200)]
    result = {"cpus": os.cpu_count(), "warm": summary(warm)}
    result["cold_busy_polling"] = summary(asyncio.run(cold(args.samples, args.every, True)))
    result["cold_sleeping"] = summary(asyncio.run(cold(args.samples, args.every, False)))
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})
    result["cold_busy_polling_pinned"] = summary(asyncio.run(cold(args.samples, args.every, True)))
    os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    result["hop_round_trip"] = hop(args.samples, args.every)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
