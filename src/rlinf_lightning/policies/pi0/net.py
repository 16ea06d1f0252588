"""Pi0Net: a ``transformers`` π0 and the two small heads RL adds (noise and value), one forward.

Everything that trains sits in this module and every computation goes through :meth:`Pi0Net.forward`
(a sharded root, FSDP2's ``fully_shard(policy.model)``, gathers its parameters around each call).
The π0 is used as it is: its PaliGemma prefix pass (``embed_prefix`` and the VLM, once per
observation, giving the KV cache), then per denoising step its ``embed_action_time``, its expert
over the cache and its ``action_out_proj`` (the body of ``PI0ForConditionalGeneration.forward``
after the prefix), so a deterministic chain is exactly ``sample_actions``' Euler ODE.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from rlinf_lightning.policies.pi0.flow import time_grid


class NoiseHead(nn.Module):
    """πRL's learned exploration noise: the expert's output at each action position -> a standard
    deviation per action entry in ``[std_min, std_max]`` (tanh-squashed log-variance)."""

    def __init__(self, hidden: int, action_dim: int, std_min: float, std_max: float) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, action_dim))
        self.logvar_min, self.logvar_max = 2 * math.log(std_min), 2 * math.log(std_max)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        squashed = torch.tanh(self.mlp(h))
        logvar = self.logvar_min + (self.logvar_max - self.logvar_min) * (squashed + 1) / 2
        return torch.exp(0.5 * logvar)


class Pi0Net(nn.Module):
    """``pi0`` (a ``PI0ForConditionalGeneration``), ``noise_head`` and ``value_head``.

    The critic reads the expert's output at π0's *state token*: π0's attention blocks let that
    token see the images, the instruction and the state, and no noisy action, so it is a feature of
    the observation alone (the same at every denoising step), computed by the first step's pass;
    and ``value_inputs`` more entries of the observation (``inputs["value_inputs"]``, e.g. the
    episode's time).
    """

    def __init__(
        self, pi0: nn.Module, std_min: float, std_max: float, detach_critic_input: bool, value_inputs: int = 0
    ) -> None:
        super().__init__()
        self.pi0 = pi0
        config = pi0.config
        hidden = config.dit_config.hidden_size
        self.noise_head = NoiseHead(hidden, config.max_action_dim, std_min, std_max)
        self.value_head = nn.Sequential(
            nn.Linear(hidden + value_inputs, hidden), nn.Tanh(), nn.Linear(hidden, 1)
        )
        self.detach_critic_input = detach_critic_input

    def _prefix(self, inputs: dict[str, torch.Tensor]) -> Any:
        """The VLM's KV cache of ``[image tokens | text]`` (π0's prefix, bidirectional)."""
        model = self.pi0.model
        if inputs["pixel_values"] is not None:
            embeds = model.embed_prefix(inputs["input_ids"], inputs["pixel_values"], inputs["pixel_mask"])
        else:  # no camera: the instruction alone
            embeds = model.vlm.get_input_embeddings()(inputs["input_ids"])
        mask = inputs["attention_mask"]
        return model.vlm(
            inputs_embeds=embeds,
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp_min(0),
            token_type_ids=torch.zeros_like(mask),
            use_cache=True,
        ).past_key_values

    def forward(
        self,
        inputs: dict[str, torch.Tensor],
        steps: int,
        chain: torch.Tensor | None = None,
        noise: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Run the prefix, then ``steps`` denoising steps.

        ``chain`` (``[B, K+1, H, D]``): score that recorded chain (step ``k`` starts from
        ``chain[:, k]``). Else sample one from ``noise`` (``[B, K+1, H, D]``: ``A^0``, then each
        step's standard normal draw; zeros after ``A^0``: the ODE). ``steps=0``: the value only.
        Returns ``value`` ``[B]`` and (``steps > 0``) ``chain``, ``mean`` and ``std`` (``[B, K, H,
        D]``), all float32.
        """
        pi0, state = self.pi0, inputs["state"]
        cache = self._prefix(inputs)
        n, horizon = state.shape[0], pi0.config.chunk_size
        if steps:
            x = (chain if chain is not None else noise)[:, 0].float()
        else:  # the value reads no action: any chain start will do
            x = state.new_zeros(n, horizon, pi0.config.max_action_dim)
        grid = time_grid(max(steps, 1), state.device)
        xs, means, stds, value = [x], [], [], None
        for k in range(max(steps, 1)):
            t = grid[k].expand(n)
            embeds = pi0.embed_action_time(state, x, t)
            h = pi0.model(
                action_embeds=embeds, attention_mask=inputs["attention_mask"], past_key_values=cache
            )
            cache.crop(-embeds.shape[1])  # keep the prefix only: no step attends to another's
            h = h.last_hidden_state
            with torch.autocast(h.device.type, enabled=False):  # heads, mean and chain in float32
                if value is None:
                    feature = h[:, -horizon - 1].float()
                    feature = feature.detach() if self.detach_critic_input else feature
                    feature = torch.cat([feature, inputs["value_inputs"].float()], dim=-1)
                    value = self.value_head(feature).squeeze(-1)
                if not steps:
                    return {"value": value}
                actions = h[:, -horizon:].float()
                velocity = pi0.action_out_proj(actions.to(pi0.action_out_proj.weight.dtype)).float()
                mean = x + (grid[k + 1] - grid[k]) * velocity
                std = self.noise_head(actions)
                x = chain[:, k + 1].float() if chain is not None else mean + std * noise[:, k + 1].float()
            xs.append(x)
            means.append(mean)
            stds.append(std)
        return {
            "value": value,
            "chain": torch.stack(xs, 1),
            "mean": torch.stack(means, 1),
            "std": torch.stack(stds, 1),
        }
