"""What the two fused linear ops share on the host: the memory-budget strategy and the checks
that read the device under torch.compile."""
