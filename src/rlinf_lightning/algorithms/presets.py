"""The LLM algorithms: :class:`PolicyGradient` with each paper's defaults, one class per preset
so that ``trainer.algorithm: dapo`` plus ``--trainer.algorithm.init_args.clip_eps_high=0.3``
overrides a preset key by key (``rlinf fit --print_config`` shows every option). The table of
what each reads and its options is ``docs/algorithms.md``."""

from __future__ import annotations

from dataclasses import dataclass

from rlinf_lightning.algorithms.policy_gradient import PolicyGradient


@dataclass
class GRPO(PolicyGradient):
    """GRPO (Shao et al., 2024, DeepSeekMath): group-normalised advantages, PPO clip. As veRL and
    TRL run it today: a token-mean loss and no KL (the paper: per-sequence means and a k3 KL of
    0.04; set ``loss_agg: seq-mean-token-mean, kl_coef: 0.04``)."""


@dataclass
class DrGRPO(PolicyGradient):
    """Dr. GRPO (Liu et al., 2025, "Understanding R1-Zero-Like Training"): GRPO without the std
    division (``scale_std``) and without length normalisation (every sequence's token sum over
    the same constant, the longest response allowed)."""

    scale_std: bool = False
    loss_agg: str = "seq-mean-token-sum-norm"


@dataclass
class DAPO(PolicyGradient):
    """DAPO (Yu et al., 2025): clip-higher (0.2 / 0.28), a token-level loss, the overlong soft
    penalty as a reward term (the last 20% of the allowed length: 4096 of 20480 tokens in the
    paper) and dynamic sampling (groups whose rewards are all equal replaced; veRL's recipe caps
    the rounds at 10)."""

    clip_eps_high: float | None = 0.28
    loss_agg: str = "token-mean"
    overlong_buffer: float = 0.2
    overlong_penalty: float = 1.0
    max_sampling_rounds: int = 10


@dataclass
class GSPO(PolicyGradient):
    """GSPO (Zheng et al., 2025, Qwen): one length-normalised importance ratio per sequence,
    clipped per sequence (3e-4 below, 4e-4 above), group-normalised advantages."""

    policy_loss: str = "gspo"
    clip_eps: float = 3e-4
    clip_eps_high: float | None = 4e-4
    loss_agg: str = "seq-mean-token-mean"


@dataclass
class RLOO(PolicyGradient):
    """RLOO (Ahmadian et al., 2024, "Back to Basics"): REINFORCE with the leave-one-out baseline,
    the whole response one action (token sums), a k1 KL of 0.05 in the reward."""

    advantage_estimator: str = "rloo"
    loss_agg: str = "seq-mean-token-sum"
    kl_coef: float = 0.05
    kl_estimator: str = "k1"
    kl_in_reward: bool = True


@dataclass
class ReinforcePlusPlus(PolicyGradient):
    """REINFORCE++ (Hu, 2025): per-token returns of the outcome reward and a k1 KL of 0.01 in the
    reward, no baseline, whitened over the whole batch; PPO clip."""

    advantage_estimator: str = "reinforce_plus_plus"
    norm_adv: bool = True
    kl_coef: float = 0.01
    kl_estimator: str = "k1"
    kl_in_reward: bool = True


@dataclass
class ReinforcePlusPlusBaseline(PolicyGradient):
    """REINFORCE++-baseline (Hu, 2025): the reward minus its group's mean, whitened over the whole
    batch, and a k2 KL of 0.01 in the loss; PPO clip."""

    advantage_estimator: str = "reinforce_plus_plus_baseline"
    norm_adv: bool = True
    kl_coef: float = 0.01
    kl_estimator: str = "k2"


@dataclass
class CISPO(PolicyGradient):
    """CISPO (MiniMax-M1, 2025): the clipped importance weight (no lower bound, 0.28 above) times
    the advantage times the log-prob, so no token loses its gradient; token-level loss."""

    policy_loss: str = "cispo"
    clip_eps: float = 1.0
    clip_eps_high: float | None = 0.28
    loss_agg: str = "token-mean"


#: name -> preset, in the order the docs list them
PRESETS: dict[str, type[PolicyGradient]] = {
    "grpo": GRPO,
    "dr_grpo": DrGRPO,
    "dapo": DAPO,
    "gspo": GSPO,
    "rloo": RLOO,
    "reinforce_plus_plus": ReinforcePlusPlus,
    "reinforce_plus_plus_baseline": ReinforcePlusPlusBaseline,
    "cispo": CISPO,
}
