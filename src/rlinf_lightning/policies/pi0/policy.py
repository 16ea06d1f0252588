"""Pi0Policy: π0 (``transformers``' ``PI0ForConditionalGeneration``) as an embodied actor-critic.

It holds the π0 a checkpoint directory loads (``from_pretrained``: a converted ``pi0_base`` on a
GPU, :func:`~rlinf_lightning.assets.build_tiny_pi0`'s on a CPU) and adds only what RL needs:

- **Inputs.** The observation ``TensorDict`` becomes π0's: each camera in ``image_keys`` (uint8
  ``[H, W, 3]``) resized to SigLIP's size and scaled to ``[-1, 1]`` (π0's image processor), one
  image-token block per camera; the ``instruction`` (or ``default_instruction``) as ``<s> text``
  right-padded to ``max_instruction_len + 1`` ids (fixed shapes); ``state_keys`` concatenated,
  standardised with the checkpoint's ``norm_stats.json`` (:mod:`~rlinf_lightning.policies.pi0.norm`,
  written by ``rlinf sft``) and zero-padded to ``max_state_dim``.
- **Actions.** A chunk is the first ``chunk`` of π0's ``chunk_size`` steps and the env's first
  ``action_dim`` of its ``max_action_dim`` entries, mapped back from the standardised actions π0
  denoises (the same statistics), executed open-loop as TinyVLA's OFT chunks.
- **Log-probs** by Flow-Noise (:mod:`~rlinf_lightning.policies.pi0.flow`): ``act`` samples the
  denoising chain with per-step Gaussians drawn from each row's generator and returns it
  (``chain``, a :attr:`replay_keys` entry the workflow carries to the actor); ``evaluate`` scores
  that recorded chain under the current weights.
- **Critic**: a value head on the observation's features (see :class:`Pi0Net`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tensordict import TensorDict

from rlinf_lightning.errors import ConfigError
from rlinf_lightning.policies.lora import LoRA, lora_problems
from rlinf_lightning.policies.module import RLModule, instructions
from rlinf_lightning.policies.pi0.directory import HEADS_FILE, directory_problems, norm_size_problem
from rlinf_lightning.policies.pi0.flow import LOGPROB_LEVELS, NOISY_STEPS, flow_noise_logprob
from rlinf_lightning.policies.pi0.net import Pi0Net
from rlinf_lightning.policies.pi0.norm import NormStats

DEFAULT_INSTRUCTION = "do the task"


def read_pi0_config(model_path: str) -> dict[str, Any]:
    """``config.json`` of a π0 directory; ``ValueError`` saying why ``model_path`` is not one."""
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise ValueError(f"{model_path!r} has no config.json (write one with PI0ForConditionalGeneration"
                         ".save_pretrained)")  # fmt: skip
    config = json.loads(path.read_text())
    if config.get("model_type") != "pi0":
        raise ValueError(f"{model_path!r} is not a π0 checkpoint: its config.json has model_type "
                         f"{config.get('model_type')!r}, not 'pi0'")  # fmt: skip
    return config


class Pi0Policy(RLModule):
    """π0 with Flow-Noise log-probs and a value head, for PPO and embodied GRPO.

    Args:
        model_path: a ``PI0ForConditionalGeneration.save_pretrained`` directory with its tokenizer
            (``tokenizer.json``); a ``rl_heads.safetensors`` there (written by
            :meth:`save_pretrained`) restores the noise and value heads, else they start new; a
            ``norm_stats.json`` there standardises the state and the actions (required: see
            ``normalize``).
        num_denoise_steps: Euler steps ``K`` of the chain (πRL: 4).
        noise_std_range: ``[σ_min, σ_max]`` of the learned per-step noise (πRL: 0.08, 0.16).
        logprob_level: what PPO's ratio is taken of. ``"entry"`` (RLinf's default,
            ``logprob_type: token_level``): a log-prob per executed action entry, the mean of its
            ``K + 1`` chain terms (its last step's term with ``noisy_steps="last"``), so each
            entry is clipped on its own; ``"chunk"``: the chain's
            joint log-likelihood, one ratio per chunk (its ``chunk x action_dim x K`` Gaussian
            terms all move it, so the trust region binds after tiny moves of each entry).
        detach_critic_input: the value loss does not train π0 through the critic's features (πRL's
            ManiSkill setting).
        chain_start: where a sampled chain starts: ``"noise"``, π0's ``A^0 ~ N(0, I)``;
            ``"mean"``, ``A^0 = 0`` (the deterministic policy's start), so all exploration is the
            per-step noise, which the log-prob credits (``A^0``'s term is a constant of it).
        noisy_steps: which denoising steps draw noise: ``"all"`` (πRL's Flow-Noise, the chain's
            joint likelihood) or ``"last"``: the chain follows π0's ODE and only its last step
            draws, so the policy is a Gaussian around the deterministic action that evaluation
            runs, and :meth:`evaluate` recomputes that ODE under the current weights (the exact
            marginal log-prob of the executed chunk, its gradient through all ``K`` steps).
        value_keys: observation entries the value head reads beside π0's feature (the critic's
            privileged inputs; ``["time"]`` with ``task.time_aware``: the return left depends on
            the time left, which π0's state does not show).
        train_expert_only: freeze π0's PaliGemma (vision tower, projector, language model); the
            action expert, its projections and the heads train (RLinf's ``train_expert_only``).
            Without a camera the prefix is the same for every observation, so the language
            model's gradient carries no state-dependent signal, only moves every action at once.
        lr: AdamW learning rate of π0 and the noise head.
        value_lr: the value head's learning rate (``None``: ``lr``); πRL trains it 20x faster.
        max_grad_norm: clip the global gradient norm to this before each step (0 disables).
        seed: seeds the new heads (the same on every replica).
        default_instruction: the instruction where the observation has none.
        max_instruction_len: instruction tokens read (longer ones are cut; shorter ones padded).
        image_keys: observation entries that are camera images (uint8 ``[H, W, 3]``), in order;
            ``[]``: no camera (the prefix is the instruction alone).
        state_keys: observation entries concatenated into π0's state (proprioception).
        action_dim: the env action size the checkpoint was trained for (``None``: the env's).
        lora: LoRA adapters instead of full fine-tuning; targets may be module names (``q_proj``:
            every one) or patterns over full names (``pi0.model.dit.*_proj``: the action expert
            only). The noise and value heads train in full.
        normalize: standardise the state and the actions with ``model_path``'s
            ``norm_stats.json``, which must be there and fit the env (``rlinf sft`` writes it);
            ``false``: run on raw states and actions (a π0 that was never fitted to demonstrations,
            e.g. ``rlinf prepare``'s tiny one).
    """

    #: what ``act`` returns that ``evaluate`` reads back: the denoising chain ``[K+1, H, D]``
    replay_keys = ("chain",)

    def __init__(
        self,
        model_path: str,
        num_denoise_steps: int = 4,
        noise_std_range: tuple[float, float] = (0.08, 0.16),
        logprob_level: str = "entry",
        chain_start: str = "noise",
        noisy_steps: str = "all",
        detach_critic_input: bool = True,
        value_keys: tuple[str, ...] = (),
        train_expert_only: bool = False,
        lr: float = 1e-4,
        value_lr: float | None = None,
        max_grad_norm: float = 1.0,
        seed: int = 0,
        default_instruction: str = DEFAULT_INSTRUCTION,
        max_instruction_len: int = 48,
        image_keys: tuple[str, ...] = ("rgb",),
        state_keys: tuple[str, ...] = ("state",),
        action_dim: int | None = None,
        lora: LoRA | None = None,
        normalize: bool = True,
    ) -> None:
        super().__init__()
        self.model_path = model_path
        self.num_denoise_steps = num_denoise_steps
        self.noise_std_range = tuple(noise_std_range)
        self.logprob_level, self.chain_start, self.noisy_steps = logprob_level, chain_start, noisy_steps
        self.detach_critic_input = detach_critic_input
        self.value_keys, self._value_dim = list(value_keys), 0
        self.train_expert_only = train_expert_only
        self.lr, self.value_lr, self.max_grad_norm, self.seed = lr, value_lr, max_grad_norm, seed
        self.default_instruction = default_instruction
        self.max_instruction_len = max_instruction_len
        self.image_keys, self.state_keys = list(image_keys), list(state_keys)
        self.action_dim = action_dim
        self.lora = lora
        self.normalize = normalize
        self.chunk: int | None = None  # from the env (configure_spaces)
        self.obs_dim: int | None = None
        self.model: Pi0Net | None = None
        self.tokenizer: Any = None
        self.norm: NormStats | None = None  # the checkpoint's norm_stats.json

    # -- configuration --------------------------------------------------------------------------

    def validate_config(self) -> list[tuple[str, str]]:
        """(key, problem) pairs found without loading any weight."""
        problems = []
        try:
            read_pi0_config(self.model_path)
        except ValueError as exc:
            problems.append(("model_path", str(exc)))
        else:
            problems += [("model_path", p) for p in directory_problems(self.model_path, self.normalize)]
        if self.num_denoise_steps < 1:
            problems.append(("num_denoise_steps", f"must be >= 1, got {self.num_denoise_steps}"))
        low, high = (list(self.noise_std_range) + [0, 0])[:2]
        if len(self.noise_std_range) != 2 or not 0 < low <= high:
            problems.append(
                ("noise_std_range", f"must be [min, max] with 0 < min <= max, got {self.noise_std_range}")
            )
        if self.chain_start not in ("noise", "mean"):
            problems.append(("chain_start", f"must be noise or mean, got {self.chain_start!r}"))
        if self.noisy_steps not in NOISY_STEPS:
            problems.append(("noisy_steps", f"must be one of {NOISY_STEPS}, got {self.noisy_steps!r}"))
        if self.logprob_level not in LOGPROB_LEVELS:
            problems.append(("logprob_level", f"must be one of {LOGPROB_LEVELS}, got {self.logprob_level!r}"))
        for key in ("lr", "value_lr"):
            if getattr(self, key) is not None and not getattr(self, key) > 0:
                problems.append((key, f"must be > 0, got {getattr(self, key)}"))
        if self.max_instruction_len < 1:
            problems.append(("max_instruction_len", f"must be >= 1, got {self.max_instruction_len}"))
        if not self.state_keys:
            problems.append(("state_keys", "must name at least one observation entry (π0 reads a state)"))
        if not problems:
            problems += lora_problems(self)
        return problems

    def configure_spaces(
        self, obs: TensorDict, action_shape: tuple[int, ...], action_choices: tuple[int, ...] | None = None
    ) -> None:
        """Take ``(chunk, action_dim)`` from the action shape and the state size from ``obs``, and
        check them against the checkpoint's π0 (``ConfigError`` naming the key; ``ValueError`` for
        an action space π0 does not serve)."""
        if action_choices is not None:
            raise ValueError("π0 emits continuous actions, not discrete ones")
        config = read_pi0_config(self.model_path)
        shape = tuple(int(s) for s in action_shape)
        chunk, action_dim = (
            (1, shape[0]) if len(shape) == 1 else (shape[0], int(torch.Size(shape[1:]).numel()))
        )
        keys = sorted(obs.keys())
        for key in (*self.image_keys, *self.state_keys, *self.value_keys):
            if key not in keys:
                field = next(f for f in ("image_keys", "state_keys", "value_keys") if key in getattr(self, f))
                why = f"the env's observation has no {key!r} (it has {keys})"
                raise ConfigError([(f"policy.{field}", why)])
        state_dim, self._value_dim = (
            sum(obs[k].reshape(obs.batch_size[0], -1).shape[-1] for k in keys)
            for keys in (self.state_keys, self.value_keys)
        )
        checks = (
            (self.action_dim is not None and action_dim != self.action_dim, "policy.action_dim",
             f"the checkpoint acts in {self.action_dim} dimensions, the env's actions have {action_dim}"),
            (action_dim > config["max_action_dim"], "policy.model_path",
             f"π0's max_action_dim {config['max_action_dim']} < the env's {action_dim} action dimensions"),
            (chunk > config["chunk_size"], "task.chunk",
             f"{chunk} steps per chunk, but π0's chunk_size is {config['chunk_size']}"),
            (state_dim > config["max_state_dim"], "policy.state_keys",
             f"{self.state_keys} make a {state_dim}-d state, over max_state_dim {config['max_state_dim']}"),
        )  # fmt: skip
        if problems := [(key, why) for bad, key, why in checks if bad]:
            raise ConfigError(problems[:1])
        if self.normalize and (why := norm_size_problem(self.model_path, state_dim, action_dim)):
            raise ConfigError([("policy.model_path", why)])
        self.chunk, self.action_dim, self.obs_dim = chunk, action_dim, state_dim

    def configure_model(self) -> None:
        """Load π0 and its tokenizer from ``model_path``; the heads from ``rl_heads.safetensors``
        when saved there, else new under ``seed``."""
        if self.model is not None:
            return
        if self.chunk is None:
            raise ValueError("Pi0Policy needs its sizes: call configure_spaces(obs, action_shape) first")
        from transformers import PI0Config, PI0ForConditionalGeneration, PreTrainedTokenizerFast

        self.tokenizer = PreTrainedTokenizerFast.from_pretrained(self.model_path)
        self.norm = NormStats.load(self.model_path) if self.normalize else None  # sizes: configure_spaces
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            if torch.empty(0).device.type == "meta":  # parameter_count / LoRA probes: no weights read
                pi0 = PI0ForConditionalGeneration(PI0Config.from_pretrained(self.model_path))
            else:
                pi0 = PI0ForConditionalGeneration.from_pretrained(self.model_path, dtype=torch.float32)
            low, high = self.noise_std_range
            model = Pi0Net(pi0, low, high, self.detach_critic_input, self._value_dim)
        if self.train_expert_only:
            model.pi0.model.vlm.requires_grad_(False)
        heads = Path(self.model_path) / HEADS_FILE
        if heads.is_file() and torch.empty(0).device.type != "meta":
            from safetensors.torch import load_file

            model.load_state_dict(load_file(str(heads)), strict=False)
        self.model = model.eval()  # π0 has no dropout at rest: train and eval compute the same
        vision = pi0.config.vlm_config.vision_config
        self._image_size = vision.image_size
        self._image_tokens = (vision.image_size // vision.patch_size) ** 2
        self._image_token = pi0.config.vlm_config.image_token_id
        executed = torch.zeros(pi0.config.chunk_size, pi0.config.max_action_dim)
        executed[: self.chunk, : self.action_dim] = 1.0
        self._executed = executed

    def lora_train_modules(self) -> list[str]:
        """Trained in full beside the adapters: the heads π0 has no pre-trained weights for."""
        return ["noise_head", "value_head"]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        assert self.model is not None, "configure_model() first"
        value = [p for p in self.model.value_head.parameters() if p.requires_grad]
        ids = {id(p) for p in value}
        rest = [p for p in self.model.parameters() if p.requires_grad and id(p) not in ids]
        groups = [{"params": rest, "lr": self.lr}, {"params": value, "lr": self.value_lr or self.lr}]
        return torch.optim.AdamW(groups, lr=self.lr, weight_decay=0.0)

    # -- observations ---------------------------------------------------------------------------

    def inputs(self, obs: TensorDict) -> dict[str, torch.Tensor | None]:
        """π0's inputs for ``obs``: ``input_ids`` and ``attention_mask`` of the prefix
        ``[image tokens | <s> instruction pads]``, ``pixel_values`` ``[B, cams, 3, S, S]`` (``None``
        without cameras), ``pixel_mask``, the padded ``state`` and the critic's ``value_inputs``."""
        device = self.model.pi0.action_out_proj.weight.device
        n = obs.batch_size[0]
        tok, width = self.tokenizer, self.max_instruction_len + 1
        rows = []
        for text in instructions(obs, n, self.default_instruction):
            ids = [
                tok.bos_token_id,
                *tok(text, add_special_tokens=False)["input_ids"][: self.max_instruction_len],
            ]
            rows.append(ids + [tok.pad_token_id] * (width - len(ids)))
        text_ids = torch.tensor(rows, device=device)
        text_mask = (
            torch.arange(width, device=device) < torch.tensor([len(r) for r in rows], device=device)[:, None]
        )
        cams = len(self.image_keys)
        image_ids = torch.full((n, cams * self._image_tokens), self._image_token, device=device)
        input_ids = torch.cat([image_ids, text_ids], dim=1)
        mask = torch.cat([torch.ones_like(image_ids), text_mask.long()], dim=1)
        pixels = None
        if cams:
            pixels = torch.stack([self._pixels(obs[k].to(device)) for k in self.image_keys], dim=1)
        state = torch.cat([obs[k].reshape(n, -1).to(device, torch.float32) for k in self.state_keys], dim=-1)
        if self.norm is not None:
            state = self.norm.state(state)
        state = F.pad(state, (0, self.model.pi0.config.max_state_dim - state.shape[-1]))
        pixel_mask = torch.ones(n, cams, dtype=torch.bool, device=device)
        value_inputs = torch.cat(
            [obs[k].reshape(n, -1).to(device, torch.float32) for k in self.value_keys]
            or [state.new_zeros(n, 0)], dim=-1
        )  # fmt: skip
        return {"input_ids": input_ids, "attention_mask": mask, "pixel_values": pixels,
                "pixel_mask": pixel_mask, "state": state, "value_inputs": value_inputs}  # fmt: skip

    def _pixels(self, rgb: torch.Tensor) -> torch.Tensor:
        """uint8 ``[B, H, W, 3]`` -> float ``[B, 3, S, S]`` in ``[-1, 1]`` (mean and std 0.5)."""
        x = rgb.permute(0, 3, 1, 2).float() / 127.5 - 1.0
        if tuple(x.shape[-2:]) != (self._image_size,) * 2:
            x = F.interpolate(
                x, size=(self._image_size,) * 2, mode="bilinear", align_corners=False, antialias=True
            )
        return x

    # -- acting and evaluating ------------------------------------------------------------------

    def _noise(self, n: int, generators: list[torch.Generator] | None) -> torch.Tensor:
        """``[n, K+1, H, D]`` standard normals (``A^0`` and each step's draw); row ``i``'s from
        ``generators[i]`` alone, so an env's action never depends on its batch companions."""
        config = self.model.pi0.config
        shape = (self.num_denoise_steps + 1, config.chunk_size, config.max_action_dim)
        if generators is None:
            return torch.randn((n, *shape))
        if len(generators) != n:
            raise ValueError(f"{len(generators)} generators for a batch of {n}")
        return torch.stack([torch.randn(shape, generator=g) for g in generators])

    @torch.no_grad()
    def act(
        self, obs: TensorDict, deterministic: bool = False, generators: list[torch.Generator] | None = None
    ) -> TensorDict:
        """The executed chunk ``[B, chunk * action_dim]`` (step-major), its Flow-Noise log-prob,
        the value, and the chain (``[B, K+1, H, D]``, for :meth:`evaluate`). ``deterministic``:
        ``A^0 = 0`` and no per-step noise (π0's own Euler ODE from the mean start)."""
        inputs = self.inputs(obs)
        n = inputs["state"].shape[0]
        noise = self._noise(n, generators).to(inputs["state"].device)
        if deterministic:
            noise.zero_()
        elif self.chain_start == "mean":
            noise[:, 0] = 0.0
        if self.noisy_steps == "last":
            noise[:, 1:-1] = 0.0
        out = self.model(inputs, self.num_denoise_steps, noise=noise)
        logprob, _ = flow_noise_logprob(
            out["chain"], out["mean"], out["std"], self._executed.to(noise.device), self.logprob_level,
            self.noisy_steps,
        )  # fmt: skip
        action = out["chain"][:, -1, : self.chunk, : self.action_dim]
        action = (self.norm.action(action) if self.norm is not None else action).reshape(n, -1)
        return TensorDict(
            {"action": action, "logprob": logprob, "value": out["value"], "chain": out["chain"]},
            batch_size=[n],
        )

    @torch.no_grad()
    def value(self, obs: TensorDict) -> torch.Tensor:
        """The value of ``obs`` (one prefix pass and one expert pass; no chain)."""
        return self.model(self.inputs(obs), 0)["value"]

    def evaluate(self, batch: TensorDict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(log-prob of batch["chain"], entropy, value)`` under the current parameters."""
        inputs = self.inputs(batch["obs"])
        chain = batch["chain"].to(inputs["state"].device)
        if self.noisy_steps == "last":  # the ODE from the recorded A^0, under the current weights
            start = torch.zeros_like(chain)
            start[:, 0] = chain[:, 0]
            out = self.model(inputs, self.num_denoise_steps, noise=start)
        else:
            out = self.model(inputs, self.num_denoise_steps, chain=chain)
        logprob, entropy = flow_noise_logprob(
            chain.float(), out["mean"], out["std"], self._executed.to(chain.device), self.logprob_level,
            self.noisy_steps,
        )  # fmt: skip
        return logprob, entropy, out["value"]

    # -- saving ---------------------------------------------------------------------------------

    def save_pretrained(self, path: str | Path) -> Path:
        """π0 and its tokenizer (``from_pretrained`` layout), the heads (``rl_heads.safetensors``)
        and the normalisation statistics (``norm_stats.json``)."""
        from safetensors.torch import save_file

        assert self.model is not None, "configure_model() first"
        path = Path(path)
        self.model.pi0.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        heads = {
            k: v.detach().contiguous().cpu()
            for k, v in self.model.state_dict().items()
            if not k.startswith("pi0.")
        }
        save_file(heads, str(path / HEADS_FILE))
        if self.norm is not None:
            self.norm.save(path)
        return path
