"""TinyVLA, the policy: builds its :class:`~rlinf_lightning.policies.vla.network.VLANet` from a config
(or loads a saved one), lays out the prompt of image, state and instruction, samples an action
chunk (``oft`` or ``autoregressive``) with every row's noise from its own generator, and evaluates
log-probs, entropy and value for PPO. See the package docstring for the recipe."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from rlinf_lightning.policies.lm import enable_gradient_checkpointing
from rlinf_lightning.policies.lora import LoRA, lora_problems
from rlinf_lightning.policies.module import RLModule, count_without_loading, instructions
from rlinf_lightning.policies.vla.network import (
    DECODE_MODES,
    DEFAULT_INSTRUCTION,
    LM_TYPES,
    NUM_BINS,
    PLACEHOLDER,
    VLANet,
    action_to_bins,
    bin_centres,
    build_lm_config,
    build_vla_tokenizer,
)


class TinyVLA(RLModule):
    """A vision-language-action actor-critic over images, proprioception and an instruction.

    Args:
        model_path: a directory written by :meth:`save_pretrained` (``config.json``, ``vla.safetensors``
            for the vision encoder, state projection and value head, and ``lm/``: the LM and its
            tokenizer, loadable on their own with ``from_pretrained``); its architecture replaces
            ``image_size``, ``hidden_size``, ``num_layers``, ``num_heads``, ``lm``,
            ``max_instruction_len`` and ``vision_grid``. ``None`` builds a new model from those.
        image_size: images are resized to ``image_size x image_size`` before the vision encoder.
        hidden_size: the LM's width (the head dimension ``hidden_size / num_heads`` must be even).
        num_layers: decoder layers of the LM.
        num_heads: attention heads of the LM (as many key/value heads).
        lm: ``"qwen2"`` or ``"llama"``: the ``transformers`` config the LM is built from.
        decode: ``"oft"`` (the whole chunk in one pass over placeholder tokens) or
            ``"autoregressive"`` (one action token after another through the KV cache).
        temperature: the action tokens' logits are divided by it when sampling and when computing
            log-probs and entropies (rollout and training see the same distribution).
        lr: AdamW learning rate.
        max_grad_norm: clip the global gradient norm to this before each step (0 disables).
        seed: seeds the initialisation of a new model (the same on every replica).
        default_instruction: the instruction where the observation has none; ``None``: the saved
            model's, else ``"do the task"``.
        max_instruction_len: characters of the instruction the model reads (longer ones are cut);
            the text segment always has this length, so batch shapes never depend on the text.
        vision_grid: visual tokens per side (``vision_grid ** 2`` tokens).
        lora: LoRA adapters on the LM instead of training every weight (see
            :class:`~rlinf_lightning.policies.lora.LoRA`); the vision encoder, state projection and
            value head train in full unless ``lora.train_modules`` says otherwise (add
            ``lm.lm_head`` to train the action head, the tied embedding, in full too).
        gradient_checkpointing: recompute the LM's decoder layers in the backward (less memory).
    """

    def __init__(
        self,
        model_path: str | None = None,
        image_size: int = 64,
        hidden_size: int = 64,
        num_layers: int = 2,
        num_heads: int = 2,
        lm: str = "qwen2",
        decode: str = "oft",
        temperature: float = 1.0,
        lr: float = 1e-4,
        max_grad_norm: float = 1.0,
        seed: int = 0,
        default_instruction: str | None = None,
        max_instruction_len: int = 64,
        vision_grid: int = 4,
        lora: LoRA | None = None,
        gradient_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        self.model_path = model_path
        self.image_size = image_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.lm = lm
        self.decode = decode
        self.temperature = temperature
        self.lr = lr
        self.max_grad_norm = max_grad_norm
        self.seed = seed
        self.default_instruction = default_instruction
        self.max_instruction_len = max_instruction_len
        self.vision_grid = vision_grid
        self.lora = lora
        self.gradient_checkpointing = gradient_checkpointing
        # from the env (configure_spaces) or the saved config; obs_dim (the proprioception size,
        # 0 without one) doubles as "the spaces are set" for EmbodiedTask
        self.obs_dim: int | None = None
        self.action_dim: int | None = None
        self.chunk: int | None = None
        self.model: VLANet | None = None
        self.tokenizer: Any = None
        self._text_cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    # -- configuration --------------------------------------------------------------------------

    def validate_config(self) -> list[tuple[str, str]]:
        """(key, problem) pairs found without loading anything; empty when the config is fine."""
        problems = []
        if self.model_path is not None:
            root = Path(self.model_path)
            if not (root / "config.json").is_file() or not (root / "lm" / "config.json").is_file():
                problems.append(
                    ("model_path", f"{self.model_path!r} is not a TinyVLA directory (config.json and "
                     "lm/config.json); write one with TinyVLA.save_pretrained()")
                )  # fmt: skip
        if self.lm not in LM_TYPES:
            problems.append(("lm", f"must be one of {', '.join(LM_TYPES)}, got {self.lm!r}"))
        if self.decode not in DECODE_MODES:
            problems.append(("decode", f"must be one of {', '.join(DECODE_MODES)}, got {self.decode!r}"))
        if not self.temperature > 0:
            problems.append(("temperature", f"must be > 0, got {self.temperature}"))
        if not self.lr > 0:
            problems.append(("lr", f"must be > 0, got {self.lr}"))
        for key, low in (("image_size", 16), ("hidden_size", 2), ("num_layers", 1), ("num_heads", 1),
                         ("max_instruction_len", 1), ("vision_grid", 1)):  # fmt: skip
            if getattr(self, key) < low:
                problems.append((key, f"must be >= {low}, got {getattr(self, key)}"))
        if self.num_heads >= 1 and (
            self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 2
        ):
            problems.append(
                ("hidden_size", f"{self.hidden_size} / num_heads {self.num_heads} must be an even head size")
            )
        problems += lora_problems(self)
        return problems

    def _load_config(self) -> None:
        config = json.loads((Path(self.model_path) / "config.json").read_text())
        for key in ("image_size", "hidden_size", "num_layers", "num_heads", "lm", "max_instruction_len",
                    "vision_grid", "action_dim", "chunk"):  # fmt: skip
            setattr(self, key, config[key])
        self.obs_dim = config["state_dim"]
        if self.default_instruction is None:
            self.default_instruction = config["default_instruction"]

    def configure_spaces(
        self, obs: TensorDict, action_shape: tuple[int, ...], action_choices: tuple[int, ...] | None = None
    ) -> None:
        """Take the proprioception size from an example observation batch and ``(chunk,
        action_dim)`` from the action shape (a 1-d shape is one step); for a saved model, check
        that they match it. Its actions are continuous: discrete ones (``action_choices``) are refused."""
        if action_choices is not None:
            raise ValueError("TinyVLA emits continuous actions, not discrete ones")
        if "rgb" not in obs.keys():
            raise ValueError(f"TinyVLA needs an 'rgb' image observation; the env gives {sorted(obs.keys())}")
        state = obs.get("state") if "state" in obs.keys() else None
        state_dim = int(state.shape[-1]) if isinstance(state, torch.Tensor) else 0
        shape = tuple(int(s) for s in action_shape)
        chunk, action_dim = (1, shape[0]) if len(shape) == 1 else (shape[0], math.prod(shape[1:]))
        if self.model_path is not None:
            self._load_config()
            if (state_dim, chunk, action_dim) != (self.obs_dim, self.chunk, self.action_dim):
                raise ValueError(
                    f"{self.model_path}: the model takes a {self.obs_dim}-d state and chunks of "
                    f"{self.chunk} x {self.action_dim} actions, the env gives a {state_dim}-d state and "
                    f"{chunk} x {action_dim}"
                )
        self.obs_dim, self.chunk, self.action_dim = state_dim, chunk, action_dim

    @property
    def prompt_len(self) -> int:
        """Tokens before the first action token: visual, state (if any), ``<s>`` text ``</s>``."""
        return self.vision_grid**2 + (1 if self.obs_dim else 0) + self.max_instruction_len + 2

    def configure_model(self) -> None:
        """Build a new model under ``seed`` (every replica draws the same weights) or load the
        saved one; the tokenizer is built (or loaded) alongside."""
        if self.model is not None:
            return
        if self.model_path is not None and self.chunk is None:
            self._load_config()
        if self.chunk is None or self.action_dim is None or self.obs_dim is None:
            raise ValueError("TinyVLA needs its sizes: call configure_spaces(obs, action_shape) first")
        if self.default_instruction is None:
            self.default_instruction = DEFAULT_INSTRUCTION
        from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            if self.model_path is None:
                self.tokenizer = build_vla_tokenizer()
                positions = max(1024, self.prompt_len + self.chunk * self.action_dim)
                config = build_lm_config(
                    self.lm, len(self.tokenizer), self.hidden_size, self.num_layers, self.num_heads, positions
                )
                lm = AutoModelForCausalLM.from_config(config)
            else:
                lm_dir = Path(self.model_path) / "lm"
                self.tokenizer = PreTrainedTokenizerFast.from_pretrained(lm_dir)
                lm = AutoModelForCausalLM.from_pretrained(lm_dir, dtype=torch.float32)
            model = VLANet(lm, self.hidden_size, self.vision_grid, self.image_size, self.obs_dim)
        if self.model_path is not None:
            from safetensors.torch import load_file

            missing, unexpected = model.load_state_dict(
                load_file(str(Path(self.model_path) / "vla.safetensors")), strict=False
            )
            missing = [k for k in missing if not k.startswith("lm.")]  # the LM came from lm/
            if missing or unexpected:
                raise ValueError(
                    f"{self.model_path}/vla.safetensors: missing {missing}, unexpected {unexpected}"
                )
        vocab = lm.get_output_embeddings().weight.shape[0]
        if (
            len(self.tokenizer) != vocab
            or self.tokenizer.convert_tokens_to_ids("<bin_0>") != vocab - NUM_BINS
        ):
            raise ValueError(
                f"the tokenizer ({len(self.tokenizer)} ids) does not put <bin_0> at {vocab} - 256"
            )
        if self.gradient_checkpointing:
            enable_gradient_checkpointing(lm)
        self.model = model.eval()  # no dropout anywhere: train and eval modes compute the same
        self._ids = {
            name: self.tokenizer.convert_tokens_to_ids(tok)
            for name, tok in (("pad", "<pad>"), ("bos", "<s>"), ("eos", "</s>"), ("act", PLACEHOLDER))
        }
        self._first_bin = vocab - NUM_BINS

    def parameter_count(self) -> int | None:
        """Counted on the meta device from the sizes; a saved model's config.json is read, its
        weights are not (the generic count would load them)."""
        return count_without_loading(self)

    def meta_model(self) -> None:
        """The saved model's architecture from its config.json, built (not loaded)."""
        if self.model_path is not None:
            self._load_config()
            self.model_path = None
        self.configure_model()

    def lora_train_modules(self) -> list[str]:
        """Trained in full beside the LM's adapters: the parts with no pre-trained weights."""
        return ["vision", "value_head"] + (["state_proj"] if self.obs_dim else [])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        assert self.model is not None, "configure_model() first"
        trainable = [p for p in self.model.parameters() if p.requires_grad]  # LoRA: adapters and heads
        return torch.optim.AdamW(trainable, lr=self.lr, weight_decay=0.0, fused=True)

    # -- observations ---------------------------------------------------------------------------

    def _text(self, texts: list[str], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``<s> text </s>`` left-padded to ``max_instruction_len + 2`` ids, and its mask."""
        rows = []
        for t in texts:
            row = self._text_cache.get(t)
            if row is None:
                ids = self.tokenizer(t, add_special_tokens=False)["input_ids"][: self.max_instruction_len]
                ids = [self._ids["bos"], *ids, self._ids["eos"]]
                pad = self.max_instruction_len + 2 - len(ids)
                row = (torch.tensor([self._ids["pad"]] * pad + ids), torch.tensor([0] * pad + [1] * len(ids)))
                if len(self._text_cache) >= 4096:  # a bounded cache: instructions rarely vary much
                    self._text_cache.clear()
                self._text_cache[t] = row
            rows.append(row)
        return torch.stack([r[0] for r in rows]).to(device), torch.stack([r[1] for r in rows]).to(device)

    def _prompt(self, obs: TensorDict) -> dict[str, torch.Tensor]:
        """The model's prompt inputs for ``obs``: rgb, state, text ids and the prompt's mask."""
        device = self.model.vision.position.device
        n = obs.batch_size[0]
        text_ids, text_mask = self._text(instructions(obs, n, self.default_instruction), device)
        front = self.vision_grid**2 + (1 if self.obs_dim else 0)
        mask = torch.cat([torch.ones(n, front, dtype=text_mask.dtype, device=device), text_mask], dim=1)
        state = obs["state"].reshape(n, -1).to(device) if self.obs_dim else None
        return {"rgb": obs["rgb"].to(device), "state": state, "text_ids": text_ids, "mask": mask}

    # -- acting and evaluating ------------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        """Action tokens per observation: ``chunk * action_dim`` (step-major)."""
        return self.chunk * self.action_dim

    def _gumbel(self, n: int, generators: list[torch.Generator] | None, device: torch.device) -> torch.Tensor:
        """Gumbel noise ``[n, tokens, 256]``; row ``i``'s from ``generators[i]`` alone."""
        shape = (self.num_tokens, NUM_BINS)
        if generators is None:
            u = torch.rand((n, *shape))
        else:
            if len(generators) != n:
                raise ValueError(f"{len(generators)} generators for a batch of {n}")
            u = torch.stack([torch.rand(shape, generator=g) for g in generators])
        u = u.clamp_min(torch.finfo(u.dtype).tiny)
        return (-torch.log(-torch.log(u))).to(device)

    def _logits(self, prompt: dict[str, torch.Tensor], bins: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """Tempered logits ``[B, tokens, 256]`` and values of one full pass; ``bins`` (``[B,
        tokens]``) are fed back in autoregressive mode (teacher forcing)."""
        n, device = prompt["mask"].shape[0], prompt["mask"].device
        if self.decode == "oft":
            tail = torch.full((n, self.num_tokens), self._ids["act"], device=device)
        else:
            tail = bins[:, :-1] + self._first_bin
        mask = torch.cat([prompt["mask"], torch.ones_like(tail)], dim=1)
        logits, value, _ = self.model(tail, mask, prompt["rgb"], prompt["state"], prompt["text_ids"])
        if self.decode == "oft":
            logits = logits[:, 1:]  # each placeholder position gives its own token's distribution
        return logits / self.temperature, value

    def _decode(
        self, prompt: dict[str, torch.Tensor], noise: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Autoregressive decoding through the KV cache: ``(bins, tempered logits, value)``."""
        n, device = prompt["mask"].shape[0], prompt["mask"].device
        empty = torch.zeros(n, 0, dtype=torch.long, device=device)
        logits, value, cache = self.model(
            empty, prompt["mask"], prompt["rgb"], prompt["state"], prompt["text_ids"], use_cache=True
        )
        mask, steps, bins = prompt["mask"], [], []
        for k in range(self.num_tokens):
            step = logits[:, -1] / self.temperature
            b = _pick(step, None if noise is None else noise[:, k])
            steps.append(step)
            bins.append(b)
            if k + 1 < self.num_tokens:
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                logits, _, cache = self.model(
                    (b + self._first_bin)[:, None], mask, cache=cache, use_cache=True
                )
        return torch.stack(bins, dim=1), torch.stack(steps, dim=1), value

    @torch.no_grad()
    def act(
        self, obs: TensorDict, deterministic: bool = False, generators: list[torch.Generator] | None = None
    ) -> TensorDict:
        """Actions ``[B, chunk * action_dim]`` (bin centres, step-major), their log-probs (summed
        over the tokens, at ``temperature``) and the values of ``obs``. Sampling is Gumbel-max with
        noise drawn from ``generators[i]`` for row ``i``; ``deterministic`` takes each token's
        most likely bin. No gradients: training recomputes everything in :meth:`evaluate`."""
        prompt = self._prompt(obs)
        n = prompt["mask"].shape[0]
        noise = None if deterministic else self._gumbel(n, generators, prompt["mask"].device)
        if self.decode == "oft":
            logits, value = self._logits(prompt, None)
            bins = _pick(logits, noise)
        else:
            bins, logits, value = self._decode(prompt, noise)
        logprob = torch.log_softmax(logits, dim=-1).gather(-1, bins[..., None]).squeeze(-1).sum(-1)
        return TensorDict(
            {"action": bin_centres(bins.device)[bins], "logprob": logprob, "value": value}, batch_size=[n]
        )

    @torch.no_grad()
    def value(self, obs: TensorDict) -> torch.Tensor:
        """The value of ``obs`` from one pass over the prompt alone (the critic reads no action)."""
        prompt = self._prompt(obs)
        empty = torch.zeros(prompt["mask"].shape[0], 0, dtype=torch.long, device=prompt["mask"].device)
        return self.model(empty, prompt["mask"], prompt["rgb"], prompt["state"], prompt["text_ids"])[1]

    def evaluate(self, batch: TensorDict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(log-prob of batch["action"], entropy, value)`` under the current parameters: the
        actions are mapped back to their bins and scored in one pass (OFT: the placeholders;
        autoregressive: the bins fed back, teacher-forced)."""
        prompt = self._prompt(batch["obs"])
        n = prompt["mask"].shape[0]
        bins = action_to_bins(batch["action"].reshape(n, self.num_tokens).to(prompt["mask"].device))
        logits, value = self._logits(prompt, bins)
        logp = torch.log_softmax(logits, dim=-1)
        entropy = -(logp.exp() * logp).sum(-1).sum(-1)
        return logp.gather(-1, bins[..., None]).squeeze(-1).sum(-1), entropy, value

    # -- saving ---------------------------------------------------------------------------------

    def save_pretrained(self, path: str | Path) -> Path:
        """Write ``config.json`` (architecture and sizes), ``vla.safetensors`` (vision encoder,
        state projection, value head) and ``lm/`` (the LM and the tokenizer, ``save_pretrained``
        by ``transformers``) to ``path``."""
        from safetensors.torch import save_file

        assert self.model is not None, "configure_model() first"
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        config = {
            "kind": "tiny_vla", "image_size": self.image_size, "hidden_size": self.hidden_size,
            "num_layers": self.num_layers, "num_heads": self.num_heads, "lm": self.lm,
            "max_instruction_len": self.max_instruction_len, "vision_grid": self.vision_grid,
            "state_dim": self.obs_dim, "action_dim": self.action_dim, "chunk": self.chunk,
            "default_instruction": self.default_instruction, "num_bins": NUM_BINS,
        }  # fmt: skip
        (path / "config.json").write_text(json.dumps(config, indent=1))
        heads = {
            k: v.detach().contiguous().cpu()
            for k, v in self.model.state_dict().items()
            if not k.startswith("lm.")
        }
        save_file(heads, str(path / "vla.safetensors"))
        self.model.lm.save_pretrained(path / "lm")
        self.tokenizer.save_pretrained(path / "lm")
        return path


def _pick(logits: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
    """Gumbel-max sample (argmax of logits + Gumbel noise), or the argmax without noise."""
    return (logits if noise is None else logits + noise).argmax(-1)
