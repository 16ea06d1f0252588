"""RLModule: the LightningModule-shaped base class users subclass to bring their own policy."""

from __future__ import annotations

import copy
from abc import abstractmethod
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDict

if TYPE_CHECKING:
    from rlinf_lightning.policies.lora import LoRA
    from rlinf_lightning.policies.model_dir import CausalLMShape

#: parameter dtypes a policy (``LMPolicy.dtype``) or a rollout engine (``task.rollout_dtype``) takes
DTYPES = ("float32", "bfloat16", "float16")


class RLModule(torch.nn.Module):
    """A policy the trainer can roll out and train.

    Like a ``LightningModule``: construct it cheaply with hyper-parameters only (it is pickled to
    the workers that need it), build the network in :meth:`configure_model` (called on the worker),
    and return the optimizer from :meth:`configure_optimizers`. Everything that trains lives in
    ``self.model`` (the train engines step it and sync its parameters to the rollout).

    A language-model policy implements :meth:`forward_logprobs`; an embodied actor-critic
    implements ``act(obs, deterministic, generator) -> TensorDict(action, logprob, value)``,
    ``value(obs)`` and ``evaluate(batch) -> (logprob, entropy, value)`` (see ``MLPActorCritic``),
    and may size itself from the env in ``configure_spaces(obs, action_shape, action_choices)``
    (``action_choices``: ``None`` for continuous actions, else the choices of each discrete entry;
    a ``ValueError`` there refuses the env before any worker starts).
    """

    #: low-rank adapters instead of full fine-tuning (see ``policies.lora``); a subclass opts in by
    #: taking a ``LoRA`` as an argument and storing it here. ``None``: every weight trains.
    lora: LoRA | None = None
    #: entries of ``act``'s output that ``evaluate`` reads back from its batch (besides ``obs`` and
    #: ``action``): what the action was drawn through, e.g. a flow policy's denoising chain. The
    #: embodied workflow carries them from the rollout to the actor with each sample.
    replay_keys: tuple[str, ...] = ()
    #: tokens per pass through the lm head when a language-model policy takes response log-probs
    #: in chunks (``LMPolicy``); ``None``: whole (what the memory estimates assume)
    logit_chunk_tokens: int | None = None
    #: the dtype name its weights are built in (``LMPolicy`` and ``ValueModel`` take it as an option)
    dtype: str = "float32"

    def __init__(self) -> None:
        super().__init__()
        self._logged: dict[str, tuple[float | torch.Tensor, int]] = {}

    def lora_train_modules(self) -> list[str]:
        """Modules of ``self.model`` trained in full beside LoRA adapters when ``lora.train_modules``
        is not given (e.g. a value head, which has no pre-trained weights to adapt)."""
        return []

    def trainable_parameter_count(self) -> int | None:
        """Parameters that get gradients and optimizer state: all of them, or with ``lora`` the
        adapters and fully trained modules, counted on a meta-device copy with adapters attached."""
        from rlinf_lightning.policies.lora import attach_lora, lora_of

        if lora_of(self) is None:
            return self.parameter_count()
        key = ("trainable", *((k, repr(v)) for k, v in sorted(vars(self).items()) if not k.startswith("_")))
        cached = self.__dict__.get("_trainable_count")
        if cached is not None and cached[0] == key:
            return cached[1]
        probe = copy.deepcopy(self)
        probe.lora = None
        try:
            with torch.device("meta"):
                probe.meta_model()
            probe.lora = lora_of(self)
            attach_lora(probe)
        except Exception:  # noqa: BLE001 (cannot be built yet; the run itself reports why)
            return None
        count = sum(p.numel() for p in probe.model.parameters() if p.requires_grad)
        self.__dict__["_trainable_count"] = (key, count)
        return count

    def meta_model(self) -> None:
        """Build ``self.model`` with the architecture ``configure_model`` builds, under the meta
        device the caller sets, without reading weight files (the default calls ``configure_model``;
        a policy that loads weights there overrides this)."""
        self.configure_model()

    @abstractmethod
    def configure_model(self) -> None:
        """Build or load the network on the hosting worker."""

    @abstractmethod
    def compile_model(self) -> None:
        """``trainer.compile``: the model's forward under ``torch.compile``. The bound ``forward``
        is replaced, not the module, so parameter names (checkpoints, weight sync) stay as they
        are. A policy with more compute outside the model's forward compiles that too; one whose
        forwards pass no key/value cache compiles its blocks instead (:func:`compile_blocks`)."""
        self.model.forward = torch.compile(self.model.forward)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """Return the optimizer for the parameters this module trains."""

    def parameter_count(self) -> int | None:
        """Parameters of the network :meth:`configure_model` builds (a shared one once), counted
        without memory: ``configure_model`` runs on a copy of this module under torch's ``meta``
        device (as accelerate's ``init_empty_weights``), so nothing is allocated or initialised.
        ``None`` when it cannot run yet (e.g. sizes an env has not given). Cached while the
        module's hyper-parameters stay the same.

        Override it when ``configure_model`` reads weight files (the copy would read them too) or
        the count is known more cheaply (``LMPolicy`` reads config.json).
        """
        if any(True for _ in self.parameters()):  # already built
            return sum(p.numel() for p in self.parameters())
        key = tuple((k, repr(v)) for k, v in sorted(vars(self).items()) if not k.startswith("_"))
        cached = self.__dict__.get("_parameter_count")
        if cached is not None and cached[0] == key:
            return cached[1]
        probe = copy.deepcopy(self)
        try:
            with torch.device("meta"):
                probe.configure_model()
        except Exception:  # noqa: BLE001 (cannot be built yet; the run itself reports why)
            return None
        count = sum(p.numel() for p in probe.parameters())
        self.__dict__["_parameter_count"] = (key, count)
        return count

    def configure_spaces(
        self, obs: TensorDict, action_shape: tuple[int, ...], action_choices: tuple[int, ...] | None = None
    ) -> None:
        """Size the network from one env observation and a policy call's action shape (see the
        class docstring); a policy with fixed sizes needs nothing."""
        return None

    def architecture(self) -> CausalLMShape | None:
        """A language model's parameters and attention shape, for the rollout's KV-cache estimate
        (``LMPolicy`` reads its config.json); ``None``: not a causal LM, or unknown."""
        return None

    def forward_logprobs(self, batch: TensorDict, temperature: float = 1.0) -> torch.Tensor:
        """Log-probs ``[B, T]`` of the batch's response tokens under the current parameters."""
        raise NotImplementedError(f"{type(self).__name__} is not a language-model policy")

    def train_flops(self, batch: TensorDict) -> float | None:
        """Model FLOPs of one forward and backward over ``batch`` (for ``perf/mfu``); ``None``
        when the policy does not say."""
        return None

    def check_state_dict(self, state: dict[str, torch.Tensor]) -> str | None:
        """Why ``state`` (a checkpoint's full weights) cannot load into this policy, or ``None``.
        Nothing is checked here; a policy that can tell from its configuration overrides it."""
        return None

    def checkpoint_problem(self, train_state: dict[str, Any]) -> str | None:
        """Why a checkpoint's train state (full weights, or LoRA adapters with the record of what
        made them) cannot resume this policy, or ``None``: what a resume asks before any worker
        starts, so the checkpoint's LoRA details stay with the policy."""
        from rlinf_lightning.policies.lora import checkpoint_mismatch

        if why := checkpoint_mismatch(self, train_state["lora"]):
            return why
        if not train_state["lora"] and (why := self.check_state_dict(train_state["model"])):
            return f"{why}; resume with the policy that wrote it"
        return None

    def log(self, name: str, value: float | torch.Tensor) -> None:
        """Record a scalar; the trainer sends it to the loggers with the iteration's metrics as
        ``actor/<name>``. Logged several times in an iteration (once per micro-batch), the mean is
        reported, as Lightning's ``self.log(..., on_epoch=True)`` does. A tensor stays one (on its
        device) until :meth:`pop_logged`: reading it here would wait for the device to finish the
        forward before the host could queue the backward, once per micro-batch."""
        value = value.detach().float() if isinstance(value, torch.Tensor) else float(value)
        total, calls = self._logged.get(name, (0.0, 0))
        self._logged[name] = (total + value, calls + 1)

    def pop_logged(self) -> dict[str, float]:
        out = {name: float(total) / calls for name, (total, calls) in self._logged.items()}
        self._logged = {}
        return out


def count_without_loading(policy: RLModule) -> int | None:
    """:meth:`RLModule.parameter_count` for a policy whose ``configure_model`` loads the weights
    in ``policy.model_path``: a copy reads only the saved config (``_load_config``) and counts the
    same architecture built on the meta device instead."""
    if policy.model_path is None or policy.model is not None:
        return RLModule.parameter_count(policy)
    probe = copy.deepcopy(policy)
    try:
        probe._load_config()
    except (OSError, ValueError, KeyError):
        return None
    probe.model_path = None  # the same architecture, built instead of loaded
    return RLModule.parameter_count(probe)


def annealed(optimizer: torch.optim.Optimizer, steps: int | None) -> torch.optim.Optimizer | dict:
    """``optimizer`` with its learning rate decayed linearly to 0 over ``steps`` optimizer steps
    (CleanRL's ``anneal_lr``) in ``configure_optimizers``'s dict form; ``None``: it as it is."""
    if steps is None:
        return optimizer
    decay = torch.optim.lr_scheduler.LambdaLR(optimizer, _LinearDecay(steps))
    return {"optimizer": optimizer, "lr_scheduler": decay}


def anneal_problems(steps: int | None) -> list[tuple[str, str]]:
    """The ``anneal_lr_steps`` option's problem (``validate_config``'s form), if any."""
    if steps is not None and steps < 1:
        return [("anneal_lr_steps", f"must be >= 1 or null (no annealing), got {steps}")]
    return []


class _LinearDecay:
    """The learning-rate factor ``1 - step / steps`` (0 from ``steps`` on); a class, so the
    scheduler's state (saved with checkpoints) pickles."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def __call__(self, step: int) -> float:
        return max(0.0, 1.0 - step / self.steps)


def instructions(obs: Any, n: int, default: str) -> list[str]:
    """One instruction string per row of an observation batch: its ``instruction`` entry (a string,
    a list, a non-tensor stack, bytes from a simulator) or ``default`` where it has none."""
    raw = obs["instruction"] if "instruction" in obs.keys() else None
    texts = [raw] * n if raw is None or isinstance(raw, (str, bytes)) else list(_flatten(raw))
    if len(texts) != n:
        raise ValueError(f"{len(texts)} instructions for a batch of {n}")
    return [t.decode() if isinstance(t, bytes) else (str(t) if t else default) for t in texts]


def _flatten(items: Any):
    for item in items:
        if isinstance(item, (str, bytes)) or item is None:
            yield item
        else:
            yield from _flatten(item)


def compile_blocks(model: torch.nn.Module) -> None:
    """Each of ``model``'s repeated blocks (:func:`repeated_blocks`: a decoder's layers) under
    ``torch.compile``, or its whole forward where it has none, as torchtitan compiles each
    transformer block. Blocks of one type run one compiled graph per shape (the first, then one
    with dynamic shapes): Dynamo traces one layer where the whole forward traced them all (a
    24-layer decoder on a CPU: 27 s of compiling against 256 s). Only for forwards that pass no
    key/value cache: a layer reads its own cache entry, and each layer would compile its own graph
    (up to Dynamo's recompile limit, eager after)."""
    for module in repeated_blocks(model) or [model]:
        module.forward = torch.compile(module.forward)


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of every ``nn.ModuleList`` of two or more modules of one type that is not inside
    another such list, where together they hold at least half of ``model``'s parameters (a
    decoder's layers, a vision tower's and a language model's); else none."""
    blocks: list[torch.nn.Module] = []
    within: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix) for prefix in within):
            continue
        if (
            isinstance(module, torch.nn.ModuleList)
            and len(module) >= 2
            and len({type(m) for m in module}) == 1
        ):
            blocks.extend(module)
            within.append(f"{name}.")
    held = sum(p.numel() for block in blocks for p in block.parameters())
    return blocks if held and 2 * held >= sum(p.numel() for p in model.parameters()) else []
