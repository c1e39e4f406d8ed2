"""Tiny randomly initialised causal LMs of each supported family, built from the config classes
(no download)."""


import pytest
import torch

VOCAB = 101
SEQ = 9

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

# model_type -> (config class, model class, extra config)
# the mixture-of-experts families return their router loss (output_router_logits), with a
# coefficient large enough that a loss without it is far off
MOE = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.5)
FAMILIES = {
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": None}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               {"final_logit_softcapping": 2.0, "sliding_window": 4}),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"sliding_window": 4}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", {}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "phi": ("PhiConfig", "PhiForCausalLM", {}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {"sliding_window": None}),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {}),
    # scaled logits, by factors far enough from 1 that ignoring them fails the loss comparison
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"logits_scaling": 4.0}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {"logit_scale": 0.25}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {"num_local_experts": 4, "sliding_window": None, **MOE}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  {"num_experts": 4, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 32, "decoder_sparse_step": 1,
                   "mlp_only_layers": [], "sliding_window": None, **MOE}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"num_experts": 4, "moe_intermediate_size": 32, "decoder_sparse_step": 1,
                   "mlp_only_layers": [], "sliding_window": None, **MOE}),
    # newer families: a tiny config each, every kind of layer the family mixes present once
    "llama4_text": ("Llama4TextConfig", "Llama4ForCausalLM",
                    {"num_local_experts": 4, "num_experts_per_tok": 1, "intermediate_size_mlp": 64,
                     "moe_layers": [1], "interleave_moe_layer_step": 2, "no_rope_layers": [1, 0],
                     "attention_chunk_size": 4,
                     "use_cache": False}),  # transformers 4.51 builds its cache in bf16
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    {"num_key_value_heads": 4, "n_routed_experts": 4, "n_shared_experts": 1,
                     "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                     "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1,
                     "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 4,
                     "qk_nope_head_dim": 8, "v_head_dim": 8, "head_dim": 4}),
    "gemma3n_text": ("Gemma3nTextConfig", "Gemma3nForCausalLM",
                     {"intermediate_size": 64, "sliding_window": 4,
                      "layer_types": ["sliding_attention", "full_attention"],
                      "activation_sparsity_pattern": [0.95, 0.0], "num_kv_shared_layers": 0,
                      "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 8,
                      "laurel_rank": 4, "altup_num_inputs": 2, "final_logit_softcapping": 2.0}),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   {"layer_types": ["linear_attention", "full_attention"],
                    "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                    "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                    "num_experts": 4, "moe_intermediate_size": 32,
                    "shared_expert_intermediate_size": 32, "decoder_sparse_step": 1,
                    "mlp_only_layers": [], **MOE}),
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM",
                     {"layer_types": ["linear_attention", "full_attention"],
                      "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                      "linear_num_key_heads": 2, "linear_num_value_heads": 4}),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                         {"layer_types": ["linear_attention", "full_attention"],
                          "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                          "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                          "num_experts": 4, "moe_intermediate_size": 32,
                          "shared_expert_intermediate_size": 32, **MOE}),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                {"num_local_experts": 4, "intermediate_size": 32, "sliding_window": 4,
                 "layer_types": ["sliding_attention", "full_attention"],
                 "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                                     "original_max_position_embeddings": 32,
                                     "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False},
                 **MOE}),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 {"n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 1,
                  "topk_group": 1, "use_qk_norm": True}),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM",
              {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]}),
    "gemma4_text": ("Gemma4TextConfig", "Gemma4ForCausalLM",
                    {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"],
                     "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 8,
                     "per_layer_config": {}, "final_logit_softcapping": 2.0}),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                    {"num_key_value_heads": 4, "n_routed_experts": 4, "n_shared_experts": 1,
                     "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                     "first_k_dense_replace": 1, "q_lora_rank": 16, "kv_lora_rank": 16,
                     "qk_rope_head_dim": 4, "qk_nope_head_dim": 8, "v_head_dim": 8,
                     "head_dim": 4}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"num_experts": 4, **MOE}),
    "phimoe": ("PhimoeConfig", "PhimoeForCausalLM",
               {"num_local_experts": 4, "router_jitter_noise": 0.0, **MOE}),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM",
                   {"num_local_experts": 4, "logits_scaling": 4.0, **MOE}),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM",
                {"logit_scale": 0.25, "sliding_window": 4,
                 "layer_types": ["sliding_attention", "full_attention"]}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {"no_rope_layers": [1, 0]}),
    "ministral": ("MinistralConfig", "MinistralForCausalLM",
                  {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]}),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM",
                {"sliding_window": 4, "sliding_window_pattern": 2,
                 "layer_types": ["sliding_attention", "full_attention"]}),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM",
                     {"moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": 32,
                      "moe_num_shared_experts": 1, "moe_layer_start_index": 1,
                      "moe_layer_end_index": 1, "output_router_logits": True,
                      "router_aux_loss_coef": 0.5}),
    "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM",
                 {"attention_dropout": 0.0, "residual_dropout": 0.0}),  # deterministic
}


def make_model(model_type: str, seed: int = 0, **overrides):
    import transformers

    config_name, model_name, extra = FAMILIES[model_type]
    config_class = getattr(transformers, config_name, None)
    if config_class is None:  # a family newer than the installed transformers
        pytest.skip(f"transformers {transformers.__version__} has no {config_name}")
    kwargs = {**COMMON, **extra, **overrides}
    config = config_class(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).float()
    _init_expert_tensors(model)
    model.train()
    return model


def _init_expert_tensors(model):
    """Some releases leave the stacked expert weights (``*Experts`` modules' own parameters) as
    ``torch.empty`` (Llama 4 in transformers 4.51): give them finite random values."""
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith("Experts"):
                for p in module.parameters(recurse=False):
                    p.normal_(0.0, 0.02)


def make_batch(seed: int = 1, batch: int = 2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100  # prompt masked
    labels[-1, -2:] = -100  # right padding
    mask = torch.ones_like(ids)
    mask[-1, -2:] = 0
    return ids, mask, labels
