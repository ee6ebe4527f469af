"""The command line as a new user meets it (issue 9): one sentence and exit 2 for bad input, never a
traceback or a hang; signals end any command with one line and 128 + the signal number; runs that do
not fit the machine are refused with the numbers; every flag's help shows its default."""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.e2e import Leftovers, afd_worker, kill_all, start_long_launch, wait_for_workers, wait_gone

from afd.cli import input as cli_input
from afd.cli import main as cli
from afd.cli.main import UsageError
from afd.config import ConfigError, parse_config
from afd.distributed import signals
from afd.model.weights import load_attention_model, load_ffn_model, load_model_config
from afd.runtime import resources
from afd.runtime.launch import free_port

README = Path(__file__).resolve().parents[1] / "README.md"


def run_afd(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "afd", *args], capture_output=True, text=True, timeout=timeout)


def assert_one_sentence(proc: subprocess.CompletedProcess, message: str, code: int = 2) -> None:
    assert proc.returncode == code, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
    assert message in proc.stderr, proc.stderr


def main_exit(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str]:
    """`afd.cli.main.main` in this process (no interpreter start): its exit status and stderr."""
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:  # argparse rejects a flag's value
        code = exc.code
    return code, capsys.readouterr().err


# ---------------------------------------------------------------- the prompt-ids grammar
@pytest.mark.parametrize(
    "text, prompts",
    [
        ("1,2,3;4,5", [[1, 2, 3], [4, 5]]),
        (" 1 , 2 ;  3 ", [[1, 2], [3]]),
        ("0", [[0]]),
        ("007,10", [[7, 10]]),
    ],
)
def test_prompt_ids_grammar_accepts(text: str, prompts: list[list[int]]) -> None:
    assert cli_input.parse_prompt_ids(text) == prompts


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "--prompt-ids is empty"),
        ("   ", "--prompt-ids is empty"),
        ("1,,2", "has an empty token id"),
        ("1,2,", "has an empty token id"),
        (",1", "has an empty token id"),
        ("1;;2", "prompt 1 in --prompt-ids is empty"),
        ("1;2;", "prompt 2 in --prompt-ids is empty"),
        ("+3,1_0", "must be integers, got '+3'"),
        ("1,1_0", "must be integers, got '1_0'"),
        ("-1", "must be integers"),
        ("1.0", "must be integers"),
        ("0x10", "must be integers"),
        ("1 2", "must be integers, got '1 2'"),
        ("\u0663", "must be integers"),  # ARABIC-INDIC DIGIT THREE: int() takes it
        ("\uff11,2", "must be integers"),  # FULLWIDTH DIGIT ONE
        ("1\t,2", "must be integers"),
        ("9" * 5000, "far too large"),  # int() refuses > 4300 digits with a ValueError of its own
    ],
)
def test_prompt_ids_grammar_refuses_with_one_sentence(text: str, message: str) -> None:
    with pytest.raises(UsageError, match=re.escape(message)):
        cli_input.parse_prompt_ids(text)


def test_empty_prompt_ids_is_one_sentence_not_a_type_error() -> None:
    assert_one_sentence(run_afd("generate", "--model", "tiny", "--prompt-ids", ""), "--prompt-ids is empty")


# ---------------------------------------------------------------- prompts files
@pytest.mark.timeout(60)
def test_prompts_file_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt_ids": [1]}\n{"prompt_ids": [2]} \xe9\n')
    proc = run_afd("generate", "--model", "tiny", "--prompts-file", str(path))
    assert_one_sentence(proc, "is not UTF-8 text (byte 0xe9 at offset 40)")


@pytest.mark.timeout(30)
def test_fifo_and_device_are_refused_at_once(tmp_path: Path) -> None:
    """Opening a FIFO for reading blocks until a writer comes, and /dev/zero never ends: both hung."""
    fifo = tmp_path / "prompts.fifo"
    os.mkfifo(fifo)
    for path in (str(fifo), "/dev/zero"):
        proc = run_afd("generate", "--model", "tiny", "--prompts-file", path, timeout=20)
        assert_one_sentence(proc, "is not a regular file")
        proc = run_afd("config", path, timeout=20)
        assert_one_sentence(proc, "is not a regular file")
    assert_one_sentence(run_afd("config", str(tmp_path)), "is a directory")


def test_prompts_file_size_is_bounded(tmp_path: Path) -> None:
    path = tmp_path / "huge.jsonl"
    with open(path, "wb") as f:
        f.truncate(cli_input.MAX_PROMPTS_FILE_BYTES + 1)  # sparse: costs no disk
    with pytest.raises(UsageError, match="is larger than"):
        cli_input.read_prompts_file(str(path))


def test_prompts_line_with_a_duplicate_key(tmp_path: Path) -> None:
    path = tmp_path / "dup.jsonl"
    path.write_text('{"prompt_ids": [1]}\n{"prompt_ids": [1, 2], "prompt_ids": [3]}\n')
    with pytest.raises(UsageError, match="line 2 of .* gives the key 'prompt_ids' twice"):
        cli_input.read_prompts_file(str(path))


# ---------------------------------------------------------------- the model's positions
@pytest.mark.timeout(60)
def test_prompt_longer_than_the_models_positions(tmp_path: Path) -> None:
    """5000 tokens on `tiny` (4096 positions) ran and exited 0; a 3.5 M-token prompt tried to allocate 12 TB."""
    path = tmp_path / "long.jsonl"
    path.write_text('{"prompt_ids": [' + ",".join(["1"] * 3_500_000) + "]}\n")
    started = time.monotonic()
    proc = run_afd("generate", "--model", "tiny", "--prompts-file", str(path))
    assert_one_sentence(proc, "prompt 0 has 3500000 tokens, more than the 4096 positions of 'tiny'")
    assert time.monotonic() - started < 30
    ids = ",".join(["1"] * 5000)
    proc = run_afd("launch", "--model", "tiny", "--connector", "p2p", "--prompt-ids", ids)
    assert_one_sentence(proc, "prompt 0 has 5000 tokens, more than the 4096 positions")


@pytest.mark.timeout(60)
def test_prompt_plus_new_tokens_beyond_the_models_positions(capsys: pytest.CaptureFixture) -> None:
    ids = ",".join(["1"] * 4000)
    code, err = main_exit(capsys, "generate", "--model", "tiny", "--prompt-ids", f"1;{ids}", "--max-new-tokens", "97")
    assert code == 2 and "prompt 1 has 4000 tokens and --max-new-tokens is 97: 4097 positions" in err
    assert "lower --max-new-tokens to 96" in err
    proc = run_afd(
        "worker", "--role", "attention", "--rank", "0", "--model", "tiny", "--prompt-ids", ids, "--max-new-tokens", "97"
    )
    assert_one_sentence(proc, "prompt 0 has 4000 tokens and --max-new-tokens is 97")  # a hand-started rank too


# ---------------------------------------------------------------- numbers on the command line
@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0", "-inf", "soon"])
def test_timeout_must_be_finite_and_positive(capsys: pytest.CaptureFixture, value: str) -> None:
    code, err = main_exit(capsys, "generate", "--model", "tiny", "--prompt-ids", "1", f"--timeout={value}")
    assert code == 2 and "finite number of seconds greater than 0" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "--attention", "100000000000"], "at most 1024"),
        (["generate", "--ffn", "2000"], "at most 1024"),
        (["generate", "--attention", "+3"], "expected a positive integer"),
        (["generate", "--max-new-tokens", "1_0"], "expected a non-negative integer"),
        (["generate", "--port", "70000"], "port (1-65535)"),
        (["generate", "--max-num-batched-tokens", "99999999999999"], "at most 1048576"),
        (["topology", "--attention", "100000000000", "--ffn", "1"], "at most 1024"),
    ],
)
def test_numbers_are_bounded(capsys: pytest.CaptureFixture, argv: list[str], message: str) -> None:
    if argv[0] == "generate":
        argv = [*argv, "--model", "tiny", "--prompt-ids", "1"]
    code, err = main_exit(capsys, *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_config_rank_counts_are_bounded() -> None:
    with pytest.raises(ConfigError, match="num_ffn_ranks must be between 1 and 1024, got 100000000000"):
        parse_config({"num_ffn_ranks": 100_000_000_000})


@pytest.mark.parametrize(
    "text",
    [
        '{"port": 7000, "port": 7001}',
        '{"connector": "async", "connector_extra_config": {"ring_depth": 1, "ring_depth": 2}}',
    ],
)
def test_config_duplicate_keys_are_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="is given twice in the config"):
        parse_config(text)


# ---------------------------------------------------------------- resources
def loaded_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("gate_on_attention", [True, False])
def test_weight_estimate_equals_what_a_rank_loads(dtype: str, gate_on_attention: bool) -> None:
    config = load_model_config("tiny")
    kw = dict(dtype=dtype, gate_on_attention=gate_on_attention)
    assert resources.attention_weight_bytes(config, dtype, gate_on_attention=gate_on_attention) == loaded_bytes(
        load_attention_model("tiny", **kw)
    )
    assert resources.ffn_weight_bytes(config, dtype, num_experts=4, gate_on_attention=gate_on_attention) == (
        loaded_bytes(load_ffn_model("tiny", expert_range=(6, 10), **kw))
    )


def test_deepseek_v2_lite_needs_its_15_7_b_parameters() -> None:
    config = load_model_config("deepseek-v2-lite")
    (single,) = resources.run_needs(config, dtype="bfloat16", device="cpu", connector="none")
    assert 31.0e9 < single.host_bytes - resources.CPU_PROCESS_OVERHEAD < 31.8e9  # 15.7 B parameters x 2 bytes
    ranks = resources.run_needs(config, dtype="bfloat16", device="cpu", connector="p2p", num_attention=2, num_ffn=4)
    assert [r.role for r in ranks] == ["ffn"] * 4 + ["attention"] * 2  # world order of p2p
    ffn = ranks[0].host_bytes - resources.CPU_PROCESS_OVERHEAD
    attn = ranks[-1].host_bytes - resources.CPU_PROCESS_OVERHEAD
    assert attn < 2e9 and 7.5e9 < ffn < 8.5e9  # a quarter of the experts each, plus the shared experts


def test_kv_cache_of_a_replica_counts_its_own_prompts() -> None:
    config = load_model_config("tiny")
    per_token = resources.kv_bytes_per_token(config, "float32")
    assert per_token == (32 + 8) * 4 * 4
    ranks = resources.run_needs(
        config,
        dtype="float32",
        device="cpu",
        connector="async",
        num_attention=2,
        num_ffn=1,
        prompt_lengths=[100, 1, 50],
        max_new_tokens=11,
    )
    assert [r.role for r in ranks] == ["attention", "attention", "ffn"]  # world order of async
    assert ranks[0].host_bytes - ranks[1].host_bytes == (110 + 60 - 11) * per_token


def test_check_refuses_with_the_numbers() -> None:
    def rank(role: str, gib: float, gpu: int | None = None) -> resources.RankNeed:
        size = int(gib * resources.GiB)
        return resources.RankNeed(role, size, gpu, size if gpu is not None else 0)

    roomy = resources.Machine(cpus=2, mem_available=64 * resources.GiB)
    eight = [rank("attention", 0.3)] * 4 + [rank("ffn", 0.3)] * 4
    assert resources.check(eight, roomy) is None  # the CI's 8 ranks on 2 cores (5A3F, 4A4F) must pass
    many = [rank("attention", 0.3)] * 64 + [rank("ffn", 0.3)] * 64
    assert resources.check(many, roomy) == "128 ranks on 2 CPU cores is more than 4 per core (8 at most here)"
    big = [rank("single process", 63.2)]
    assert resources.check(big, resources.Machine(cpus=2, mem_available=13 * 10**9)) == (
        "the run needs about 67.9 GB of memory (one process of 67.9 GB) but this machine has 13.0 GB available"
    )
    assert resources.check(big, resources.Machine(cpus=2, mem_available=None)) is None  # unknown: not checked
    on_gpus = [rank("attention", 20, gpu=0), rank("ffn", 30, gpu=0), rank("ffn", 30, gpu=1)]
    gpus = resources.Machine(cpus=16, mem_available=None, gpu_free=(40 * 10**9, 140 * 10**9))
    assert resources.check(on_gpus, gpus) == (
        "GPU 0 would need about 53.7 GB (1 attention rank of up to 21.5 GB, 1 ffn rank of up to 32.2 GB) "
        "but has 40.0 GB free"
    )


def test_meminfo() -> None:
    text = "MemTotal:       24684096 kB\nMemFree:  100 kB\nMemAvailable:   23873484 kB\n"
    assert resources.parse_meminfo(text) == 23873484 * 1024
    assert resources.parse_meminfo("MemTotal: 1 kB\n") is None


@pytest.mark.timeout(60)
def test_too_many_ranks_for_this_machine_are_refused_before_starting() -> None:
    """`--attention 64 --ffn 64` on 2 cores started 128 processes."""
    cpus = resources.usable_cpus()
    n = 2 * cpus + 1
    proc = run_afd(
        "generate", "--model", "tiny", "--prompt-ids", "1", "--connector", "p2p", "--attention", str(n), "--ffn", str(n)
    )
    assert_one_sentence(proc, f"{2 * n} ranks on {cpus} CPU core")
    assert "--skip-resource-check" in proc.stderr


def test_memory_refusal_and_the_flag_that_skips_it(capsys: pytest.CaptureFixture, monkeypatch) -> None:
    small = resources.Machine(cpus=64, mem_available=100 * 10**6)
    monkeypatch.setattr(resources, "probe_machine", lambda gpus: small)
    argv = ["generate", "--model", "tiny", "--prompt-ids", "1,2", "--max-new-tokens", "2"]
    code, err = main_exit(capsys, *argv)
    assert code == 2 and "of memory (one process of 0.3 GB) but this machine has 0.1 GB available" in err
    code, err = main_exit(capsys, "demo", "--connectors", "async")
    assert code == 2 and "but this machine has 0.1 GB available" in err
    assert cli.main([*argv, "--skip-resource-check"]) == 0
    assert "->" in capsys.readouterr().out


# ---------------------------------------------------------------- signals
def _default_signals() -> None:
    """The child starts with default dispositions even if this test runs under nohup or in the background."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def start_afd(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "afd", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=_default_signals,
    )


def wait_until_caught(proc: subprocess.Popen, sig: int, timeout_s: float = 60) -> None:
    """Until the process has a handler for `sig` (its SigCgt mask in /proc), i.e. afd's main() has begun."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"afd ended early: {proc.communicate()[1][-2000:]}"
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
            mask = int(re.search(r"^SigCgt:\s*([0-9a-f]+)", status, re.M).group(1), 16)
        except (OSError, AttributeError):
            mask = 0
        if mask >> (sig - 1) & 1:
            return
        time.sleep(0.05)
    raise AssertionError(f"afd did not install a handler for signal {sig} within {timeout_s} s")


def test_watchdog_ends_a_process_whose_main_thread_does_not_react() -> None:
    """A rank blocked in a C call (a gloo wait) runs no Python handler, and a library may swallow the
    exception: the watchdog still sees the signal (wakeup fd) and leaves with 128 + signum after its grace."""
    said, left = [], []
    watchdog = signals.SignalWatchdog()
    watchdog.configure(0.2, said.append, left.append)
    previous = signal.signal(signal.SIGHUP, lambda *_: None)  # a handler whose effect is lost
    watchdog.start()
    try:
        os.kill(os.getpid(), signal.SIGHUP)
        deadline = time.monotonic() + 10
        while not left and time.monotonic() < deadline:
            time.sleep(0.05)
        assert left == [129] and said == ["interrupted by SIGHUP (still busy 0.2 s later)"]
    finally:
        watchdog.stop()
        signal.signal(signal.SIGHUP, previous)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGHUP, 129)])
def test_signal_ends_generate_with_one_line(sig: int, code: int) -> None:
    """A 20-line KeyboardInterrupt traceback before; SIGTERM exited as if by SIGINT."""
    proc = start_afd("generate", "--model", "tiny", "--prompt-ids", "1,2,3", "--max-new-tokens", "4000")
    try:
        wait_until_caught(proc, signal.SIGTERM)  # afd's own handlers are in place (SIGINT has one from startup)
        time.sleep(1.0)  # into the generation
        assert proc.poll() is None
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == code, err[-2000:]
        assert err.strip() == f"afd: interrupted by {signal.Signals(sig).name}", err[-2000:]
    finally:
        kill_all([proc])


@pytest.mark.timeout(90)
def test_sigterm_ends_a_hand_started_worker_with_143() -> None:
    """A rank blocked in its rendezvous (its peer never comes) is in a C call: it still leaves, in seconds."""
    config = {"connector": "p2p", "port": free_port(), "num_attention_ranks": 1, "num_ffn_ranks": 1}
    proc = afd_worker(config, "ffn", 0)
    try:
        wait_until_caught(proc, signal.SIGTERM)
        time.sleep(2.0)  # into the rendezvous wait
        assert proc.poll() is None
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert time.monotonic() - sent < signals.WORKER_SIGNAL_GRACE_S + 5
        assert proc.returncode == 143, err[-2000:]
        assert "interrupted by SIGTERM" in err and "Traceback" not in err, err[-2000:]
    finally:
        kill_all([proc])


@pytest.mark.timeout(120)
def test_sigterm_ends_launch_with_143_and_stops_its_ranks() -> None:
    leftovers = Leftovers()
    launcher = start_long_launch(free_port(), "p2p")
    try:
        pids = wait_for_workers(4)
        time.sleep(1.0)
        assert launcher.poll() is None
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=40)
        assert launcher.returncode == 143, err[-2000:]
        assert err.strip().splitlines()[-1] == "afd: interrupted by SIGTERM" and "Traceback" not in err, err
        assert not wait_gone(pids, 10), "ranks left behind"
    finally:
        kill_all([launcher])
        leftovers.cleanup()


# ---------------------------------------------------------------- help, connectors, first contact
def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_flag_has_help_and_shows_its_default() -> None:
    parser = cli.build_parser()
    for name, sub in {"afd": parser, **subparsers(parser)}.items():
        text = sub.format_help()
        for action in sub._actions:
            if isinstance(action, argparse._SubParsersAction | argparse._HelpAction):
                continue
            assert action.help, f"afd {name} {action.option_strings or action.dest} has no help text"
            if action.option_strings and action.default not in (None, False):
                shown = str(action.default)
                assert f"(default: {shown})" in " ".join(text.split()), f"afd {name} {action.option_strings}"
    flat = " ".join(subparsers(parser)["generate"].format_help().split())
    assert "seconds before the whole run is given up (default: 600.0)" in flat
    assert "prompt length on replica 0 (default: 1024)" in " ".join(subparsers(parser)["bench"].format_help().split())


@pytest.mark.parametrize(
    "text, names",
    [
        ("p2p", ("p2p",)),
        ("async,p2p", ("async", "p2p")),
        ("p2p, async,p2p", ("p2p", "async")),
        ("async,async", ("async",)),
    ],
)
def test_connector_list(text: str, names: tuple[str, ...]) -> None:
    assert cli_input.connector_list(text) == names


@pytest.mark.parametrize("text", ["", "p2p,", "nccl", "p2p,nccl", "P2P"])
def test_connector_list_refuses(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="--connectors takes p2p and/or async"):
        cli_input.connector_list(text)


def test_demo_runs_the_connectors_and_device_it_is_given(capsys: pytest.CaptureFixture, monkeypatch) -> None:
    """`afd demo --connectors` took four literal strings, and the demo ignored --connectors and --device."""
    import afd.bench.demo

    seen = {}

    def fake_run_demo(**kwargs):
        seen.update(kwargs)
        raise UsageError("stop here")

    monkeypatch.setattr(afd.bench.demo, "run_demo", fake_run_demo)
    code, err = main_exit(capsys, "demo", "--connectors", "async, p2p,async")
    assert code == 2 and "stop here" in err
    assert seen["connectors"] == ("async", "p2p") and seen["device"] == "cpu"
    code, err = main_exit(capsys, "demo", "--connectors", "p2p,mpi")
    assert code == 2 and "--connectors takes p2p and/or async" in err and len(err.strip().splitlines()) == 1


def test_readme_puts_the_cpu_install_first() -> None:
    """On a CPU-only machine, `pip install -e .` pulls the CUDA build of torch (~5.5 GB with its NVIDIA
    packages); the README's first command must take the CPU build, and still install and run the demo."""
    text = README.read_text()
    two_commands = text[text.index("## Two commands") :]
    blocks = re.findall(r"```bash\n(.*?)```", two_commands, re.S)
    demo, tests = blocks[0], blocks[1]
    cpu_index = "--index-url https://download.pytorch.org/whl/cpu"
    assert cpu_index in demo and demo.index(cpu_index) < demo.index("pip install -e .") < demo.index("afd demo")
    assert cpu_index in tests and "python -m pytest" in tests
