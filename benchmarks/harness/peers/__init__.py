"""The implementations each benchmark sets side by side, one module per problem: ``logits``
(cross entropy over logits, one GPU or a vocabulary shard), ``linear`` (fused linear cross
entropy) and ``logprobs`` (token log-probs and entropy from hidden states). Each peer is imported
only when its adapter is made, so a missing one is reported, not fatal."""
