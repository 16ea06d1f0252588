"""Flow-Noise (πRL, arXiv 2510.25889): π0's denoising chain made a stochastic policy.

π0 turns Gaussian noise ``A^0`` into an action chunk in ``K`` Euler steps of its learned velocity
``v_θ`` (``transformers``' time runs from ``t = 1``, noise, down to ``t = 0``, action; the paper's
``τ`` is ``1 - t``). Flow-Noise adds a learned Gaussian at every step, so each step is a transition
with a density and the chain's joint log-likelihood is a sum of Gaussian log-densities:

    (step)    A^{k+1} ~ N(μ_k, diag σ_k²),   μ_k = A^k + (t_{k+1} - t_k) v_θ(A^k, o, t_k),
              σ_k = σ_θ(A^k, o, t_k)  (the noise head, bounded in ``[σ_min, σ_max]``)
    (chain)   log π(A | o) = log N(A^0; 0, I) + Σ_{k=0}^{K-1} log N(A^{k+1}; μ_k, σ_k²)

The rollout records the chain ``A^0 .. A^K``; the actor recomputes ``μ_k`` and ``σ_k`` for that
same chain under its parameters (the chain's equation again), so PPO's ratio compares one sampled
chain under two policies. Only the entries the env executes (the first ``chunk`` steps, the env's action
dimensions) count, as RLinf's ``joint_logprob`` does.

Noise at the last step alone (``noisy_steps="last"``) makes the policy a Gaussian around π0's
deterministic action: ``A^1 .. A^{K-1}`` follow the ODE from ``A^0``, so the executed chunk's
marginal log-likelihood is exactly ``log N(A^K; μ_{K-1}, σ_{K-1}²)`` with ``μ_{K-1}`` recomputed
along the ODE under the current weights (the gradient runs through all ``K`` steps). Evaluation
runs that ODE without the noise, so it acts with the mean of the policy PPO improves; with noise at
every step the noisy chains visit intermediate actions the deterministic chain never does.
"""

from __future__ import annotations

import math

import torch

LOG_2PI_E = math.log(2 * math.pi * math.e)


def time_grid(steps: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``t_0 = 1 > t_1 > ... > t_K = 0``, evenly spaced (``sample_actions``' Euler steps)."""
    return torch.linspace(1.0, 0.0, steps + 1, device=device)


def normal_logpdf(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """``log N(x; mean, std²)`` elementwise."""
    return -0.5 * ((x - mean) / std) ** 2 - torch.log(std) - 0.5 * math.log(2 * math.pi)


LOGPROB_LEVELS = ("chunk", "entry")
NOISY_STEPS = ("all", "last")


def flow_noise_logprob(
    chain: torch.Tensor,
    mean: torch.Tensor,
    std: torch.Tensor,
    executed: torch.Tensor,
    level: str = "chunk",
    noisy_steps: str = "all",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chain's log-likelihood (above) and its entropy, over the ``executed`` entries (a
    ``[H, D]`` 0/1 mask).

    ``chain``: ``[B, K+1, H, D]`` (``A^0 .. A^K``); ``mean``, ``std``: ``[B, K, H, D]`` (``μ_k``,
    ``σ_k``). ``level``: ``"chunk"``, the chain's joint log-likelihood ``[B]``; ``"entry"``, one
    log-prob per executed entry ``[B, N]`` (entries in ``executed``'s row-major order), the mean of
    that entry's ``K + 1`` terms (RLinf's ``joint_logprob`` with ``logprob_type: token_level``):
    PPO then takes a ratio per entry. The entropy ``[B]`` is the transitions' (``Σ_k Σ_i ½ log(2πe
    σ²)``): ``A^0``'s is a constant. ``noisy_steps="last"``: the last transition's term alone
    (and its entropy), the chunk's exact log-likelihood when the other steps follow the ODE."""
    if noisy_steps == "last":
        terms, std = normal_logpdf(chain[:, -1:], mean[:, -1:], std[:, -1:]), std[:, -1:]
    else:
        start = normal_logpdf(chain[:, 0], torch.zeros_like(chain[:, 0]), torch.ones_like(chain[:, 0]))
        terms = torch.cat([start[:, None], normal_logpdf(chain[:, 1:], mean, std)], 1)  # [B, K+1, H, D]
    entropy = ((0.5 * LOG_2PI_E + torch.log(std)) * executed).sum((-3, -2, -1))
    if level == "entry":
        return terms.mean(1)[:, executed.bool()], entropy
    return (terms * executed).sum((-3, -2, -1)), entropy
