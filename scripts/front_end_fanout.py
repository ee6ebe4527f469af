"""How many streamed tokens per second afd serve's front end passes on, with no engine to wait for.

    PYTHONPATH=src python3 scripts/front_end_fanout.py [--streams 1024] [--max-tokens 32] [--step-ms 0] [--json F]

Three processes, as a served run has them: the real front end (`afd.serve.server.serve`: FastAPI, uvicorn, the
replica pool), one replica running the real replica loop (`afd.runtime.online.serve_replica`) over an engine that
computes nothing (every running request gets one token per step, each step lasting `--step-ms`), and this process
as the client (`afd.bench.serve_client.bench_url`, every request at once). With `--step-ms 0` the replica steps as
fast as the front end takes its tokens, so the run's output tokens/s is the front end's fan-out rate, and its
inter-token latency what one step of `--streams` streams costs it. `front_cpu_us_per_token`: the front end's own CPU
time per token passed on (start-up included), the figure that holds on a host whose cores the three processes
share. Any CPU; compare trees by PYTHONPATH.
`--profile-front FILE`: the front end's process under cProfile (read it with `python -m pstats FILE`);
`--profile-client FILE` the client's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import socket
import time
from types import SimpleNamespace

SECRET = b"fanout"
VOCAB = 256


class NoComputeEngine:
    """What `serve_replica` drives, without a model: each step gives every running request one token."""

    def __init__(self, step_s: float) -> None:
        from collections import Counter

        import torch

        from afd.engine.model_runner import StepClock

        self.step_s, self.live, self.next_id, self.last_step_tokens = step_s, {}, 0, []
        self.step_in_flight, self.overlapped_steps = False, 0
        self.runner = SimpleNamespace(step_clock=StepClock(torch.device("cpu")))
        self.scheduler = SimpleNamespace(not_ahead=Counter())

    def add(self, request) -> int:
        self.live[self.next_id] = [request.max_new_tokens, 0]
        self.next_id += 1
        return self.next_id - 1

    def abort(self, request_id: int):
        from afd.engine.request import Output

        left = self.live.pop(request_id, None)
        return None if left is None else Output([], [7] * left[1], [-0.5] * left[1], None, request_id, "abort")

    def has_work(self) -> bool:
        return bool(self.live)

    def step_running(self) -> bool:
        return False

    def step(self) -> list:
        from afd.engine.request import Output, StepToken

        if self.step_s:
            time.sleep(self.step_s)
        self.last_step_tokens = [StepToken(i, 7, -0.5) for i in self.live]
        done = []
        for i, state in list(self.live.items()):
            state[1] += 1
            if state[1] == state[0]:
                del self.live[i]
                done.append(Output([], [7] * state[1], [-0.5] * state[1], None, i, "length"))
        return done

    def load(self):
        from afd.engine.request import EngineLoad

        return EngineLoad(len(self.live), 0, 0.0)


def run_replica(address, step_s: float, max_num_seqs: int) -> None:
    from afd.runtime.link import ReplicaLink
    from afd.runtime.online import serve_replica

    hello = {"replica": 0, "max_num_seqs": max_num_seqs, "max_model_len": 4096, "vocab_size": VOCAB,
             "num_cache_tokens": 1 << 20}  # fmt: skip
    link = ReplicaLink(address, SECRET, hello)
    try:
        serve_replica(NoComputeEngine(step_s), link)
    finally:
        link.close()


def run_front_end(port_out, stop_reader, streams: int, profile_path: str | None = None) -> None:
    from afd.runtime.link import FrontLink
    from afd.serve import loop
    from afd.serve.frontend import ReplicaPool
    from afd.serve.server import serve
    from afd.serve.state import ServeOptions, ServerState
    from afd.serve.tokenizer import ByteTokenizer

    link = FrontLink(SECRET)
    port_out.put(link.address)
    link.accept(1, timeout_s=60)
    state = ServerState(ReplicaPool(link.conns, link.hellos), ByteTokenizer(VOCAB),
                        ServeOptions(model_name="fanout", max_waiting=streams))  # fmt: skip
    sock = socket.create_server(("127.0.0.1", 0))

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_reader(stop_reader.fileno(), stop.set)  # the parent writes to the pipe when it is done
        await serve(state, sock, stop, lambda: port_out.put(sock.getsockname()[1]))

    started = time.process_time()
    if profile_path:  # the front end's own functions by time, over the whole run
        import cProfile

        profile = cProfile.Profile()
        profile.runcall(loop.run, main())
        profile.dump_stats(profile_path)
    else:
        loop.run(main())  # the event loop afd serve runs on (uvloop's where installed)
    port_out.put(time.process_time() - started)  # the front end's CPU seconds: its cost, whatever else the host runs
    link.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--step-ms", type=float, default=0.0)
    parser.add_argument("--prompt-len", type=int, default=8, help="tokens per prompt (the size of each `add`)")
    parser.add_argument("--json")
    parser.add_argument("--profile-front", metavar="FILE", help="cProfile the front end's process into FILE (pstats)")
    parser.add_argument("--profile-client", metavar="FILE", help="cProfile this process (the client) into FILE")
    args = parser.parse_args()

    from afd.bench.serve_client import bench_url
    from afd.bench.workload import Workload

    ctx = mp.get_context("spawn")
    out, (stop_r, stop_w) = ctx.Queue(), mp.Pipe(duplex=False)
    front = ctx.Process(target=run_front_end, args=(out, stop_r, args.streams, args.profile_front), daemon=True)
    front.start()
    address = out.get(timeout=60)
    replica = ctx.Process(target=run_replica, args=(address, args.step_ms / 1e3, args.streams), daemon=True)
    replica.start()
    port = out.get(timeout=60)
    n = args.prompt_len
    workload = Workload("uniform", requests=args.streams, long_len=n, short_len=n, max_tokens=args.max_tokens)
    client = None
    if args.profile_client:  # the client's own cost per event: is it the client or the front end that keeps up?
        import cProfile

        client = cProfile.Profile()
        client.enable()
    try:
        (run,) = bench_url(f"http://127.0.0.1:{port}", workload, [float("inf")], vocab_size=VOCAB)
    finally:
        if client is not None:
            client.disable()
            client.dump_stats(args.profile_client)
        stop_w.send(b"x")
        front_cpu_s = out.get(timeout=30)
        front.join(30)
        replica.join(30)
    s = run["summary"]
    itl = sorted(g for r in run["requests"] for g in r["itl_s"])
    to_replica = sorted(r["stages_s"]["sent_to_replica"] for r in run["requests"] if r.get("stages_s"))
    row = {
        "streams": args.streams,
        "max_tokens": args.max_tokens,
        "step_ms": args.step_ms,
        "completed": s["completed"],
        "wall_s": round(s["wall_s"], 3),
        "output_tok_s": round(s["output_tok_s"], 1),
        "us_per_token": round(1e6 / s["output_tok_s"], 1) if s["output_tok_s"] else None,
        "itl_p50_ms": round(itl[len(itl) // 2] * 1e3, 2) if itl else None,
        "ttft_p50_ms": round(s["ttft_p50_s"] * 1e3, 1),
        # from the front end's send of a request to the replica taking it: how fast a burst of `add`s crosses
        "sent_to_replica_p50_ms": round(to_replica[len(to_replica) // 2] * 1e3, 1) if to_replica else None,
        "sent_to_replica_p90_ms": round(to_replica[9 * len(to_replica) // 10] * 1e3, 1) if to_replica else None,
        "front_cpu_s": round(front_cpu_s, 3),
        "front_cpu_us_per_token": round(front_cpu_s * 1e6 / max(s["output_tokens"], 1), 1),
    }
    print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f)


if __name__ == "__main__":
    main()
