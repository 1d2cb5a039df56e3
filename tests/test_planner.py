"""The planner against the seeds' worked examples (docs/architecture.md §8) and exact block arithmetic."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvreplay import planner
from kvreplay.cli import main
from kvreplay.planner import KVDims, PlanKnobs, Zones, plan

LLAMA3_8B = KVDims(num_layers=32, num_kv_heads=8, head_dim=128)   # seeds 003 and 004
FP16 = PlanKnobs(kv_dtype="float16")
GB, GiB = 10**9, 2**30


def test_llama3_8b_seed_004_examples():
    # "1K Token: 2 x 32 x 8 x 128 x 1024 x 2 = 约 134 MB"; "128K: 约 17 GB"
    assert LLAMA3_8B.bytes_per_token(2) == 131_072
    assert plan(LLAMA3_8B, 1024, FP16).full_bytes == 134_217_728
    at_128k = plan(LLAMA3_8B, 131_072, FP16).full_bytes
    assert at_128k == 17_179_869_184 and round(at_128k / GB) == 17
    # MHA (32 KV heads) needs 4x; int8 KV halves it again ("约 8.5GB")
    mha = KVDims(32, 32, 128)
    assert plan(mha, 131_072, FP16).full_bytes == 4 * at_128k
    int8 = plan(LLAMA3_8B, 131_072, PlanKnobs(kv_dtype="int8")).full_bytes
    assert int8 * 2 == at_128k and 8.5 < int8 / GB < 8.7
    # "8 路并发、每路平均 8K: 8 x 8 x 134MB ≈ 8.6GB"; at 32K "约 34GB"; 50 GB left for KV on an A100 80GB
    assert round(8 * plan(LLAMA3_8B, 8192, FP16).full_bytes / GB, 1) == 8.6
    assert round(8 * plan(LLAMA3_8B, 32_768, FP16).full_bytes / GB) == 34
    assert plan(LLAMA3_8B, 8192, FP16, budget_bytes=50 * GB).policy("full").max_concurrency == 46


def test_32_layer_gqa_at_32k_seed_003():
    # "2 x 1 x 32768 x 32 x 8 x 128 x 2 ≈ 4.3 GB"; 16 concurrent "逼近 70 GB"
    one = plan(LLAMA3_8B, 32_768, FP16).full_bytes
    assert one == 4 * GiB and round(one / GB, 1) == 4.3
    assert 68 * GB < 16 * one < 70 * GB


def test_70b_mha_seed_000_formula():
    # The seed's formula 2 x 80 x 8192 x 2 is 2,621,440 bytes (2.5 MiB); the article prints
    # 2,097,152 ("2 MB") and so 16 GB per 8K request -- an arithmetic slip we do not reproduce.
    dims = KVDims.from_hidden(num_layers=80, hidden_size=8192)
    assert dims.bytes_per_token(2) == 2 * 80 * 8192 * 2 == 2_621_440
    request = plan(dims, 8192, FP16, budget_bytes=80 * GB)
    assert request.full_bytes == 20 * GiB
    # What survives the slip: an 80 GB card holds fewer than 5 such requests; 40 GiB of KV holds 2.
    assert request.policy("full").max_concurrency < 5
    assert plan(dims, 8192, FP16, budget_bytes=40 * GiB).policy("full").max_concurrency == 2
    # Keeping only the 512-token tail (+ the sink block) is ~1/16 of the request.
    window = plan(dims, 8192, FP16).policy("window")
    assert window.resident_bytes == (512 + 16) * 2_621_440


def test_default_model_bytes_per_token():
    from kvreplay.models.loader import read_model_config
    dims = KVDims.from_model_config(read_model_config(None), "default")
    assert (dims.num_layers, dims.num_kv_heads, dims.head_dim) == (30, 3, 64)
    assert dims.bytes_per_token(2) == 23_040  # SmolLM2-135M in bf16: 30 layers x 3 KV heads x 64 x 2 (K, V) x 2 bytes


def test_layer_groups_of_a_sliding_window_model():
    """Gemma 3 270M's shape: 3 global layers keep every token, 15 local ones their 512-token
    window, which touches at most 33 blocks of 16 (the engine's hybrid pool holds that:
    tests/test_kv_hybrid.py)."""
    gemma = KVDims(18, 1, 256, num_local_layers=15, sliding_window=512)
    request = plan(gemma, 32_768)
    assert [(g["name"], g["num_layers"], g["bytes_per_token"]) for g in request.layer_groups] == \
        [("global", 3, 3_072), ("local", 15, 15_360)]
    assert [g["hybrid_tokens"] for g in request.layer_groups] == [32_768, 528]
    assert request.full_bytes == 18_432 * 32_768
    assert request.hybrid_bytes == 3_072 * 32_768 + 15_360 * 528
    assert plan(gemma, 100).hybrid_bytes == plan(gemma, 100).full_bytes  # inside the window
    assert request.as_dict()["hybrid_bytes"] == request.hybrid_bytes
    plain = plan(LLAMA3_8B, 8192, FP16)  # no local layers: one group, the hybrid pool is the pool
    assert len(plain.layer_groups) == 1 and plain.hybrid_bytes == plain.full_bytes


def test_a_sliding_window_models_policies_act_on_its_global_layers():
    """Under the hybrid pool a policy's blocks are the global layers' (3,072 bytes a token), the
    local layers hold their 33-block window whatever it keeps."""
    gemma = KVDims(18, 1, 256, num_local_layers=15, sliding_window=512)
    request = plan(gemma, 4096, PlanKnobs(resident_ratio=0.25), policies=["full", "window", "snapkv", "replay"])
    local = 15_360 * 528
    assert request.policy("full").hybrid_bytes == request.hybrid_bytes == 3_072 * 4096 + local
    assert request.policy("snapkv").hybrid_bytes == 64 * 16 * 3_072 + local  # r x 256 blocks
    assert request.policy("window").hybrid_bytes == 33 * 16 * 3_072 + local  # sinks' block + 512 tokens
    # replay's row counts a key index of every global layer (`need_layers="all"`): 3 x 3,072 bytes a block
    replay = request.policy("replay")
    assert replay.index_bytes == replay.middle_blocks * 3 * (16 * 256 // 2 + 4 * 256)
    assert replay.hybrid_bytes == replay.hot_blocks * 16 * 3_072 + replay.index_bytes + local
    assert request.policy("window").hybrid_bytes < replay.hybrid_bytes < request.hybrid_bytes


def test_block_rounding_and_zones():
    knobs = PlanKnobs()  # 16-token blocks, 4 sinks, 512-token window
    request = plan(LLAMA3_8B, 1000, knobs)
    assert (request.num_blocks, request.waste_tokens) == (63, 8)
    # T=600: sink block 0 hot; window starts at token 88 -> block 5; middle = blocks 1..4
    assert Zones.of(600, knobs) == Zones(600, 38, 4)
    assert Zones.of(516, knobs).num_middle_blocks == 0       # sinks + window cover everything
    assert Zones.of(600, PlanKnobs(protected_tokens=100)).num_middle_blocks == 0  # blocks 0..6 pinned
    assert Zones.of(1000, PlanKnobs(protected_tokens=100)).num_middle_blocks == 30 - 7  # window from token 488 = block 30


def test_policy_resident_bytes():
    dims, knobs = LLAMA3_8B, PlanKnobs()
    request = plan(dims, 8192, knobs, policies=["full", "window", "replay", "sparse:int8",
                                                "sparse:int4", "replay+cold:int8"])
    block = request.block_bytes
    middle = 512 - 33
    g = dims.channels
    assert request.policy("full").resident_bytes == 512 * block
    assert request.policy("window").resident_bytes == 33 * block
    replay = request.policy("replay")
    assert replay.hot_bytes == 33 * block
    # the int4 key index is 1/8 of the dropped range's bf16 K+V (docs/architecture.md §4), plus
    # fp16 min and max per channel (its scales and the Quest summaries), as the engine's KeyIndex
    assert replay.index_bytes == middle * block // 8 + middle * 2 * g * 2 and replay.summary_bytes == 0
    four = plan(dims, 8192, replace(knobs, index_layers=4), policies=["replay"]).policy("replay")
    assert four.index_bytes * 8 == replay.index_bytes  # 4 of Llama-3-8B's 32 layers read
    assert plan(dims, 8192, replace(knobs, index_layers=0), policies=["replay"]).policy("replay").index_bytes == 0
    int8 = request.policy("sparse:int8")
    assert int8.cold_bytes == middle * block // 2 + middle * 2 * g * 2
    int4 = request.policy("sparse:int4")
    assert int4.cold_bytes == middle * block // 4 + middle * 2 * g * 2 * 2
    assert request.policy("replay+cold").resident_bytes == replay.resident_bytes
    order = [request.policy(p).resident_bytes for p in ("window", "replay", "sparse:int4", "sparse:int8", "full")]
    assert order == sorted(order)


def test_concurrency_is_floor_of_budget():
    request = plan(LLAMA3_8B, 1024, PlanKnobs(), budget_bytes=10 * 134_217_728 + 1)
    assert request.policy("full").max_concurrency == 10
    small = plan(LLAMA3_8B, 1024, PlanKnobs(), budget_bytes=1000)
    assert small.policy("full").max_concurrency == 0


def test_a_new_policy_plugs_in_by_name():
    def half(zones, knobs, dims, cold):
        return planner.PolicyPlan("half", zones.num_blocks, "hot", 0,
                                  zones.num_blocks * knobs.block_size * dims.bytes_per_token(1))
    planner.register_policy("half", half)
    try:
        request = plan(LLAMA3_8B, 1024, PlanKnobs(), policies=["full", "half"])
        assert request.policy("half").resident_bytes * 2 == request.full_bytes
    finally:
        planner._POLICIES.pop("half")
    with pytest.raises(ValueError, match="unknown policy 'half'"):
        plan(LLAMA3_8B, 1024, PlanKnobs(), policies=["half"])
    with pytest.raises(ValueError, match="unknown cold dtype"):
        plan(LLAMA3_8B, 1024, PlanKnobs(), policies=["sparse:int3"])


def test_cli_json_and_errors(capsys):
    assert main(["plan", "--num-layers", "32", "--num-kv-heads", "8", "--head-dim", "128",
                 "--kv-dtype", "fp16", "--context", "131072", "--budget", "40GB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    full = out["plans"][0]["policies"][0]
    assert out["plans"][0]["bytes_per_token"] == 131_072
    assert (full["policy"], full["resident_bytes"], full["max_concurrency"]) == ("full", 17_179_869_184, 2)
    assert main(["plan", "--num-layers", "32", "--context", "1024"]) == 2
    assert "need --num-kv-heads" in capsys.readouterr().err
    assert main(["plan", "--num-layers", "80", "--hidden-size", "8192", "--context", "8192",
                 "--budget", "40GiB"]) == 0
    text = capsys.readouterr().out
    assert "2,621,440 bytes per token" in text and "rounding waste 0 tokens" in text
