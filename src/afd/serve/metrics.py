"""`GET /metrics`: the server's gauges, counters and histograms through `prometheus_client`, labelled by `replica`.

Each server has a registry of its own (`ServeMetrics`), so several servers in one process (tests) never share a
series. A replica's series are bound once (`ReplicaMetrics`): the hot path observes without a label lookup.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = CONTENT_TYPE_LATEST

# vLLM's buckets: TTFT from 1 ms to 2.5 min, inter-token latency from 1 ms to 80 s, end to end from 0.3 s to 16 min
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
TTFT_BUCKETS += (40.0, 80.0, 160.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
ITL_BUCKETS += (5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)
E2E_BUCKETS += (480.0, 960.0)

# the series a benchmark reads before and after a run, to set the steps' device time beside its wall time
STEP_DEVICE_SECONDS, STEPS, STEP_IDLE_SECONDS = "afd_step_device_seconds", "afd_steps", "afd_step_idle_seconds"
PROMPT_STEP_DEVICE_SECONDS, PROMPT_STEPS = "afd_prompt_step_device_seconds", "afd_prompt_steps"


class ReplicaMetrics:
    """One replica's series: what it reported (`load` messages) and what the front end measured."""

    def __init__(self, families: ServeMetrics, replica: int) -> None:
        label = str(replica)
        self.running = families.running.labels(label)
        self.waiting = families.waiting.labels(label)
        self.cache_usage = families.cache_usage.labels(label)
        self.graphs_captured = families.graphs_captured.labels(label)
        self.step_device = families.step_device.labels(label)
        self.steps = families.steps.labels(label)
        self.step_idle = families.step_idle.labels(label)
        self.prompt_step_device = families.prompt_step_device.labels(label)
        self.prompt_steps = families.prompt_steps.labels(label)
        self.prompt_tokens = families.prompt_tokens.labels(label)
        self.generation_tokens = families.generation_tokens.labels(label)
        self.ttft = families.ttft.labels(label)
        self.engine_ttft = families.engine_ttft.labels(label)
        self.itl = families.itl.labels(label)
        self.e2e = families.e2e.labels(label)
        self._finished = families.finished
        self._label = label

    def finished(self, reason: str) -> None:
        """A request of this replica ended (stop, length, abort or error)."""
        self._finished.labels(self._label, reason).inc()


class ServeMetrics:
    """Every series of one server, in a registry of its own; `replicas[r]` is replica r's."""

    def __init__(self, num_replicas: int) -> None:
        r = self.registry = CollectorRegistry()
        by = ["replica"]
        self.healthy = Gauge("afd_healthy", "1 while every rank of the server is alive, else 0.", registry=r)
        self.replicas_alive = Gauge("afd_replicas_alive", "Replicas whose link to the front end is up.", registry=r)
        self.rank_restarts = Counter(
            "afd_rank_restarts", "Restarts of the replica's ranks after one of them died.", by, registry=r
        )
        self.front_waiting = Gauge(
            "afd_front_end_waiting", "Requests the front end holds beyond the replicas' running capacity.", registry=r
        )
        self.running = Gauge("afd_num_requests_running", "Requests in the replica's running batch.", by, registry=r)
        self.waiting = Gauge(
            "afd_num_requests_waiting", "Requests queued in the replica, not yet admitted.", by, registry=r
        )
        self.cache_usage = Gauge(
            "afd_kv_cache_usage_perc", "Fraction of the replica's KV-cache blocks in use (0..1).", by, registry=r
        )
        self.graphs_captured = Gauge(
            "afd_graphs_captured_while_serving",
            "CUDA graphs (decode, prefill) the replica captured inside a step rather than at warm-up (0 when warmed).",
            by,
            registry=r,
        )
        self.step_device = Gauge(
            STEP_DEVICE_SECONDS,
            "Device time of the replica's engine steps since its start, CUDA events around each (0 on CPU).",
            by,
            registry=r,
        )
        self.steps = Gauge(STEPS, "Engine steps the replica's step device time counts.", by, registry=r)
        self.step_idle = Gauge(
            STEP_IDLE_SECONDS,
            "Device idle time between the replica's steps while it had work (0 on CPU).",
            by,
            registry=r,
        )
        self.prompt_step_device = Gauge(
            PROMPT_STEP_DEVICE_SECONDS,
            "The part of the step device time spent in steps holding a prompt token (prefill or mixed).",
            by,
            registry=r,
        )
        self.prompt_steps = Gauge(PROMPT_STEPS, "Engine steps that held a prompt token.", by, registry=r)
        self.prompt_tokens = Counter(
            "afd_prompt_tokens", "Prompt tokens of the requests sent to the replica.", by, registry=r
        )
        self.generation_tokens = Counter("afd_generation_tokens", "Tokens the replica generated.", by, registry=r)
        self.finished = Counter(
            "afd_request_success", "Requests that ended, by finish reason.", ["replica", "finished_reason"], registry=r
        )
        self.ttft = Histogram(
            "afd_time_to_first_token_seconds",
            "Time from a request's arrival to its first token.",
            by,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.engine_ttft = Histogram(
            "afd_engine_time_to_first_token_seconds",
            "Time from a request reaching its replica to the end of the step that made its first token.",
            by,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "afd_inter_token_latency_seconds",
            "Time between two tokens of one request.",
            by,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "afd_e2e_request_latency_seconds",
            "Time from a request's arrival to its end.",
            by,
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.replicas = [ReplicaMetrics(self, i) for i in range(num_replicas)]
        for i in range(num_replicas):
            self.rank_restarts.labels(str(i))  # every replica's series, at 0 before any restart

    def render(self, *, healthy: bool, front_waiting: int, replicas_alive: int | None = None) -> bytes:
        """The whole `/metrics` page, in the Prometheus text format."""
        self.healthy.set(int(healthy))
        self.front_waiting.set(front_waiting)
        if replicas_alive is not None:
            self.replicas_alive.set(replicas_alive)
        return generate_latest(self.registry)
