"""The command line as a new user meets it: one sentence and exit 2 for bad input, never a
traceback or a hang; signals end any command with one line and 128 + the signal number; runs that do
not fit the machine are refused with the numbers; every flag's help shows its default."""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
from helpers.cli import main_exit

from afd.cli import input as cli_input
from afd.cli import main as cli
from afd.cli.main import UsageError
from afd.config import ConfigError, parse_config
from afd.distributed import signals
from afd.model.weights import load_attention_model, load_ffn_model, load_model_config
from afd.runtime import resources

README = Path(__file__).resolve().parents[2] / "README.md"


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


def test_a_signal_during_an_import_is_raised_once_the_import_is_over(tmp_path: Path, monkeypatch) -> None:
    """An exception raised inside an import can cross a C extension's frames (torch's import runs Python from
    C++, which then aborts with a stack dump): the handler holds the signal back and plays it again, so the
    import runs to its end and Interrupted comes right after it."""
    (tmp_path / "slow_import_for_signals.py").write_text(
        "import os, signal, time\nos.kill(os.getpid(), signal.SIGHUP)\nend = time.monotonic() + 0.3\n"
        "while time.monotonic() < end:\n    pass\nDONE = True\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    stages: list[str] = []
    previous = signals.install_handlers()
    try:
        with pytest.raises(signals.Interrupted) as caught:
            import slow_import_for_signals  # noqa: F401

            stages.append("imported")
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                time.sleep(0.01)
        assert caught.value.signum == signal.SIGHUP and stages == ["imported"]
        assert sys.modules["slow_import_for_signals"].DONE
    finally:
        signals.restore_handlers(previous)
        sys.modules.pop("slow_import_for_signals", None)


def test_a_signal_while_the_handlers_start_is_one_line(capsys: pytest.CaptureFixture, monkeypatch) -> None:
    """A signal that lands while `main` installs its handlers and starts the watchdog ends the command like any
    other: one line, 128 + signum, the handlers given back."""
    before = signal.getsignal(signal.SIGTERM)

    def interrupted_start(self) -> None:
        raise signals.Interrupted(signal.SIGTERM)

    monkeypatch.setattr(signals.SignalWatchdog, "start", interrupted_start)
    assert cli.main(["config", "--help"]) == 128 + signal.SIGTERM
    assert capsys.readouterr().err.strip() == "afd: interrupted by SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before


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
