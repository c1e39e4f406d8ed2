"""What every op's autograd shares: megatron-core's ``main_grad`` accumulation protocol
(``main_grad.py``) and the guard that refuses a second derivative (``first_order.py``). Each op's
own ``autograd.Function`` lives in its package under ``ops/``."""
