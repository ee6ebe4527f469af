"""Sampling beyond greedy: temperature 0 stays the greedy path bit for bit, a seed
reproduces a request's tokens whatever shares its batch, top-k / top-p restrict the support, bad values are
one sentence, and launched ranks sample exactly as the single process does."""

from __future__ import annotations

import math

import pytest
import torch

from afd.cli.args import sampling_params
from afd.cli.main import build_parser
from afd.engine.engine import Engine, LocalExchange, Request
from afd.engine.generate import generate
from afd.engine.sampling import SamplingParams, mix32, sample
from afd.model.weights import load_attention_model, load_ffn_model
from afd.runtime.launch import sampling_flags

PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [4, 8], [100, 3, 77, 12]]
NEW = 8


def random_logprobs(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(3 * torch.randn(rows, vocab, generator=g), dim=-1)


def tiny_engine() -> Engine:
    attn, ffn = load_attention_model("tiny"), load_ffn_model("tiny")
    return Engine(attn, LocalExchange(ffn), 8192, max_num_seqs=16)


def run_requests(requests: list[Request]) -> list[list[int]]:
    engine = tiny_engine()
    for r in requests:
        engine.add(r)
    return [o.token_ids for o in engine.run()]


# ---------------------------------------------------------------- greedy stays greedy
def test_temperature_zero_is_argmax_bit_for_bit() -> None:
    logprobs = random_logprobs(6, 300)
    want = logprobs.argmax(dim=-1)
    assert torch.equal(sample(logprobs, [None] * 6, range(6)), want)
    assert torch.equal(sample(logprobs, [SamplingParams()] * 6, range(6)), want)
    assert torch.equal(sample(logprobs, [SamplingParams(top_p=0.5, top_k=3, seed=1)] * 6, range(6)), want)


def test_greedy_rows_of_a_mixed_batch_stay_argmax() -> None:
    logprobs = random_logprobs(6, 300, seed=1)
    params = [None, SamplingParams(1.5, seed=3), SamplingParams(), SamplingParams(2.0, top_p=0.9), None, None]
    got = sample(logprobs, params, range(6))
    want = logprobs.argmax(dim=-1)
    for i in (0, 2, 4, 5):
        assert got[i] == want[i]


def test_top_k_one_is_greedy() -> None:
    logprobs = random_logprobs(8, 500, seed=2)
    got = sample(logprobs, [SamplingParams(temperature=0.8, top_k=1, seed=s) for s in range(8)], range(8))
    assert torch.equal(got, logprobs.argmax(dim=-1))


@pytest.mark.timeout(120)
def test_engine_greedy_default_and_top_k_one_equal_todays_greedy() -> None:
    """`sampling=None` is today's path; temperature 0 and top_k=1 give the same tokens and logprobs exactly."""
    today = generate("tiny", PROMPTS, max_new_tokens=NEW)
    for sampling in (SamplingParams(), SamplingParams(temperature=0.8, top_k=1, seed=7)):
        outs = generate("tiny", PROMPTS, max_new_tokens=NEW, sampling=sampling)
        assert [o.token_ids for o in outs] == [o.token_ids for o in today]
        assert [o.logprobs for o in outs] == [o.logprobs for o in today]


# ---------------------------------------------------------------- seeds
def test_a_seeded_row_draws_the_same_token_in_any_batch() -> None:
    """Row 0's token depends on its scores, seed and position only: not on the rows beside it, the batch
    size, the filtered path other rows force, or torch's global RNG."""
    logprobs = random_logprobs(1, 1000, seed=3)
    mine = SamplingParams(temperature=1.0, seed=7)
    others = [None, SamplingParams(0.7), SamplingParams(1.3, top_p=0.8, seed=9), SamplingParams(2.0, top_k=5)]
    for position in range(20):
        alone = sample(logprobs, [mine], [position])
        torch.manual_seed(position)
        crowd = torch.cat([random_logprobs(4, 1000, seed=100 + position), logprobs])
        mixed = sample(crowd, [*others, mine], [3, 50, 1, 9, position])
        assert mixed[4] == alone[0]
    draws = {int(sample(logprobs, [mine], [p])[0]) for p in range(20)}
    assert len(draws) > 5, "positions must draw independently"
    other_seed = [int(sample(logprobs, [SamplingParams(1.0, seed=8)], [p])[0]) for p in range(20)]
    assert other_seed != [int(sample(logprobs, [mine], [p])[0]) for p in range(20)]


def test_an_unseeded_row_is_fresh_each_step_and_follows_torch_manual_seed() -> None:
    logprobs = random_logprobs(1, 1000, seed=4)
    unseeded = [SamplingParams(temperature=1.0)]
    torch.manual_seed(0)
    first = [int(sample(logprobs, unseeded, [0])[0]) for _ in range(20)]
    torch.manual_seed(0)
    again = [int(sample(logprobs, unseeded, [0])[0]) for _ in range(20)]
    assert first == again and len(set(first)) > 5


@pytest.mark.timeout(120)
def test_engine_seeded_request_is_independent_of_its_batch() -> None:
    """The same seeded request alone, and in a batch of greedy, unseeded and filtered requests (admitted
    before and after it): the same tokens; and they are not the greedy ones."""
    prompt = PROMPTS[0]
    mine = SamplingParams(temperature=0.8, seed=7)
    alone = run_requests([Request(prompt, NEW, sampling=mine)])[0]
    crowd = run_requests(
        [
            Request(PROMPTS[1], NEW + 3),
            Request(PROMPTS[2], NEW, sampling=SamplingParams(1.2, top_p=0.9, top_k=20)),
            Request(prompt, NEW, sampling=mine),
            Request(prompt, NEW - 3, sampling=SamplingParams(0.8, seed=8)),
        ]
    )
    assert crowd[2] == alone
    greedy = generate("tiny", [prompt], max_new_tokens=NEW)[0].token_ids
    assert alone != greedy and crowd[3] != alone[: NEW - 3]


def test_the_engine_reports_the_untempered_logprob_of_the_sampled_token() -> None:
    engine = tiny_engine()
    engine.add(Request(PROMPTS[1], 3, sampling=SamplingParams(temperature=5.0, seed=1)))
    (out,) = engine.run()
    # score the sampled continuation at temperature 1: the reported logprobs are the model's own
    scored = generate("tiny", [PROMPTS[1] + out.token_ids], max_new_tokens=0, prompt_logprobs=True)[0]
    for got, want in zip(out.logprobs, scored.prompt_logprobs[len(PROMPTS[1]) :], strict=True):
        assert abs(got - want) <= 1e-4


# ---------------------------------------------------------------- the support and the distribution
PROBS = [0.4, 0.3, 0.2, 0.05, 0.03, 0.02]
DRAWS = 20000


def frequencies(params: SamplingParams, seed: int = 11) -> list[float]:
    logits = torch.tensor(PROBS).log()[None, :].expand(DRAWS, -1)
    seeded = SamplingParams(params.temperature, params.top_p, params.top_k, seed)
    tokens = sample(logits, [seeded] * DRAWS, range(DRAWS))  # one seed, consecutive positions
    return (torch.bincount(tokens, minlength=len(PROBS)).double() / DRAWS).tolist()


def assert_close_to(freq: list[float], expected: list[float]) -> None:
    """Within 5 standard deviations of a binomial proportion, and exactly 0 outside the support."""
    for f, e in zip(freq, expected, strict=True):
        if e == 0:
            assert f == 0, f"token outside the support drawn: {freq}"
        else:
            assert abs(f - e) <= 5 * math.sqrt(e * (1 - e) / DRAWS), (freq, expected)


def normalised(weights: list[float]) -> list[float]:
    return [w / sum(weights) for w in weights]


@pytest.mark.parametrize(
    "params, expected",
    [
        (SamplingParams(temperature=1.0), PROBS),
        (SamplingParams(temperature=2.0), normalised([p**0.5 for p in PROBS])),
        (SamplingParams(temperature=1.0, top_k=2), normalised(PROBS[:2] + [0] * 4)),
        (SamplingParams(temperature=1.0, top_p=0.75), normalised(PROBS[:3] + [0] * 3)),
        # top-p over the top-k-renormalised distribution: 0.44, 0.33, 0.22 -> mass before token 2 is 0.78
        (SamplingParams(temperature=1.0, top_k=3, top_p=0.5), normalised(PROBS[:2] + [0] * 4)),
        (SamplingParams(temperature=0.5, top_p=0.97), normalised([p**2 for p in PROBS[:3]] + [0] * 3)),
        (SamplingParams(temperature=1.0, top_k=100, top_p=1.0), PROBS),
    ],
    ids=["t1", "t2", "top_k2", "top_p.75", "top_k3_top_p.5", "t.5_top_p.97", "top_k_beyond_vocab"],
)
def test_sampling_follows_the_filtered_distribution(params: SamplingParams, expected: list[float]) -> None:
    assert_close_to(frequencies(params), expected)


def test_the_noise_hash_is_the_32_bit_lowbias32_on_ints_and_tensors() -> None:
    def reference(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    xs = [0, 1, 2, 12345, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0xDEADBEEF]
    assert [mix32(x) for x in xs] == [reference(x) for x in xs]
    assert mix32(torch.tensor(xs)).tolist() == [reference(x) for x in xs]


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -1.0}, "temperature must be 0 (greedy) or a finite number of at least 0.01"),
        ({"temperature": 0.001}, "temperature must be 0 (greedy)"),
        ({"temperature": math.nan}, "temperature must be"),
        ({"temperature": math.inf}, "temperature must be"),
        ({"temperature": "0.5"}, "temperature must be"),
        ({"top_p": 0.0}, "top_p must be a number greater than 0 and at most 1"),
        ({"top_p": 1.5}, "top_p must be"),
        ({"top_p": math.nan}, "top_p must be"),
        ({"top_k": -1}, "top_k must be 0 (no top-k filtering) or a positive integer, got -1"),
        ({"top_k": 2.0}, "top_k must be"),
        ({"top_k": True}, "top_k must be"),
        ({"seed": -3}, "seed must be an integer in [0, 2**64) or None"),
        ({"seed": 1 << 64}, "seed must be"),
        ({"seed": 1.0}, "seed must be"),
    ],
)
def test_bad_sampling_params_are_one_sentence(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_sample_checks_its_row_counts() -> None:
    with pytest.raises(ValueError, match="2 rows of scores but 1 params"):
        sample(random_logprobs(2, 10), [None], [0, 1])


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--temperature", "-1"], "argument --temperature: temperature must be 0 (greedy)"),
        (["--temperature", "x"], "temperature must be 0 (greedy) or a finite number of at least 0.01, got 'x'"),
        (["--temperature", "nan"], "temperature must be"),
        (["--top-p", "0"], "argument --top-p: top_p must be a number greater than 0"),
        (["--top-p", "1.01"], "top_p must be"),
        (["--top-k", "-1"], "argument --top-k: top_k must be 0 (no top-k filtering)"),
        (["--top-k", "2.5"], "top_k must be"),
        (["--sampling-seed", "-2"], "argument --sampling-seed: seed must be an integer in [0, 2**64)"),
        (["--sampling-seed", str(1 << 64)], "seed must be"),
    ],
)
def test_bad_sampling_flags_exit_2_with_one_line(flags: list[str], message: str, capsys) -> None:
    for command in ("generate", "launch", "worker"):
        argv = [command, "--model", "tiny", "--prompt-ids", "1", *flags] + (["--rank", "0"] * (command == "worker"))
        with pytest.raises(SystemExit) as info:
            build_parser().parse_args(argv)
        err = capsys.readouterr().err
        assert info.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    "sampling", [SamplingParams(), SamplingParams(0.1 + 0.2, 0.9, 5, (1 << 64) - 1), SamplingParams(0.8, top_k=0)]
)
def test_the_launcher_hands_a_rank_the_same_sampling(sampling: SamplingParams) -> None:
    argv = ["worker", "--rank", "0", "--model", "tiny", *sampling_flags(sampling)]
    assert sampling_params(build_parser().parse_args(argv)) == sampling
