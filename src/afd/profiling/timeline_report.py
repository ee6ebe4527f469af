"""Read the points `AFD_TIMELINE=DIR` wrote (`afd.profiling.timeline`) and say where each exchange's time went.

    python -m afd.profiling.timeline_report DIR [--json FILE]

Per attention rank, exchange by exchange: its attention compute (from the previous layer's reply to this send, on
its stream), the send, and the round trip as the stream saw it. With one attention rank and one FFN rank, the FFN's
points are matched to the sends in order, and the round trip splits into: the FFN host finding the item, the FFN
stream starting its pass, the pass with the reply's writes, and the reply reaching the attention stream. (p2p: the
FFN host "finds" a layer when it posts its receives, usually before the rows come; "pass" is when they came,
"answered" when the answer is computed, before NCCL sends it.)
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
import sys
from pathlib import Path


def load(folder: str | Path) -> dict[str, list[list]]:
    """Rank name → its points [key, layer, host_s, device_s]."""
    return {p.stem: json.loads(p.read_text())["points"] for p in sorted(Path(folder).glob("*.json"))}


def _by_key(points: list[list], key: str) -> list[list]:
    return [p for p in points if p[0] == key]


def _time(point: list) -> float:
    """The device time when there is one, else the host's."""
    return point[3] if point[3] is not None else point[2]


def attention_phases(points: list[list]) -> dict[str, list[float]]:
    """Seconds per exchange: compute (the reply that resumed this layer → its send: the host's last reply before the
    send, of an earlier layer of the same step; with micro-batches that is the same micro-batch's previous layer),
    send, round trip (replies come in send order), host lead (how far the host enqueued the send ahead of its
    stream: near 0 means the stream waited for its host), and the host's own time for each part: enqueueing the
    layer's attention (the reply that resumed it → its send), the send, and everything up to taking the reply
    (the shared experts when they run here, the recv). A stream that waits for its host is explained by these."""
    sends, sents, replies = (_by_key(points, k) for k in ("send", "sent", "reply"))
    out: dict[str, list[float]] = {"attention compute": [], "send": [], "round trip": [], "host lead": []}
    out |= {"host: attention": [], "host: send": [], "host: to the reply": []}
    # the shared experts on the attention rank (`shared_experts_on_attention`): sent → done, inside the round trip
    out["shared experts here"] = [
        _time(done) - _time(sent) for sent, done in zip(sents, _by_key(points, "shared"), strict=False)
    ]
    taken = 0  # replies the host had taken before the current send
    for send, sent, reply in zip(sends, sents, replies, strict=False):
        while taken < len(replies) and replies[taken][2] <= send[2]:
            taken += 1
        resumed = replies[taken - 1] if taken else None
        if resumed is not None and resumed[1] < send[1]:  # an earlier layer of the same step
            out["attention compute"].append(_time(send) - _time(resumed))
            out["host: attention"].append(send[2] - resumed[2])
        out["send"].append(_time(sent) - _time(send))
        out["round trip"].append(_time(reply) - _time(sent))
        out["host lead"].append(_time(send) - send[2])
        out["host: send"].append(sent[2] - send[2])
        out["host: to the reply"].append(reply[2] - sent[2])
    return out


def step_phases(points: list[list]) -> dict[str, list[float]]:
    """Seconds per engine step (the attention rank's "launch" and "tokens" points, host times): the whole step,
    its head (launch → the first send on the device), its tail (the last reply on the device → tokens on the
    host) and the host's time between a step's tokens and the next launch."""
    out: dict[str, list[float]] = {"step": [], "step head": [], "step tail": [], "between steps": []}
    launches, tokens = _by_key(points, "launch"), _by_key(points, "tokens")
    sends, replies = _by_key(points, "send"), _by_key(points, "reply")
    send_hosts, reply_hosts = [s[2] for s in sends], [r[2] for r in replies]  # ascending: noted in host order
    for k, (launch, done) in enumerate(zip(launches, tokens, strict=False)):
        out["step"].append(done[2] - launch[2])
        first = bisect.bisect_left(send_hosts, launch[2])  # the step's first send, if it is before its tokens
        last = bisect.bisect_right(reply_hosts, done[2]) - 1  # the step's last reply, if it is after its launch
        if first < len(sends) and sends[first][2] <= done[2] and last >= 0 and replies[last][2] >= launch[2]:
            out["step head"].append(_time(sends[first]) - launch[2])
            out["step tail"].append(done[2] - _time(replies[last]))
        if k + 1 < len(launches):
            out["between steps"].append(launches[k + 1][2] - done[2])
    return out


def split_round_trip(attention: list[list], ffn: list[list]) -> dict[str, list[float]]:
    """One attention rank against one FFN rank: the round trip's parts, item by item in order."""
    sents, replies = _by_key(attention, "sent"), _by_key(attention, "reply")
    found, passes, answered = (_by_key(ffn, k) for k in ("found", "pass", "answered"))
    names = ("FFN host finds it", "FFN host enqueues", "FFN stream starts", "FFN pass + reply writes",
             "reply reaches attention")  # fmt: skip
    out: dict[str, list[float]] = {name: [] for name in names}
    for sent, reply, f, p, a in zip(sents, replies, found, passes, answered, strict=False):
        if not sent[1] == f[1] == p[1] == a[1] == reply[1]:
            break  # out of step (a decode pass served on the device has no host points): stop matching
        out["FFN host finds it"].append(f[2] - _time(sent))
        out["FFN host enqueues"].append(a[2] - f[2])
        out["FFN stream starts"].append(_time(p) - f[2])
        out["FFN pass + reply writes"].append(_time(a) - _time(p))
        out["reply reaches attention"].append(_time(reply) - _time(a))
    return out


def summarize(phases: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    return {
        name: {"n": len(v), "p50_ms": statistics.median(v) * 1e3, "total_ms": sum(v) * 1e3}
        for name, v in phases.items()
        if v
    }


def report(folder: str | Path) -> dict[str, dict]:
    ranks = load(folder)
    result: dict[str, dict] = {}
    attention = {n: p for n, p in ranks.items() if "_attention" in n}
    ffn = {n: p for n, p in ranks.items() if "_ffn" in n}
    for name, points in attention.items():
        result[name] = summarize(attention_phases(points) | step_phases(points))
    if len(attention) == 1 and len(ffn) == 1:
        (a_name, a_points), (f_name, f_points) = next(iter(attention.items())), next(iter(ffn.items()))
        result[f"{a_name} <-> {f_name}"] = summarize(split_round_trip(a_points, f_points))
    return result


def format_report(result: dict[str, dict]) -> str:
    lines = []
    for section, phases in result.items():
        lines.append(section)
        for name, s in phases.items():
            lines.append(f"  {name:<26} n={s['n']:<5} p50 {s['p50_ms']:9.3f} ms   total {s['total_ms']:10.1f} ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m afd.profiling.timeline_report", description=__doc__.split("\n")[0])
    parser.add_argument("folder")
    parser.add_argument("--json", help="also write the summary here")
    args = parser.parse_args(argv)
    if not Path(args.folder).is_dir() or not list(Path(args.folder).glob("*.json")):
        sys.stderr.write(f"{args.folder}: no timeline files (run with AFD_TIMELINE={args.folder})\n")
        return 2
    result = report(args.folder)
    sys.stdout.write(format_report(result) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
