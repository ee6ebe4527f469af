"""Model shapes for the vLLM adapter's tests."""

# Shapes vLLM's CPU kernels accept: a 576-wide MLA latent (kv_lora_rank 512 + rope 64).
SHAPES = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=2,
    kv_lora_rank=512,
    qk_nope_head_dim=16,
    qk_rope_head_dim=64,
    v_head_dim=16,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    max_position_embeddings=256,
)
