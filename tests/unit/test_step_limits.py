"""The step limits a server gets when its flags do not say (afd.runtime.limits), what a profile picks for a model
and topology (afd.planning.recommend), and `afd serve` / `afd bench serve` applying both — no rank started, no GPU
(memory is passed in)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from afd.cli.main import build_parser
from afd.model.weights import load_model_config
from afd.planning import costs, recommend
from afd.planning.deployment import Deployment
from afd.planning.profile import Part, Profile, ProfileError, load_profile
from afd.runtime.limits import GiB, ReplicaMemory, Suggested, step_limits
from afd.runtime.resources import CUDA_DEVICE_OVERHEAD, attention_weight_bytes, ffn_weight_bytes, replica_memory
from tests.helpers.cli import main_exit


def _gpu(total_gib: float, cache_gib: float = 60.0) -> ReplicaMemory:
    """A GPU of `total_gib` whose replica has `cache_gib` for cache and activations (31 KB per cached token, as
    V2-Lite's latents in bf16; 1 MB of activations per budget token)."""
    return ReplicaMemory(int(total_gib * GiB), int(cache_gib * GiB), 31104, 1 << 20)


# ---------------------------------------------------------------- the device's defaults
def test_cpu_keeps_todays_defaults_whatever_the_memory():
    limits = step_limits("cpu", None)
    assert (limits.max_num_batched_tokens, limits.max_num_seqs, limits.ubatches) == (2048, 256, 1)
    assert step_limits("cpu", _gpu(141)).max_num_batched_tokens == 2048


def test_a_large_gpu_gets_the_peers_defaults():
    limits = step_limits("cuda", _gpu(141), max_model_len=163840)
    assert (limits.max_num_batched_tokens, limits.max_num_seqs) == (8192, 1024)
    assert "141 GiB" in limits.describe()
    assert step_limits("cuda", _gpu(70)).max_num_batched_tokens == 8192  # the bound is inclusive


def test_a_smaller_gpu_or_an_unknown_one_keeps_2048_and_256():
    for memory in (_gpu(69.9), _gpu(48, 20), None):
        limits = step_limits("cuda", memory, max_model_len=4096)
        assert (limits.max_num_batched_tokens, limits.max_num_seqs) == (2048, 256)


def test_the_sequence_cap_follows_the_cache():
    # 141 GiB but 20 GiB for the cache: 20 GiB - 8192 MiB of activations = 12 GiB / 31104 B = 414k tokens
    assert step_limits("cuda", _gpu(141, 20)).max_num_seqs == 256
    tight = step_limits("cuda", _gpu(141, 9))  # 1 GiB left: 34k tokens, 33 sequences of 1,024
    assert tight.max_num_seqs == 33 and "holds 33 sequences" in tight.seqs_from
    # short requests: sequences of max_model_len tokens
    assert step_limits("cuda", _gpu(141, 9), max_model_len=32).max_num_seqs == 1024


def test_flags_beat_the_profile_which_beats_the_default():
    profile = Suggested(max_num_batched_tokens=4096, ubatches=2, source="profile p.json")
    limits = step_limits("cuda", _gpu(141), suggested=profile)
    assert (limits.max_num_batched_tokens, limits.ubatches) == (4096, 2)
    assert limits.budget_from == "profile p.json" and limits.seqs_from.startswith("default")
    limits = step_limits("cuda", _gpu(141), max_num_batched_tokens=512, max_num_seqs=8, ubatches=1, suggested=profile)
    assert (limits.max_num_batched_tokens, limits.max_num_seqs, limits.ubatches) == (512, 8, 1)
    assert limits.to_json()["from"] == {"max_num_batched_tokens": "flag", "max_num_seqs": "flag", "ubatches": "flag"}


def test_replica_memory_is_the_share_less_weights_and_overhead():
    config = load_model_config("tiny")
    gpu = dict(dtype="bfloat16", device_bytes=80 * GiB, gpu_memory_utilization=0.5)
    whole = replica_memory(config, **gpu, whole_model=True)
    weights = attention_weight_bytes(config, "bfloat16") + ffn_weight_bytes(config, "bfloat16")
    assert whole.cache_bytes == 40 * GiB - weights - CUDA_DEVICE_OVERHEAD
    shared = replica_memory(config, **gpu, whole_model=False, ranks_on_gpu=2)
    assert shared.cache_bytes == 20 * GiB - attention_weight_bytes(config, "bfloat16") - CUDA_DEVICE_OVERHEAD
    assert whole.activation_bytes_per_token > 0 and whole.kv_bytes_per_token > 0


def test_ranks_sharing_the_first_replicas_gpu():
    from afd.cli.limits import Shape, _ranks_on_first_gpu

    assert _ranks_on_first_gpu(Shape(replicas=3), 2) == 2  # replicas 0 and 2 on GPU 0
    assert _ranks_on_first_gpu(Shape(replicas=1), 8) == 1
    assert _ranks_on_first_gpu(Shape("async", 1, 1), 1) == 2  # co-located
    assert _ranks_on_first_gpu(Shape("async", 2, 2), 4) == 1
    assert _ranks_on_first_gpu(Shape("p2p", 3, 1), 4) == 1  # world [F0, A0, A1, A2] on four GPUs


# ---------------------------------------------------------------- what a profile picks
def _target(device: str = "cuda", gpu: str | None = "NVIDIA H200", model: str = "deepseek-v2-lite", shapes: str = ""):
    """Where a profile is applied: `model` as named, with the config of the preset `shapes` (default `model`)."""
    return recommend.Target(device, gpu, model, load_model_config(shapes or model))


def test_a_profile_of_another_device_or_model_is_refused():
    h200 = load_profile("h200")
    recommend.check_profile(h200, "h200", _target())
    recommend.check_profile(h200, "h200", _target(model="/models/DeepSeek-V2-Lite", shapes="tiny"))  # the same name
    cases = [
        (_target(device="cpu", gpu=None), "not on this CPU"),
        (_target(gpu="NVIDIA A100-SXM4-80GB"), "not on this NVIDIA A100"),
        (_target(gpu=None), "could not be named"),
        (_target(model="tiny"), "measured with model deepseek-v2-lite, not tiny"),
    ]
    for target, words in cases:
        with pytest.raises(ProfileError, match=words):
            recommend.check_profile(h200, "h200", target)
    cpu = replace(h200, machine={"device": "cpu (x86_64)"})
    with pytest.raises(ProfileError, match="not on a GPU"):
        recommend.check_profile(cpu, "cpu.json", _target())
    with pytest.raises(ProfileError, match="does not say which model"):
        recommend.check_profile(cpu, "cpu.json", _target(device="cpu", gpu=None))


def test_a_model_of_the_same_shapes_under_another_name_is_accepted(tmp_path):
    from afd.model.presets import PRESETS

    (tmp_path / "config.json").write_text(json.dumps(PRESETS["tiny"]))
    profile = Profile({"device": "cpu (x86_64)", "model": str(tmp_path)}, {})
    recommend.check_profile(profile, "p", _target(device="cpu", gpu=None, model="tiny"))


def test_the_h200_profile_picks_large_budgets_and_async_two_micro_batches():
    p, s = load_profile("h200"), costs.shapes_of(load_model_config("deepseek-v2-lite"), "bfloat16")
    none = recommend.recommend(p, s, Deployment("none", max_num_seqs=1024), source="h200", max_model_len=163840)
    # simulated within 1% of 16,384 (measured with this profile's server, one run each: 247.5 req/s at 8,192
    # tokens, 254.5 at 16,384, within the ~10% between identical runs; docs/planning.md), so the smaller is taken
    assert (none.max_num_batched_tokens, none.ubatches, none.source) == (8192, None, "profile h200")
    both = recommend.recommend(p, s, Deployment("async", max_num_seqs=1024), source="h200", max_model_len=163840)
    assert (both.max_num_batched_tokens, both.ubatches) == (16384, 2)
    fixed = recommend.recommend(
        p, s, Deployment("async", max_num_seqs=1024), source="h200", max_model_len=163840, budget=2048
    )
    assert fixed.max_num_batched_tokens is None and fixed.ubatches in (1, 2, 3)  # a flag's value is not repeated
    p2p = recommend.recommend(p, s, Deployment("p2p", max_num_seqs=1024), source="h200", max_model_len=163840)
    assert p2p.ubatches is None  # the planner does not model p2p micro-batches


def test_the_smallest_budget_near_the_best_capacity_wins(monkeypatch):
    capacity = {2048: 100.0, 4096: 109.0, 8192: 109.5, 16384: 110.0}
    tpot = {2048: 0.01, 4096: 0.01, 8192: 0.01, 16384: 0.09}  # 16384 misses the TPOT SLO

    def fake(d, *_args):
        b = d.max_num_batched_tokens
        return {"summary": {"request_throughput": capacity[b], "tpot_p50_s": tpot[b]}}

    monkeypatch.setattr(recommend, "simulate_rate", fake)
    p, s = load_profile("h200"), costs.shapes_of(load_model_config("tiny"), "float32")
    got = recommend.recommend(p, s, Deployment("none"), source="x", max_model_len=4096)
    assert got.max_num_batched_tokens == 4096  # within 1% of 8192's 109.5; 16384 is out for its TPOT


def test_the_planning_workload_fits_a_short_model():
    w = recommend.planning_workload(100)
    assert w.long_len + w.max_tokens <= 100 and w.short_len <= w.long_len


# ---------------------------------------------------------------- afd serve and afd bench serve
def cpu_profile(path, model: str = "tiny") -> str:
    """A profile as `afd profile --model tiny` writes it on CPU (fixed costs: a step costs what its parts say)."""
    parts = {
        "attention_decode": Part(fixed_s=2e-3, bandwidth_Bps=1e9),
        "prefill": Part(peak_flops=1e10),
        "routed_experts": Part(fixed_s=1e-4, bandwidth_Bps=1e9, peak_flops=1e10),
        "shared_experts": Part(fixed_s=1e-4, bandwidth_Bps=1e9, peak_flops=1e10),
        "exchange_async": Part(fixed_s=1e-4, bandwidth_Bps=1e9),
        "exchange_p2p": Part(fixed_s=1e-4, bandwidth_Bps=1e9),
        "host": Part(fixed_s=1e-3),
    }
    profile = Profile({"device": "cpu (x86_64)", "model": model}, parts, "test", "float32", 16e9)
    profile.save(path)
    return str(path)


def _serve_plan(*flags: str):
    from afd.cli.serve import build_plan

    return build_plan(build_parser().parse_args(["serve", "--model", "tiny", *flags]))


def test_serve_takes_the_profiles_budget_unless_a_flag_gives_one(tmp_path, capsys):
    profile = cpu_profile(tmp_path / "cpu.json")
    picked = recommend.recommend(
        load_profile(profile),
        costs.shapes_of(load_model_config("tiny"), "float32"),
        Deployment("none"),
        source=profile,
        max_model_len=load_model_config("tiny").max_position_embeddings,
    ).max_num_batched_tokens
    assert picked != 2048  # the profile changes something
    plan = _serve_plan("--profile", profile)
    assert plan.spec.max_num_batched_tokens == picked and plan.spec.cache.max_num_seqs == 256
    said = f"max_num_batched_tokens {picked} (profile {profile}), max_num_seqs 256 (default on cpu)"
    assert plan.describe().endswith(f"float32 on cpu; {said}")  # the ready line's
    plan = _serve_plan("--profile", profile, "--max-num-batched-tokens", "512")
    assert plan.spec.max_num_batched_tokens == 512 and "max_num_batched_tokens 512 (flag)" in plan.describe()
    plan = _serve_plan()  # no profile, CPU: today's defaults
    assert (plan.spec.max_num_batched_tokens, plan.spec.cache.max_num_seqs) == (2048, 256)
    assert capsys.readouterr().err == ""  # nothing said before the server is up


def test_serve_takes_async_micro_batches_from_the_profile(tmp_path, monkeypatch):
    monkeypatch.setattr(recommend, "UBATCHES", {**recommend.UBATCHES, "async": (2,)})  # what this profile picks
    profile = cpu_profile(tmp_path / "cpu.json")
    plan = _serve_plan("--connector", "async", "--profile", profile)
    assert plan.config.to_dict()["connector_extra_config"]["async_moe_num_ubatches"] == 2
    plan = _serve_plan("--connector", "async", "--profile", profile, "--ubatches", "1")
    assert not plan.config.to_dict()["connector_extra_config"].get("async_moe_ubatching")


def test_bench_serve_gives_each_server_its_limits(tmp_path):
    from afd.cli.limits import compare_with_limits

    profile = cpu_profile(tmp_path / "cpu.json")
    argv = ["bench", "serve", "--profile", profile, "--compare", "none:R=1,async:A=1,F=1,U=1"]
    args = build_parser().parse_args(argv)
    config = load_model_config("tiny")
    configs, chosen = compare_with_limits(args, config)
    budget = chosen["none R=1"].max_num_batched_tokens
    assert budget != 2048 and chosen["none R=1"].to_json()["from"]["max_num_batched_tokens"] == f"profile {profile}"
    assert configs[0][1][-4:] == ["--max-num-batched-tokens", str(budget), "--max-num-seqs", "256"]
    assert chosen["async A=1,F=1,U=1"].ubatches == 1 and configs[1][1].count("--ubatches") == 1
    assert args.max_num_batched_tokens is None  # each server decided from the flags as given
    args = build_parser().parse_args([*argv, "--max-num-batched-tokens", "768"])
    _, chosen = compare_with_limits(args, config)
    assert {c.max_num_batched_tokens for c in chosen.values()} == {768}


def test_a_wrong_profile_is_one_sentence_and_exit_2(tmp_path, capsys):
    from afd.cli.input import UsageError

    gpu = tmp_path / "gpu.json"
    gpu.write_text(json.dumps(load_profile("h200").to_json()))
    with pytest.raises(UsageError, match=r"^profile .*gpu.json was measured on 1x NVIDIA H200, not on this CPU$"):
        _serve_plan("--profile", str(gpu))  # afd serve exits 2 with it (afd.cli.main), before any rank starts
    with pytest.raises(UsageError, match="neither a file nor a shipped profile"):
        _serve_plan("--profile", str(tmp_path / "none.json"))
    other = cpu_profile(tmp_path / "v2.json", model="deepseek-v2-lite")
    code, err = main_exit(capsys, "bench", "serve", "--model", "tiny", "--profile", other, "--requests", "1")
    assert code == 2 and "measured with model deepseek-v2-lite, not tiny" in err and err.count("\n") == 1
    code, err = main_exit(capsys, "bench", "serve", "--profile", other, "--url", "http://127.0.0.1:1")
    assert code == 2 and "leave it out with --url" in err


def test_simulate_and_plan_model_the_servers_defaults_on_the_profiles_machine(tmp_path, capsys):
    """Without step-limit flags `afd simulate` (and `afd plan`, through the same rule) simulates what `afd serve`
    would run on the profile's machine: the larger pair on the shipped H200 profile, 2,048 and 256 on a CPU's."""
    from helpers.planning import cpu_profile

    cpu = tmp_path / "cpu.json"
    cpu_profile().save(cpu)
    for profile, limits in (("h200", (8192, 1024)), (str(cpu), (2048, 256))):
        out = tmp_path / "sim.json"
        code, err = main_exit(capsys, "simulate", "--model", "tiny", "--profile", profile, "--connector", "none",
                              "--requests", "8", "--rates", "inf", "--json", str(out))  # fmt: skip
        assert code == 0, err
        d = json.loads(out.read_text())["results"][0]["deployment"]
        assert (d["max_num_batched_tokens"], d["max_num_seqs"]) == limits


def test_plan_writes_its_json_with_the_model_and_the_servers_limits_and_plots_it(tmp_path, capsys):
    """`afd plan` on two H200s (the shipped profile): the JSON the issue names (best, candidates with meets_slo),
    the model and weight format it planned, every candidate at afd serve's defaults there; `plot_plans` draws it."""
    from afd.planning.plan import plot_plans

    out = tmp_path / "plan.json"
    code, err = main_exit(capsys, "plan", "--model", "deepseek-v2-lite", "--gpus", "2", "--requests", "12",
                          "--max-tokens", "8", "--json", str(out))  # fmt: skip
    assert code == 0, err
    result = json.loads(out.read_text())
    assert (result["model"], result["weights"]) == ("deepseek-v2-lite", "bfloat16")
    keys = {"connector", "attention", "ffn", "replicas", "ubatches", "tokens_per_s_per_gpu", "ttft_p90_s",
            "tpot_p50_s", "bound"}  # fmt: skip
    assert keys <= result["best"].keys() and all("meets_slo" in c for c in result["candidates"])
    assert {(c["max_num_batched_tokens"], c["max_num_seqs"]) for c in result["candidates"]} == {(8192, 1024)}
    png = tmp_path / "plans.png"
    plot_plans([result, {**result, "gpus": 4}], str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_takes_the_profile_measured_on_the_models_own_layers(tmp_path, capsys):
    """`afd plan --model deepseek-v3` without --profile takes the shipped `h200-deepseek-v3` (its compute parts
    measured on V3's first layers, the rest `h200`'s) and says so in its JSON; a model without one takes `h200`;
    a --profile given wins."""
    from afd.planning.profile import default_profile, load_profile

    assert default_profile("deepseek-v3") == "h200-deepseek-v3"
    assert default_profile("deepseek-v2-lite") == default_profile(None) == "h200"
    own, base = load_profile("h200-deepseek-v3"), load_profile("h200")
    assert own.machine["model"] == "deepseek-v3" and own.source != base.source
    v2_bf16, v2_fp8 = load_profile("h200-deepseek-v2"), load_profile("h200-deepseek-v2-fp8")
    assert (v2_bf16.dtype, v2_fp8.dtype, own.dtype) == ("bfloat16", "fp8", "fp8")
    for model, flags, source in (
        ("deepseek-v3", [], own.source),
        ("deepseek-v2-lite", [], base.source),
        ("deepseek-v3", ["--profile", "h200"], base.source),
        ("deepseek-v2", [], v2_bf16.source),
        ("deepseek-v2", ["--weights", "fp8"], v2_fp8.source),
        ("deepseek-v2-lite", ["--weights", "fp8"], base.source),
    ):
        out = tmp_path / "plan.json"
        code, err = main_exit(capsys, "plan", "--model", model, "--gpus", "8", "--requests", "8", "--max-tokens",
                              "8", *flags, "--json", str(out))  # fmt: skip
        assert code == 0, err
        assert json.loads(out.read_text())["profile"] == source, (model, flags)


def test_the_plan_says_when_its_weights_are_priced_at_another_formats_rates():
    from afd.cli.planning import profile_line
    from afd.planning.profile import load_profile

    v2_fp8, lite = load_profile("h200-deepseek-v2-fp8"), load_profile("h200")
    assert profile_line(v2_fp8, "fp8") == f"profile: measured on deepseek-v2 in fp8 ({v2_fp8.source})"
    said = profile_line(lite, "fp8")
    assert said.startswith("profile: measured on deepseek-v2-lite in bfloat16 (")
    assert said.endswith("; the fp8 weights are priced at bfloat16's rates with their own bytes (a profile measured in "
                          "fp8 prices them at fp8's)")  # fmt: skip


def test_a_profile_in_another_format_than_the_release_ships_under_its_format():
    """A profile measured on a model's own layers in the format the model ships in is `h200-<model>`; in another
    (V2's bf16 release quantized to FP8 at load) `h200-<model>-<format>`, which `afd plan --weights` then takes."""
    from afd.planning.profile import checkpoint_weights, default_profile, model_profile_name

    assert checkpoint_weights("deepseek-v3") == "fp8" and checkpoint_weights("deepseek-v2") == "bfloat16"
    assert model_profile_name("deepseek-v3", "fp8") == "h200-deepseek-v3"
    assert model_profile_name("deepseek-v2", "bfloat16") == "h200-deepseek-v2"
    assert model_profile_name("deepseek-v2", "fp8") == "h200-deepseek-v2-fp8"
    assert default_profile("deepseek-v2", "fp8") == "h200-deepseek-v2-fp8"
    assert default_profile("deepseek-v2", "bfloat16") == default_profile("deepseek-v2") == "h200-deepseek-v2"
    assert default_profile("deepseek-v3", "bfloat16") == "h200-deepseek-v3"


def test_a_plan_on_too_few_gpus_says_how_many_hold_the_weights(capsys):
    """The refusal names the weights' size and the fewest GPUs whose `ep` layout holds them, and that count plans."""
    small = ["--requests", "8", "--max-tokens", "8"]
    code, err = main_exit(capsys, "plan", "--model", "deepseek-v3", "--gpus", "4", *small)
    assert code == 2 and err.count("\n") == 1, err
    assert "no deployment of 4 GPUs holds the model's 671 GB of weights; the fewest that do: 6 (`--gpus 6`)" in err
    code, err = main_exit(capsys, "plan", "--model", "deepseek-v3", "--gpus", "6", *small)
    assert code == 0, err
