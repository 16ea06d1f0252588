"""``policy.gradient_checkpointing`` (and the critic's, ``task.critic.gradient_checkpointing``): the
forward keeps fewer activations for the backward (the decoder layers are recomputed there) and the
gradients equal those without it."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from rlinf_lightning.policies import LMPolicy, ValueModel
from rlinf_lightning.policies.vla import TinyVLA
from test_vla import ACTION_DIM, CHUNK, _obs


def _lm_batch() -> TensorDict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 100, (6, 14), generator=g)
    mask = torch.ones_like(ids)
    mask[:2, :3] = 0  # left padding
    return TensorDict(
        {"input_ids": ids, "attention_mask": mask, "response_mask": torch.ones(6, 8)}, batch_size=[6]
    )


def _lm_loss(policy: LMPolicy) -> torch.Tensor:
    return policy.forward_logprobs(_lm_batch()).sum()


def _critic_loss(critic: ValueModel) -> torch.Tensor:
    torch.nn.init.normal_(critic.model.head.weight, std=0.1)  # the zero head would pass no gradient
    return critic.forward_values(_lm_batch()).pow(2).sum()


def _vla_loss(policy: TinyVLA) -> torch.Tensor:
    obs = _obs(3)
    action = policy.act(obs, deterministic=True)["action"]
    logprob, entropy, value = policy.evaluate(TensorDict({"obs": obs, "action": action}, batch_size=[3]))
    return logprob.sum() + entropy.sum() + value.sum()


def _build(kind: str, assets, checkpointing: bool):
    if kind == "lm":
        policy = LMPolicy(str(assets["sft"]), gradient_checkpointing=checkpointing)
    elif kind == "critic":
        torch.manual_seed(0)
        policy = ValueModel(str(assets["sft"]), gradient_checkpointing=checkpointing)
    else:
        policy = TinyVLA(gradient_checkpointing=checkpointing)
        policy.configure_spaces(_obs(2), (CHUNK, ACTION_DIM))
    policy.configure_model()
    return policy.train()


def _gradients(policy, loss_fn) -> tuple[dict[str, torch.Tensor], int]:
    """The gradients of ``loss_fn(policy)`` and the bytes its forward saved for the backward."""
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(policy)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}
    return grads, sum(saved)


@pytest.mark.parametrize("kind", ["lm", "critic", "vla"])
def test_gradient_checkpointing_saves_activations_and_keeps_the_gradients(kind, assets):
    loss_fn = {"lm": _lm_loss, "critic": _critic_loss, "vla": _vla_loss}[kind]
    plain, plain_bytes = _gradients(_build(kind, assets, False), loss_fn)
    checkpointed, saved_bytes = _gradients(_build(kind, assets, True), loss_fn)
    assert saved_bytes < 0.7 * plain_bytes  # the decoder layers' activations are recomputed instead
    assert checkpointed.keys() == plain.keys() and plain
    for name, g in plain.items():
        torch.testing.assert_close(checkpointed[name], g, atol=1e-6, rtol=1e-5, msg=name)
