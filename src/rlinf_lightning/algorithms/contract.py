"""What an estimator or a policy loss reads, and what a workflow provides.

Every entry of :data:`~rlinf_lightning.algorithms.ADVANTAGE_ESTIMATORS`,
:data:`~rlinf_lightning.algorithms.POLICY_LOSSES` and
:data:`~rlinf_lightning.algorithms.OFF_POLICY_CORRECTIONS` declares the inputs it reads (:func:`reads`), by
the names of :data:`INPUTS`; an algorithm reads the union of its parts' (``Algorithm.reads``). A
workflow states what it provides, and :func:`unserved` turns the difference into one line naming
the missing input, so ``algorithm: ppo`` on a task without a critic is refused at validation,
before any model loads, instead of failing inside a stage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from rlinf_lightning.flow.batch import LOSS_MASK

F = TypeVar("F", bound=Callable[..., Any])

#: input name -> what it is and where it comes from
INPUTS: dict[str, str] = {
    "rewards": "one reward per sample",
    "group_ids": "which prompt (group) each sample answers",
    LOSS_MASK: "which positions are trained on (response tokens; an episode's steps)",
    "dones": "where episodes end (terminations and truncations, with the final observation's value)",
    "token_rewards": "per-token rewards (the outcome on the last token, a KL penalty in the reward)",
    "values": "a critic's value estimates (a value model)",
    "old_logprobs": "log-probs of the behaviour policy that sampled",
    "proximal_logprobs": "log-probs of the actor's weights before its update (recomputed by the actor)",
    "ref_logprobs": "log-probs of the frozen reference policy",
}

#: what an entry that declares nothing is taken to read
DEFAULT_READS = frozenset({"rewards", "group_ids"})


class Algorithm:
    """Base of every algorithm: a dataclass whose fields are its options (``algorithms.options``
    checks their ranges). ``reads`` names the inputs it needs from the workflow.

    The attributes below are what the workflows read; their values here are "off" (one update,
    no KL, no correction), so an algorithm declares only the options it has, and a workflow reads
    each one plainly. An object that is no subclass is checked once, when the workflow is built
    (:func:`interface_problems`)."""

    reads: frozenset[str] = DEFAULT_READS
    needs_reference: bool = False
    # -- the reasoning workflow's actor, advantage and critic stages --------------------------
    kl_coef: float = 0.0
    kl_in_reward: bool = False
    kl_target: float | None = None
    entropy_coef: float = 0.0
    tis_cap: float | None = None
    off_policy_correction: str = "none"
    norm_adv: bool = False
    ppo_epochs: int = 1
    num_mini_batches: int = 1
    updates_per_batch: int = 1
    overlong_buffer: float = 0.0
    max_sampling_rounds: int = 0
    critic_warmup: int = 0
    value_clip: float | None = None
    vf_coef: float = 1.0
    # -- the embodied workflow's actor (env steps) ------------------------------------------------
    update_epochs: int = 1
    num_minibatches: int = 1
    target_kl: float | None = None

    def on_tokens(self) -> Algorithm:
        """These options as the reasoning workflow runs them, one step per token (itself here;
        PPO's env-step options become a token-level algorithm)."""
        return self

    def compute_advantages(self, *args: Any, **kwargs: Any) -> Any:
        """The advantages of a batch (its signature is the workflow's: ``PolicyGradient``'s for
        tokens and episodes, ``PPO``'s for env steps)."""
        raise NotImplementedError(f"{type(self).__name__} computes no advantages")

    def loss(self, *args: Any, **kwargs: Any) -> Any:
        """``(loss_sum, count, metrics)`` of a micro-batch (signatures as :meth:`compute_advantages`)."""
        raise NotImplementedError(f"{type(self).__name__} has no loss")


#: what a workflow reads of an algorithm: :class:`Algorithm`'s declared attributes and methods
INTERFACE: tuple[str, ...] = (*Algorithm.__annotations__, "on_tokens", "compute_advantages", "loss")


def interface_problems(algorithm: Any) -> list[tuple[str, str]]:
    """``[("trainer.algorithm", problem)]`` naming the declared attributes ``algorithm`` lacks
    (:data:`INTERFACE`); empty for every :class:`Algorithm`."""
    missing = [name for name in INTERFACE if not hasattr(algorithm, name)]
    if not missing:
        return []
    why = (
        f"{type(algorithm).__name__} lacks {', '.join(missing)}; subclass "
        "rlinf_lightning.algorithms.Algorithm (its defaults switch each off)"
    )
    return [("trainer.algorithm", why)]


def reads(*names: str) -> Callable[[F], F]:
    """Declare the :data:`INPUTS` a registered function reads (as its ``reads`` attribute)."""
    unknown = sorted(set(names) - set(INPUTS))
    if unknown:
        raise ValueError(f"unknown input(s) {unknown}; known: {', '.join(INPUTS)}")

    def mark(fn: F) -> F:
        fn.reads = frozenset(names)  # type: ignore[attr-defined]
        return fn

    return mark


def reads_of(fn: Any) -> frozenset[str]:
    """The inputs ``fn`` declared with :func:`reads` (:data:`DEFAULT_READS` if it declared none)."""
    return getattr(fn, "reads", DEFAULT_READS)


def unserved(
    algorithm: Any, name: str, provided: Iterable[str], workflow: str, fix: str = ""
) -> list[tuple[str, str]]:
    """``[("trainer.algorithm", problem)]`` when ``algorithm`` reads an input the ``workflow``
    does not provide (``fix`` says how to provide it); empty when it is served."""
    missing = sorted(set(algorithm.reads) - set(provided))
    if not missing:
        return []
    what = "; ".join(f"{m} ({INPUTS.get(m, 'undeclared')})" for m in missing)
    return [
        ("trainer.algorithm", f"{name} reads {what}, which the {workflow} workflow does not provide{fix}")
    ]
