"""Tiny randomly initialised causal LMs of each supported family, built from the config classes
(no download)."""


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
}


def make_model(model_type: str, seed: int = 0, **overrides):
    import transformers

    config_name, model_name, extra = FAMILIES[model_type]
    kwargs = {**COMMON, **extra, **overrides}
    config = getattr(transformers, config_name)(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).float()
    model.train()
    return model


def make_batch(seed: int = 1, batch: int = 2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100  # prompt masked
    labels[-1, -2:] = -100  # right padding
    mask = torch.ones_like(ids)
    mask[-1, -2:] = 0
    return ids, mask, labels
