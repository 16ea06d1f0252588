"""TinyVLA: a vision-language-action actor-critic, OpenVLA(-OFT) in miniature, built from configs:
the policy (:mod:`.policy`) and its network, action bins and tokenizer (:mod:`.network`).

What RLinf trains on ManiSkill and LIBERO is OpenVLA-OFT: an image and an instruction go into a
causal LM, and the action is read off the LM's logits. This module is that recipe at a size a CPU
steps in milliseconds, with nothing downloaded:

- **Inputs.** A small conv net turns the uint8 RGB image ``obs["rgb"]`` into a ``grid x grid`` map
  of visual tokens, projected to the LM's hidden size; ``obs["state"]`` (proprioception), when the
  env gives one, is projected to one more token; ``obs["instruction"]`` (one string per env, or
  :attr:`TinyVLA.default_instruction` where the env has none) goes through a character-level
  tokenizer. The LM (a ``transformers`` Qwen2 or Llama built from a config) reads
  ``[visual | state | <s> instruction </s> | action tokens]``.
- **Actions** (OpenVLA's): each action dimension is one of 256 bins over ``[-1, 1]`` (the bin
  centres ``linspace(-1, 1, 256)``), and bin ``b`` is the vocabulary id ``V - 256 + b``: the top
  256 ids of the vocabulary. An action token's distribution is the softmax of the LM's logits over
  those 256 ids (divided by ``temperature``, the same at rollout and training, so the rollout's
  log-probs are the trainer's). A chunk of ``chunk`` steps of ``action_dim`` dimensions is decoded
  ``"oft"`` (OpenVLA-OFT: one forward pass over ``chunk * action_dim`` placeholder tokens, each
  position's distribution sampled independently) or ``"autoregressive"`` (OpenVLA: one token at a
  time through the KV cache, each sampled bin fed back).
- **Critic** (RLinf's): a small MLP on the LM's hidden state at the position before the first
  action token (the ``</s>`` closing the prompt), which has seen the whole observation.

Every row's randomness (Gumbel noise for all its action tokens) is drawn up front from that row's
generator, so a row's action depends on its observation and its generator only, never on which
other envs share its batch. The text segment has a fixed length (instructions are left-padded
inside it, pads masked out, positions counted over real tokens only), so every batch has the same
shapes whatever its instructions.
"""

from rlinf_lightning.policies.vla.network import (
    NUM_BINS,
    VLANet,
    action_to_bins,
    bin_centres,
    build_lm_config,
    build_vla_tokenizer,
)
from rlinf_lightning.policies.vla.policy import TinyVLA

__all__ = [
    "NUM_BINS",
    "TinyVLA",
    "VLANet",
    "action_to_bins",
    "bin_centres",
    "build_lm_config",
    "build_vla_tokenizer",
]
