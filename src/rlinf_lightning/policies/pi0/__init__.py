"""π0 from ``transformers`` as an embodied policy: the policy (:mod:`.policy`), its network with
the RL heads (:mod:`.net`), Flow-Noise log-probs (:mod:`.flow`) and supervised fine-tuning on
demonstrations (:mod:`.sft`)."""

from rlinf_lightning.policies.pi0.policy import Pi0Policy

__all__ = ["Pi0Policy"]
