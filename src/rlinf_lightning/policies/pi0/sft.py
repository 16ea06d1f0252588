"""Supervised fine-tuning of π0 on demonstrations with its own flow-matching loss (``rlinf sft``
with a π0 ``base_model``): what π0 is pre-trained with, and where πRL starts its RL (few-shot SFT).

For a demonstrated chunk ``A`` (zero-padded to ``chunk_size x max_action_dim``), noise ``ε`` and a
time ``t ~ Beta(1.5, 1)`` (π0's schedule), π0 sees ``A^t = t ε + (1 - t) A`` and regresses its
velocity onto ``ε - A``; steps past an episode's end (``action_mask`` False) are left out. The
state and the actions are standardised with the demonstrations' statistics, saved beside the model
as ``norm_stats.json`` (:mod:`~rlinf_lightning.policies.pi0.norm`: without them a tiny π0 fitted
FetchReach's expert without reading the state, and reached no goal).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tensordict import TensorDict

from rlinf_lightning.errors import InputError
from rlinf_lightning.policies.pi0.demos import load_demos
from rlinf_lightning.policies.pi0.norm import NormStats
from rlinf_lightning.policies.pi0.policy import Pi0Policy, read_pi0_config

log = logging.getLogger(__name__)


def flow_matching_loss(policy: Pi0Policy, batch: TensorDict, generator: torch.Generator) -> torch.Tensor:
    """π0's flow-matching loss on a batch of demonstration rows (mean over the valid entries)."""
    pi0 = policy.model.pi0
    config = pi0.config
    n, chunk, dim = batch["action"].shape
    actions = batch["action"].float()
    actions = policy.norm.normalize_action(actions) if policy.norm is not None else actions
    actions = F.pad(actions, (0, config.max_action_dim - dim, 0, config.chunk_size - chunk))
    valid = F.pad(batch["action_mask"].float(), (0, config.chunk_size - chunk))[:, :, None].expand_as(actions)
    noise = torch.randn(actions.shape, generator=generator)
    u = torch.rand(n, generator=generator).clamp(1e-6, 1 - 1e-6)
    t = _beta_sample(u, config) * config.time_sampling_scale + config.time_sampling_offset
    inputs = policy.inputs(batch["obs"])
    cache = policy.model._prefix(inputs)
    out = pi0(state=inputs["state"], noise=noise, timestep=t.float(), actions=actions,
              attention_mask=inputs["attention_mask"], past_key_values=cache)  # fmt: skip
    error = (out.logits - (noise - actions)) ** 2
    return (error * valid).sum() / valid.sum().clamp_min(1.0)


def _beta_sample(u: torch.Tensor, config: Any) -> torch.Tensor:
    """``Beta(alpha, 1)`` by inversion (its CDF is ``t^alpha``); π0's default beta is 1."""
    if config.time_sampling_beta_beta != 1.0:
        raise ValueError("π0 SFT draws t ~ Beta(alpha, 1); time_sampling_beta_beta must be 1")
    return u ** (1.0 / config.time_sampling_beta_alpha)


def _policy_for(base_model: str, demos: TensorDict, meta: dict[str, str], source: str = "") -> Pi0Policy:
    """The π0 of ``base_model`` sized for the demonstrations (read from ``source``): demonstrations
    it cannot take (chunks longer than its ``chunk_size``, a state over its ``max_state_dim``) are
    an :class:`InputError` naming ``rlinf sft``'s option, before the model loads."""
    policy = Pi0Policy(base_model, image_keys=json.loads(meta.get("image_keys", "[]")),
                       state_keys=json.loads(meta.get("state_keys", '["state"]')))  # fmt: skip
    policy.default_instruction = meta.get("instruction") or policy.default_instruction
    chunk, size = demos["action"].shape[1], read_pi0_config(base_model)["chunk_size"]
    if chunk > size:
        raise InputError(
            f"--train_path {source}: its demonstrations' chunks are {chunk} actions, longer than the "
            f"chunk_size {size} of the π0 in --base_model {base_model}; record them with "
            f"rlinf demos --chunk {size}"
        )
    try:
        policy.configure_spaces(demos["obs"][:2], tuple(demos["action"].shape[1:]))
    except ValueError as exc:
        raise InputError(
            f"--train_path {source}: the π0 in --base_model {base_model} cannot take them: {exc}"
        ) from None
    policy.configure_model()
    return policy


def run_pi0_sft(
    base_model: str,
    train_path: str,
    output_dir: str,
    steps: int = 500,
    batch_size: int = 64,
    lr: float = 1e-3,
    seed: int = 0,
    test_path: str | None = None,
) -> dict[str, Any]:
    """Fine-tune the π0 in ``base_model`` on the demonstrations in ``train_path`` (see
    :mod:`~rlinf_lightning.policies.pi0.demos`) and save it to ``output_dir`` (``from_pretrained``
    layout, ``sft_settings.json`` beside it). ``test_path``: held-out demonstrations whose loss is
    reported."""
    settings = {k: v for k, v in locals().items()}
    demos, meta = load_demos(train_path)
    policy = _policy_for(base_model, demos, meta, train_path)
    state = torch.cat([demos["obs"][k].reshape(len(demos), -1).float() for k in policy.state_keys], -1)
    policy.norm = NormStats.of(state, demos["action"].float(), demos["action_mask"])
    model = policy.model.pi0
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    t0, loss = time.perf_counter(), torch.tensor(float("nan"))
    for step in range(1, steps + 1):
        rows = torch.randint(0, len(demos), (batch_size,), generator=generator)
        loss = flow_matching_loss(policy, demos[rows], generator)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == steps:
            log.info("pi0 sft step %d/%d loss %.4f", step, steps, loss.item())
    result: dict[str, Any] = {
        "settings": settings,
        "train_loss": float(loss.detach()),
        "train_s": time.perf_counter() - t0,
    }
    if test_path:
        held_out, _ = load_demos(test_path)
        with torch.no_grad():
            result["eval_loss"] = float(
                flow_matching_loss(policy, held_out, torch.Generator().manual_seed(seed))
            )
    model.eval()
    out = Path(output_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    policy.tokenizer.save_pretrained(tmp)
    policy.norm.save(tmp)
    (tmp / "sft_settings.json").write_text(json.dumps(result, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log.info("pi0 sft: loss %.4f after %d steps; saved to %s", result["train_loss"], steps, out)
    return result
