"""Autograd of the losses: the eager ``autograd.Function``s, their shared forward/backward steps,
and the ops registered for ``torch.compile``."""
