"""TinyVLA's network: the 256 action bins over ``[-1, 1]`` and their vocabulary ids, the character
tokenizer grown by them, the LM's config, the conv vision encoder, and :class:`VLANet` (everything
that trains: what the engines step, shard and sync). See the package docstring for the recipe."""

from __future__ import annotations

import math
import tempfile
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

#: Action bins per dimension; they are the top ``NUM_BINS`` ids of the vocabulary.
NUM_BINS = 256
#: Vocabulary size of a new model: 4 specials and 96 characters (ids 0-99), the OFT placeholder
#: ``<act>`` (100), reserved ids (101-255), the action bins ``<bin_0>`` ... ``<bin_255>`` (256-511).
VOCAB_SIZE = 512
PLACEHOLDER = "<act>"
DEFAULT_INSTRUCTION = "do the task"
DECODE_MODES = ("oft", "autoregressive")
LM_TYPES = ("qwen2", "llama")
VISION_WIDTH = 64  # channels of the conv net's last layer, before the projection to the LM


def bin_centres(device: torch.device | str | None = None) -> torch.Tensor:
    """The continuous value of each of the 256 bins: ``linspace(-1, 1, 256)`` (float32)."""
    return torch.linspace(-1.0, 1.0, NUM_BINS, device=device)


def action_to_bins(action: torch.Tensor) -> torch.Tensor:
    """The bin of each action value: ``round((a + 1) / 2 * 255)``, exact for every bin centre
    (checked for all 256), and the nearest bin for any other value in ``[-1, 1]``."""
    return (
        ((action.float().clamp(-1.0, 1.0) + 1.0) * ((NUM_BINS - 1) / 2)).round().long().clamp(0, NUM_BINS - 1)
    )


def build_vla_tokenizer(vocab_size: int = VOCAB_SIZE) -> Any:
    """The character tokenizer of :func:`~rlinf_lightning.assets.build_char_tokenizer` (ids 0-99)
    grown to ``vocab_size`` ids: the placeholder ``<act>``, reserved ids, and the 256 action bins
    ``<bin_b>`` as the top ids. All added tokens are special, so text is never split into them."""
    from transformers import PreTrainedTokenizerFast

    from rlinf_lightning.assets import build_char_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        build_char_tokenizer(tmp)
        tok = PreTrainedTokenizerFast.from_pretrained(tmp)
    reserved = vocab_size - NUM_BINS - len(tok) - 1
    if reserved < 0:
        raise ValueError(
            f"a vocabulary of {vocab_size} cannot hold {len(tok)} characters, <act> and 256 bins"
        )
    added = (
        [PLACEHOLDER] + [f"<reserved_{i}>" for i in range(reserved)] + [f"<bin_{b}>" for b in range(NUM_BINS)]
    )
    tok.add_tokens(added, special_tokens=True)
    assert len(tok) == vocab_size and tok.convert_tokens_to_ids("<bin_0>") == vocab_size - NUM_BINS
    return tok


def build_lm_config(
    lm: str, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int, max_positions: int
) -> Any:
    """A Qwen2 or Llama config of the given size (tied embeddings, no dropout, float32)."""
    from transformers import LlamaConfig, Qwen2Config

    config_class = {"qwen2": Qwen2Config, "llama": LlamaConfig}[lm]
    return config_class(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        dtype="float32",
    )


class VisionEncoder(nn.Module):
    """uint8 RGB ``[B, H, W, 3]`` -> ``[B, grid * grid, hidden]`` visual tokens.

    Three strided convolutions (64x64 -> 4x4 at ``VISION_WIDTH`` channels), an adaptive average
    pool to ``grid x grid`` (so the number of tokens does not depend on the image size), a learned
    position embedding per cell, and a LayerNorm + linear projection to the LM's width (the
    "projector" of a VLA).
    """

    def __init__(self, hidden_size: int, grid: int, image_size: int) -> None:
        super().__init__()
        self.image_size = image_size
        self.convs = nn.Sequential(
            nn.Conv2d(3, 16, kernel_size=4, stride=4),
            nn.GELU(),
            nn.Conv2d(16, 32, kernel_size=3, stride=2, padding=1),
            nn.GELU(),
            nn.Conv2d(32, VISION_WIDTH, kernel_size=3, stride=2, padding=1),
            nn.GELU(),
        )
        self.pool = nn.AdaptiveAvgPool2d(grid)
        self.position = nn.Parameter(torch.randn(grid * grid, VISION_WIDTH) * 0.02)
        self.proj = nn.Sequential(nn.LayerNorm(VISION_WIDTH), nn.Linear(VISION_WIDTH, hidden_size))

    def forward(self, rgb: torch.Tensor) -> torch.Tensor:
        x = rgb.permute(0, 3, 1, 2).to(self.position.dtype) / 127.5 - 1.0
        if tuple(x.shape[-2:]) != (self.image_size, self.image_size):
            x = F.interpolate(
                x, size=(self.image_size,) * 2, mode="bilinear", align_corners=False, antialias=True
            )
        x = self.pool(self.convs(x)).flatten(2).transpose(1, 2)
        return self.proj(x + self.position)


class VLANet(nn.Module):
    """Everything that trains (what the engines step and sync): vision encoder, state projection,
    causal LM and value head. All computation goes through :meth:`forward`, so a sharded root
    (FSDP2's ``fully_shard(policy.model)``) gathers its parameters around every call."""

    def __init__(self, lm: nn.Module, hidden_size: int, grid: int, image_size: int, state_dim: int) -> None:
        super().__init__()
        self.vision = VisionEncoder(hidden_size, grid, image_size)
        self.state_proj = nn.Linear(state_dim, hidden_size) if state_dim > 0 else None
        self.lm = lm
        self.value_head = nn.Sequential(
            _orthogonal(nn.Linear(hidden_size, hidden_size), math.sqrt(2)),
            nn.Tanh(),
            _orthogonal(nn.Linear(hidden_size, 1), 1.0),
        )

    @property
    def model(self) -> nn.Module:
        """The LM's decoder (``model.model.layers`` is the Hugging Face layout the FSDP engine
        shards layer by layer); not a registered child, so no parameter is named twice."""
        return self.lm.base_model

    def forward(
        self,
        tail_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        rgb: torch.Tensor | None = None,
        state: torch.Tensor | None = None,
        text_ids: torch.Tensor | None = None,
        cache: Any = None,
        use_cache: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
        """Run ``[prompt | tail]`` (with ``rgb``: a new prompt of image, state and text) or just
        ``tail`` after ``cache`` through the LM.

        ``attention_mask`` covers the cache and the new tokens (0 at pads); positions count the
        unmasked tokens. Returns the float32 logits over the 256 action ids ``[B, n, 256]`` at the
        last prompt position and every tail position (only the tail's without a prompt), the value
        at the last prompt position (``None`` without a prompt), and the KV cache (``use_cache``).
        """
        embed = self.lm.get_input_embeddings()
        parts = []
        if rgb is not None:
            parts.append(self.vision(rgb))
            if self.state_proj is not None:
                parts.append(self.state_proj(state.to(parts[0].dtype))[:, None])
            parts.append(embed(text_ids))
        prompt_len = sum(p.shape[1] for p in parts)
        x = torch.cat([*parts, embed(tail_ids)], dim=1)
        positions = (attention_mask.cumsum(-1) - 1).clamp_min(0)[:, -x.shape[1] :]
        out = self.lm.base_model(
            inputs_embeds=x,
            attention_mask=attention_mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=use_cache,
        )
        hidden = out.last_hidden_state
        value = None
        if rgb is not None:
            hidden = hidden[:, prompt_len - 1 :]
            value = self.value_head(hidden[:, 0]).squeeze(-1).float()
        weight = self.lm.get_output_embeddings().weight[-NUM_BINS:]
        # the action head in float32 even under bf16 autocast: log-probs summed over a chunk's
        # tokens (about -30) would otherwise keep bf16's 3 digits, and PPO's ratio their error
        with torch.autocast(hidden.device.type, enabled=False):
            logits = F.linear(hidden.float(), weight.float())
        return logits, value, out.past_key_values if use_cache else None


def _orthogonal(layer: nn.Linear, gain: float) -> nn.Linear:
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer
