"""The sizing math against numbers computed by hand (the hand computation sits next to each assertion)."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfleet_runtime.kv.presets import PRESETS, get_preset
from kvfleet_runtime.kv.sizing import (
    AttentionKind,
    GiB,
    KVCacheDtype,
    ModelArchitecture,
    PlanRequest,
    SizingError,
    TiB,
    WeightDtype,
    build_model_architecture,
    build_plan,
    compute_blocks_for_share,
    compute_blocks_for_tokens,
    compute_bytes_for_tokens,
    compute_bytes_per_block_per_gpu,
    compute_kv_bytes_per_token,
    compute_kv_bytes_per_token_per_gpu,
    compute_kv_bytes_per_token_per_replica,
    compute_kv_heads_per_gpu,
    compute_layers_per_gpu,
    compute_offload_bytes_per_token,
    compute_replica_capacity,
    compute_restore_times,
    compute_sessions_that_fit,
    compute_tokens_for_bytes,
    compute_tokens_for_kv_bytes,
    compute_weight_bytes_per_gpu,
    compute_workload_needs,
    kv_cache_dtype_bytes,
    parse_byte_size,
    parse_count,
    parse_share,
    parse_token_count,
    resolve_kv_cache_dtype,
)

LLAMA70 = PRESETS["llama-3.3-70b"].architecture
LLAMA8 = PRESETS["llama-3.1-8b"].architecture
QWEN72 = PRESETS["qwen2.5-72b"].architecture
MIXTRAL = PRESETS["mixtral-8x22b"].architecture
DSV3 = PRESETS["deepseek-v3"].architecture
TINY = PRESETS["tiny-llama"].architecture


# ------------------------------------------------------------------------------------- bytes per token


def test_llama_3_3_70b_bytes_per_token_bf16() -> None:
    # 2 (K, V) x 80 layers x 8 KV heads x 128 head dim x 2 bytes (bf16) = 327,680
    assert compute_kv_bytes_per_token(LLAMA70, "auto") == 2 * 80 * 8 * 128 * 2 == 327_680
    assert compute_kv_bytes_per_token(LLAMA70, "bfloat16") == 327_680
    # fp8 halves it: 163,840
    assert compute_kv_bytes_per_token(LLAMA70, "fp8_e5m2") == 163_840
    assert compute_kv_bytes_per_token(LLAMA70, "fp8_e4m3") == 163_840
    assert LLAMA70.attention_kind is AttentionKind.GQA


def test_llama_70b_128k_context_256_sessions_is_10_tib_bf16_5_tib_fp8() -> None:
    # 131,072 tokens x 256 sessions = 2^25 tokens; 2^25 x 327,680 B = 2^25 x 5 x 2^16 = 5 x 2^41 = 10 TiB
    tokens = parse_token_count("128K") * 256
    assert tokens == 2**25
    assert compute_bytes_for_tokens(tokens, compute_kv_bytes_per_token(LLAMA70, "bfloat16")) == 10 * TiB
    assert compute_bytes_for_tokens(tokens, compute_kv_bytes_per_token(LLAMA70, "fp8_e5m2")) == 5 * TiB


def test_llama_70b_workload_logical_bytes_match_10_tib() -> None:
    for kv, expected in (("bfloat16", 10 * TiB), ("fp8_e5m2", 5 * TiB)):
        capacity = compute_replica_capacity(
            LLAMA70, gpu_memory_bytes=141 * GiB, kv_cache_dtype=kv, tensor_parallel=8, replicas=4
        )
        need = compute_workload_needs(
            LLAMA70, capacity, sessions=256, context_tokens=131_072, kv_cache_dtype=kv, tensor_parallel=8
        )
        assert need.logical_bytes == expected
        # TP 8 = KV heads: each GPU holds exactly one head, nothing replicated, so HBM need = logical
        # (131,072 is a multiple of the block size: no partly filled block).
        assert need.hbm.needed_bytes == expected
        assert need.cpu.needed_bytes == expected


def test_tiny_model_one_gib_holds_2097152_tokens() -> None:
    # 2 layers x 2 (K, V) x 2 KV heads x 32 head dim x 2 bytes = 512 B/token; 2^30 / 512 = 2,097,152
    assert compute_kv_bytes_per_token(TINY) == 2 * 2 * 2 * 32 * 2 == 512
    # vLLM-CPU block sizes are multiples of 32; any power-of-two block divides 1 GiB evenly.
    for block_size in (16, 32, 128):
        assert compute_tokens_for_kv_bytes(GiB, 512, block_size) == 2_097_152
    # The same through the whole capacity computation: 1 GiB of KV space, nothing else on the device.
    capacity = compute_replica_capacity(
        TINY,
        gpu_memory_bytes=GiB,
        gpu_memory_utilization=1,
        reserve_bytes_per_gpu=0,
        weight_bytes_per_gpu=0,
        block_size=16,
    )
    assert capacity.tokens_per_replica == 2_097_152
    assert capacity.blocks_per_replica == 2**30 // (512 * 16) == 131_072


def test_deepseek_v3_mla_bytes_per_token() -> None:
    # MLA: 61 layers x (kv_lora_rank 512 + qk_rope_head_dim 64) x 2 bytes = 70,272 (auto: fp8 weights
    # still run bf16 activations, so the KV is bf16)
    assert resolve_kv_cache_dtype("auto", DSV3.weight_dtype) is KVCacheDtype.BFLOAT16
    assert compute_kv_bytes_per_token(DSV3) == 61 * (512 + 64) * 2 == 70_272
    assert compute_kv_bytes_per_token(DSV3, "fp8_e4m3") == 61 * 576 == 35_136
    assert DSV3.attention_kind is AttentionKind.MLA
    # The latent is replicated on every TP rank: per GPU the full 70,272; a TP-8 replica holds 8 copies;
    # LMCache stores it once (first rank only).
    assert compute_kv_bytes_per_token_per_gpu(DSV3, "auto", tensor_parallel=8) == 70_272
    assert compute_kv_bytes_per_token_per_replica(DSV3, "auto", tensor_parallel=8) == 8 * 70_272
    assert compute_offload_bytes_per_token(DSV3, "auto", tensor_parallel=8) == 70_272
    # Versus the 2 x 61 x 128 heads x 192 dim x 2 B = 5,996,544 B an uncompressed MHA cache would need.
    assert 2 * 61 * 128 * 192 * 2 // compute_kv_bytes_per_token(DSV3) == 85


def test_deepseek_v3_on_8_h200_weights_and_capacity() -> None:
    # 671,026,419,200 params x 1 B (fp8) / 8 GPUs = 83,878,302,400 B per GPU
    assert compute_weight_bytes_per_gpu(DSV3, tensor_parallel=8) == 83_878_302_400
    cap = compute_replica_capacity(DSV3, gpu_memory_bytes=141 * 10**9, tensor_parallel=8)
    # usable 141e9 x 0.9 = 126,900,000,000; KV = 126.9e9 - 83,878,302,400 - 2 GiB = 40,874,213,952
    assert cap.kv_bytes_per_gpu == 126_900_000_000 - 83_878_302_400 - 2 * GiB == 40_874_213_952
    # block = 16 x 70,272 = 1,124,352 B; 40,874,213,952 // 1,124,352 = 36,353 blocks = 581,648 tokens
    assert cap.bytes_per_block_per_gpu == 1_124_352
    assert cap.blocks_per_replica == 36_353
    assert cap.tokens_per_replica == 581_648


def test_mixtral_8x22b_numbers() -> None:
    # 2 x 56 layers x 8 KV heads x 128 x 2 B = 229,376 B/token
    assert compute_kv_bytes_per_token(MIXTRAL) == 2 * 56 * 8 * 128 * 2 == 229_376
    assert MIXTRAL.is_moe
    # All 8 experts resident: 140,620,634,112 x 2 B / 8 GPUs = 35,155,158,528 B per GPU
    assert compute_weight_bytes_per_gpu(MIXTRAL, tensor_parallel=8) == 35_155_158_528
    # TP 8 = KV heads: 1 head per GPU, 229,376 / 8 = 28,672 B/token per GPU
    assert compute_kv_bytes_per_token_per_gpu(MIXTRAL, "auto", 8) == 28_672
    cap = compute_replica_capacity(MIXTRAL, gpu_memory_bytes=80 * GiB, tensor_parallel=8)
    # usable floor(80 GiB x 0.9) = 77,309,411,328; KV = 77,309,411,328 - 35,155,158,528 - 2 GiB
    kv = 77_309_411_328 - 35_155_158_528 - 2 * GiB
    assert cap.kv_bytes_per_gpu == kv == 40_006_769_152
    # block per GPU 16 x 28,672 = 458,752; 40,006,769,152 // 458,752 = 87,207 blocks
    assert cap.blocks_per_replica == kv // 458_752 == 87_207
    assert cap.tokens_per_replica == 87_207 * 16


def test_qwen_72b_fp8_on_8_h200_like_the_example() -> None:
    # examples/modeldeployment-qwen72b.yaml: TP 8, 141Gi, utilization 0.92, fp8_e5m2, block 16, 2 replicas
    assert compute_kv_bytes_per_token(QWEN72, "fp8_e5m2") == 2 * 80 * 8 * 128 == 163_840
    assert compute_kv_bytes_per_token_per_gpu(QWEN72, "fp8_e5m2", 8) == 20_480
    cap = compute_replica_capacity(
        QWEN72,
        gpu_memory_bytes=parse_byte_size("141Gi"),
        gpu_memory_utilization="0.92",
        kv_cache_dtype="fp8_e5m2",
        tensor_parallel=8,
        replicas=2,
    )
    # usable = floor(141 x 2^30 x 0.92) = floor(139,285,789,409.28)
    assert cap.usable_bytes_per_gpu == 139_285_789_409
    # weights = 72,706,203,648 x 2 / 8
    assert cap.weight_bytes_per_gpu == 18_176_550_912
    assert cap.kv_bytes_per_gpu == 139_285_789_409 - 18_176_550_912 - 2_147_483_648 == 118_961_754_849
    # 118,961,754,849 // (16 x 20,480 = 327,680) = 363,042 blocks -> 5,808,672 tokens per replica
    assert cap.blocks_per_replica == 363_042
    assert cap.tokens_per_replica == 5_808_672
    assert cap.tokens_pool == 2 * 5_808_672
    # 128K sessions: 8,192 blocks each; 363,042 // 8,192 = 44 per replica
    assert compute_sessions_that_fit(cap.blocks_per_replica, 131_072, 16) == 44


def test_qwen_restore_times() -> None:
    # 8,192 tokens x 20,480 B = 167,772,160 B per GPU over 40 GB/s = 4.194304 ms
    # 8,192 x 163,840 B = 1,342,177,280 B from NVMe at 12 GB/s = 111.848 ms
    r = compute_restore_times(QWEN72, context_tokens=8192, kv_cache_dtype="fp8_e5m2", tensor_parallel=8)
    assert r.bytes_per_gpu == 167_772_160
    assert r.offload_bytes == 1_342_177_280
    assert r.cpu_seconds == pytest.approx(167_772_160 / 40e9, rel=1e-12)
    assert r.nvme_seconds == pytest.approx(1_342_177_280 / 12e9, rel=1e-12)


# ----------------------------------------------------------------------------------- tensor parallel


def test_gqa_kv_heads_replicate_when_tp_exceeds_kv_heads() -> None:
    # Llama-70B has 8 KV heads; with TP 16 every GPU keeps max(1, 8 // 16) = 1 head
    assert compute_kv_heads_per_gpu(LLAMA70, 16) == 1
    # per GPU: 2 x 80 x 1 x 128 x 2 = 40,960 B/token, the same as TP 8
    assert compute_kv_bytes_per_token_per_gpu(LLAMA70, "auto", 16) == 40_960
    assert compute_kv_bytes_per_token_per_gpu(LLAMA70, "auto", 8) == 40_960
    # the replica stores 16 x 40,960 = 655,360 B/token: twice the logical 327,680 (every head twice)
    assert compute_kv_bytes_per_token_per_replica(LLAMA70, "auto", 16) == 655_360
    assert compute_offload_bytes_per_token(LLAMA70, "auto", 16) == 655_360
    # TP 4 <= 8 heads: 2 heads per GPU, 81,920 B; the replica sum equals the logical size
    assert compute_kv_bytes_per_token_per_gpu(LLAMA70, "auto", 4) == 81_920
    assert compute_kv_bytes_per_token_per_replica(LLAMA70, "auto", 4) == 327_680


def test_parallel_shapes_vllm_rejects_are_errors() -> None:
    with pytest.raises(SizingError, match="does not divide the 64 attention heads"):
        compute_kv_bytes_per_token_per_gpu(LLAMA70, "auto", 3)
    # 48 heads / 6 = 8 OK, but 8 KV heads and TP 6: neither divides the other
    with pytest.raises(SizingError, match="one must divide the other"):
        compute_kv_bytes_per_token_per_gpu(MIXTRAL, "auto", 6)
    with pytest.raises(SizingError, match="exceeds the 2 layers"):
        compute_layers_per_gpu(TINY, 3)


def test_pipeline_parallel_bounds_by_the_largest_stage() -> None:
    # 80 layers over 3 stages: ceil(80 / 3) = 27 layers on the largest
    assert compute_layers_per_gpu(LLAMA70, 3) == 27
    # per GPU with TP 8 x PP 3 (each GPU: 1 head, 27 layers): 2 x 27 x 1 x 128 x 2 = 13,824 B
    assert compute_kv_bytes_per_token_per_gpu(LLAMA70, "auto", 8, 3) == 13_824
    # the replica sums all 80 layers over 8 heads once: 327,680
    assert compute_kv_bytes_per_token_per_replica(LLAMA70, "auto", 8, 3) == 327_680
    # weights split over 24 GPUs: ceil(70,553,706,496 x 2 / 24) = 5,879,475,541.33 -> 5,879,475,542
    assert compute_weight_bytes_per_gpu(LLAMA70, 8, 3) == 5_879_475_542


def test_bytes_per_block() -> None:
    # Llama-8B TP 1, bf16, block 16: 16 x (2 x 32 x 8 x 128 x 2 = 131,072) = 2 MiB
    assert compute_bytes_per_block_per_gpu(LLAMA8, "auto", 16) == 2 * 2**20
    with pytest.raises(SizingError, match="block size"):
        compute_bytes_per_block_per_gpu(LLAMA8, "auto", 0)


# -------------------------------------------------------------------------------------------- fit


def test_model_does_not_fit_is_a_clear_error() -> None:
    # 70,553,706,496 x 2 B = 131.4 GiB of weights on one 80 GiB GPU
    with pytest.raises(SizingError, match=r"model does not fit: 131\.42 GiB of weights"):
        compute_replica_capacity(LLAMA70, gpu_memory_bytes=80 * GiB)
    # Weights fit but leave less than one block: also "does not fit"
    with pytest.raises(SizingError, match="less than one"):
        compute_replica_capacity(
            TINY, gpu_memory_bytes=GiB, gpu_memory_utilization=1, reserve_bytes_per_gpu=GiB - 100
        )


def test_weight_dtypes() -> None:
    int4 = LLAMA8.model_copy(update={"weight_dtype": WeightDtype.INT4})
    # 8,030,261,248 params x 0.5 B = 4,015,130,624 B
    assert compute_weight_bytes_per_gpu(int4) == 4_015_130_624
    # auto KV for quantized weights is bf16 (2 B); for fp16/fp32 checkpoints fp16
    assert kv_cache_dtype_bytes("auto", WeightDtype.INT4) == 2
    assert resolve_kv_cache_dtype("auto", "fp32") is KVCacheDtype.FLOAT16
    assert resolve_kv_cache_dtype("auto", "fp16") is KVCacheDtype.FLOAT16
    assert resolve_kv_cache_dtype("fp8", "bf16") is KVCacheDtype.FP8
    with pytest.raises(SizingError, match="unknown KV cache dtype 'fp7'"):
        compute_kv_bytes_per_token(LLAMA8, "fp7")


def test_workload_tiers_and_replicas_needed() -> None:
    cap = compute_replica_capacity(
        QWEN72,
        gpu_memory_bytes=parse_byte_size("141Gi"),
        gpu_memory_utilization="0.92",
        kv_cache_dtype="fp8_e5m2",
        tensor_parallel=8,
        replicas=2,
    )
    need = compute_workload_needs(
        QWEN72,
        cap,
        sessions=100,
        context_tokens=131_072,
        kv_cache_dtype="fp8_e5m2",
        tensor_parallel=8,
        cpu_tier_bytes_per_replica=parse_byte_size("256Gi"),
        nvme_tier_bytes_per_replica=parse_byte_size("2Ti"),
    )
    session = 131_072 * 163_840  # 20 GiB per session offloaded
    assert session == 20 * GiB
    assert need.hbm.sessions_fit == 88 and need.hbm.fits is False  # 44 per replica x 2
    assert need.replicas_needed == 3  # ceil(100 / 44)
    assert need.cpu.needed_bytes == 100 * 20 * GiB
    assert need.cpu.sessions_fit == (256 // 20) * 2 == 24 and need.cpu.fits is False
    assert need.nvme.sessions_fit == (2048 // 20) * 2 == 204 and need.nvme.fits is True
    no_tier = compute_workload_needs(
        QWEN72, cap, sessions=1, context_tokens=10, kv_cache_dtype="fp8_e5m2", tensor_parallel=8
    )
    assert no_tier.cpu.capacity_bytes is None and no_tier.cpu.fits is None


# ------------------------------------------------------------------------------------------- quotas


def test_quota_conversions() -> None:
    # 29% of 100 blocks is 29 (a float product 0.29 * 100 = 28.999... would floor to 28)
    assert compute_blocks_for_share(0.29, 100) == 29
    assert compute_blocks_for_share("25%", 10_000) == 2_500
    assert compute_blocks_for_share(Fraction(1, 3), 10) == 3
    assert compute_blocks_for_share(1, 7) == 7
    assert parse_share("12.5%") == Fraction(1, 8)
    with pytest.raises(SizingError, match="outside"):
        parse_share("150%")
    with pytest.raises(SizingError, match="bad share"):
        parse_share("lots")
    # tokens -> blocks rounds up: 17 tokens need 2 blocks of 16
    assert compute_blocks_for_tokens(17, 16) == 2
    assert compute_blocks_for_tokens(16, 16) == 1
    assert compute_blocks_for_tokens(0, 16) == 0
    # bytes <-> tokens
    assert compute_bytes_for_tokens(1000, 512) == 512_000
    assert compute_tokens_for_bytes(512_000 + 511, 512) == 1000


# ---------------------------------------------------------------------------------------- quantities


def test_parse_byte_size() -> None:
    assert parse_byte_size("141GB") == 141 * 10**9
    assert parse_byte_size("141G") == 141 * 10**9
    assert parse_byte_size("80GiB") == 80 * 2**30
    assert parse_byte_size("256Gi") == 256 * 2**30
    assert parse_byte_size("2Ti") == 2 * 2**40
    assert parse_byte_size("1.5T") == 1_500_000_000_000
    assert parse_byte_size("1073741824") == GiB
    assert parse_byte_size(" 512 MiB ") == 512 * 2**20
    for bad in ("", "12XB", "-1Gi", "Gi", "1,5Gi", "1e9"):
        with pytest.raises(SizingError, match="bad byte quantity"):
            parse_byte_size(bad)


def test_parse_counts_and_tokens() -> None:
    assert parse_token_count("128K") == 131_072
    assert parse_token_count("1M") == 1_048_576
    assert parse_count("671B") == 671 * 10**9
    assert parse_count("70.6B") == 70_600_000_000
    with pytest.raises(SizingError, match="not a whole number"):
        parse_count("1.5")


# -------------------------------------------------------------------------------------- validation


def _arch(**overrides: object) -> ModelArchitecture:
    fields: dict[str, object] = {
        "num_layers": 2,
        "num_attention_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 32,
        "hidden_size": 128,
        "num_parameters": 1000,
        "weight_dtype": "bf16",
    }
    fields.update(overrides)
    return build_model_architecture(**fields)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_attention_heads": 0}, "num_attention_heads must be at least 1, got 0"),
        ({"num_kv_heads": 0}, "num_kv_heads must be at least 1, got 0"),
        ({"num_layers": 0}, "num_layers must be at least 1"),
        ({"head_dim": 0}, "head_dim must be at least 1"),
        ({"num_parameters": 0}, "num_parameters must be at least 1"),
        ({"num_kv_heads": 3}, r"num_kv_heads \(3\) must divide num_attention_heads \(4\)"),
        ({"weight_dtype": "fp6"}, "unknown weight dtype 'fp6'"),
        ({"kv_lora_rank": 512}, "kv_lora_rank and qk_rope_head_dim are set together"),
        ({"num_experts": 8}, "num_experts_per_token must be between 1 and num_experts"),
        ({"num_experts": 8, "num_experts_per_token": 9}, "between 1 and num_experts"),
        ({"num_experts_per_token": 2}, "the model has no experts"),
        ({"colour": "red"}, "colour: Extra inputs are not permitted"),
    ],
)
def test_invalid_architectures_name_the_field(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(SizingError, match=message):
        _arch(**overrides)


def test_attention_kinds_and_aliases() -> None:
    assert _arch(num_kv_heads=4).attention_kind is AttentionKind.MHA
    assert _arch(num_kv_heads=1).attention_kind is AttentionKind.MQA
    assert _arch().attention_kind is AttentionKind.GQA
    assert _arch(weight_dtype="bf16").weight_dtype is WeightDtype.BFLOAT16
    assert _arch(weight_dtype="half").weight_dtype is WeightDtype.FLOAT16
    # MQA: 2 x 2 layers x 1 head x 32 x 2 B = 256 B/token, replicated on every TP rank
    mqa = _arch(num_kv_heads=1)
    assert compute_kv_bytes_per_token(mqa) == 256
    assert compute_kv_bytes_per_token_per_gpu(mqa, "auto", 4) == 256


def test_presets() -> None:
    assert set(PRESETS) == {
        "llama-3.1-8b",
        "llama-3.3-70b",
        "qwen2.5-72b",
        "mixtral-8x22b",
        "deepseek-v3",
        "tiny-llama",
    }
    assert get_preset("Llama-3.3-70B") is PRESETS["llama-3.3-70b"]
    with pytest.raises(SizingError, match="unknown preset 'gpt-5'"):
        get_preset("gpt-5")
    assert DSV3.kv_lora_rank == 512 and DSV3.qk_rope_head_dim == 64 and DSV3.num_layers == 61
    assert DSV3.num_experts == 256 and DSV3.num_experts_per_token == 8


# --------------------------------------------------------------------------------------- properties


@given(
    kv_bytes=st.integers(min_value=0, max_value=2**40),
    per_token=st.integers(min_value=1, max_value=2**20),
    block_size=st.sampled_from([1, 16, 32, 128]),
)
def test_tokens_for_kv_bytes_never_exceed_the_space(kv_bytes: int, per_token: int, block_size: int) -> None:
    tokens = compute_tokens_for_kv_bytes(kv_bytes, per_token, block_size)
    assert tokens % block_size == 0
    assert tokens * per_token <= kv_bytes
    # one more block would not fit
    assert (tokens + block_size) * per_token > kv_bytes


def test_build_plan_wires_everything() -> None:
    plan_request = PlanRequest(
        model_name="qwen",
        architecture=QWEN72,
        kv_cache_dtype=KVCacheDtype.FP8_E5M2,
        tensor_parallel=8,
        gpu_memory_bytes=parse_byte_size("141Gi"),
        gpu_memory_utilization=Fraction(92, 100),
        replicas=2,
        context_tokens=131_072,
        sessions=64,
    )
    plan = build_plan(plan_request)
    assert plan.capacity.tokens_per_replica == 5_808_672
    # a float utilization means its decimal: 0.92 -> 92/100, the same plan as the Fraction
    same = PlanRequest.model_validate({**plan_request.model_dump(), "gpu_memory_utilization": 0.92})
    assert same.gpu_memory_utilization == Fraction(92, 100)
    assert plan.sessions is not None and plan.sessions.pool == 88
    assert plan.workload is not None and plan.workload.hbm.fits is True
    assert plan.restore is not None and plan.restore.bytes_per_gpu == 131_072 * 20_480
    with pytest.raises(SizingError, match="--sessions needs --context"):
        build_plan(
            PlanRequest(
                model_name="q", architecture=QWEN72, gpu_memory_bytes=141 * GiB, tensor_parallel=8, sessions=3
            )
        )
