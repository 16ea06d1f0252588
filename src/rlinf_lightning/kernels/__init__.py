"""Kernels: the math a training step runs with fewer passes over memory than the eager modules
(the lm head's log-probs a chunk at a time, a decoder's norms and rotary embedding fused). They
import torch alone, so policies and the budgets that predict their memory can both use them."""
