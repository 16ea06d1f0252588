"""LoRA: train low-rank adapters (through ``peft``) instead of every weight of a policy's network.

A policy opts in by holding a :class:`LoRA` in its ``lora`` attribute (``LMPolicy`` and ``TinyVLA``
take it as a constructor argument, so in YAML it is ``policy.init_args.lora: {rank: 8, alpha: 16}``).
The train engines call :func:`attach_lora` on their copy of the policy after ``configure_model``:
``peft.inject_adapter_in_model`` wraps each target ``nn.Linear`` of ``policy.model`` in place (the
model keeps its class and layout, so the FSDP engine still finds its decoder layers), every base
weight is frozen, and the modules named in ``train_modules`` (a value head, the VLA's vision encoder
or action head) are trained in full. Only trainable parameters get gradients and Adam state.

Everything else that builds the policy (the rollout engine, the reference model, the embodied
rollout's copy) builds the plain base model. So the rollout receives **merged** weights,
``W + (alpha / rank) B A`` under the base's names (:func:`merged_weights`), and only the tensors that
can change: frozen weights equal what the rollout loaded from the same ``model_path`` and are never
sent again. The inference stage's reference model is the base itself (adapters off), as in veRL.

Checkpoints hold the trainable tensors only, with the base's identity (:func:`base_fingerprint`);
:func:`save_adapters` writes peft's ``save_pretrained`` layout and :func:`save_merged` a plain
``from_pretrained`` directory.
"""

from __future__ import annotations

import copy
import fnmatch
import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlinf_lightning.policies.model_dir import parameter_aliases

#: the projections of a Llama/Qwen2-style decoder layer: LoRA's usual targets ("all linear")
DECODER_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: the target (peft's spelling) for every ``nn.Linear`` but the output layer and the fully trained
#: modules: the same targets on families whose projections are named otherwise (Phi-3's fused
#: ``qkv_proj``, GPT-NeoX's ``query_key_value``)
ALL_LINEAR = "all-linear"
#: peft's name of the one adapter a policy trains
ADAPTER = "default"
#: what peft makes of a wrapped ``nn.Linear``'s ``q_proj.weight``: ``q_proj.base_layer.weight``
#: plus ``q_proj.lora_A.default.weight`` and ``q_proj.lora_B.default.weight``
BASE, LORA_A, LORA_B = ".base_layer.weight", f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight"


@dataclass
class LoRA:
    """Low-rank adapters ``W + (alpha / rank) B A`` on the target modules of a policy's network.

    Args:
        rank: the rank ``r`` of ``A`` (``r x in``) and ``B`` (``out x r``; zero at the start, so the
            adapted model starts as the base).
        alpha: scale numerator: the update is ``alpha / rank`` times ``B A``.
        dropout: dropout on the adapters' input while training (0 keeps rollout and training equal).
        target_modules: names (last component, e.g. ``q_proj``) of the ``nn.Linear`` modules that get
            adapters, or patterns over their full names (with ``*`` or ``.``: ``fnmatch``, e.g.
            ``pi0.model.dit.*_proj`` for π0's action expert only), or ``all-linear``: every
            ``nn.Linear`` but the output layer (``get_output_embeddings()``) and the
            ``train_modules``; default: the projections of a Llama/Qwen2-style decoder layer.
        train_modules: modules (dotted paths under ``policy.model``, e.g. ``value_head``) trained in
            full beside the adapters; ``None``: the policy's own choice (``TinyVLA``: its vision
            encoder, state projection and value head; ``LMPolicy``: none).
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(DECODER_PROJECTIONS))
    train_modules: list[str] | None = None

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def problems(self, key: str = "lora") -> list[tuple[str, str]]:
        """``(key, problem)`` pairs for bad values (keys under the policy's), found before
        anything is built."""
        out = []
        if not (isinstance(self.rank, int) and self.rank > 0):
            out.append((f"{key}.rank", f"must be a positive integer, got {self.rank!r}"))
        if not self.alpha > 0:
            out.append((f"{key}.alpha", f"must be > 0, got {self.alpha!r}"))
        if not 0 <= self.dropout < 1:
            out.append((f"{key}.dropout", f"must be in [0, 1), got {self.dropout!r}"))
        if not self.target_modules:
            out.append((f"{key}.target_modules", "must name at least one module, e.g. [q_proj, v_proj]"))
        return out


def lora_of(policy: Any) -> LoRA | None:
    """The policy's :class:`LoRA` (a dict from a config is converted), or ``None``: full fine-tuning."""
    lora = getattr(policy, "lora", None)
    return LoRA(**lora) if isinstance(lora, dict) else lora


def lora_problems(policy: Any) -> list[tuple[str, str]]:
    """``(key, problem)`` pairs of the policy's ``lora`` (under the policy's keys): its values, and
    target modules that match no ``nn.Linear`` of the network or a tied one (built on the meta
    device, nothing loaded; skipped while the network cannot be built yet)."""
    lora = lora_of(policy)
    if lora is None:
        return []
    problems = lora.problems()
    probe = copy.deepcopy(policy)
    probe.lora = None
    try:
        with torch.device("meta"):
            probe.meta_model()
    except Exception:  # noqa: BLE001 (not buildable yet: the run reports why)
        return problems
    if problem := _target_problem(probe.model, lora, _trained(probe, lora)):
        problems.append(problem)
    return problems


def _trained(policy: Any, lora: LoRA) -> list[str]:
    """The modules trained in full beside the adapters."""
    return lora.train_modules if lora.train_modules is not None else policy.lora_train_modules()


def _all_linear(model: nn.Module, linear: list[str], trained: list[str]) -> list[str]:
    """``all-linear``'s targets: the linears that are not the output layer, not tied to another
    module (:func:`_tied`) and not inside a trained module (which trains in full, so an adapter
    there would be a second copy of its update)."""
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    prefixes = tuple(f"{t}." for t in trained)
    tied = set(_tied(model, linear))
    return [
        n
        for n in linear
        if model.get_submodule(n) is not out and n not in tied and not f"{n}.".startswith(prefixes)
    ]


def _tied(model: nn.Module, names: list[str]) -> list[str]:
    """The modules of ``names`` whose weight is held under another name too (a head tied to the
    embedding): the merged ``W + s B A`` sent to the rollout would change the other module there,
    and ``named_parameters`` lists the shared base weight once, under the other name."""
    aliased = {name for group in parameter_aliases(model) for name in group}
    return [n for n in names if f"{n}.weight" in aliased]


def _targets(model: nn.Module, lora: LoRA, trained: list[str]) -> tuple[list[str], list[str]]:
    """``(the full names of the nn.Linear modules that get adapters, targets matching none)``: a
    last-component name, a pattern (``*`` or ``.``, over full names) or ``all-linear``."""
    linear = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    resolved, unknown = [], []
    for target in lora.target_modules:
        if target == ALL_LINEAR:
            hits = _all_linear(model, linear, trained)
        elif "*" in target or "." in target:
            hits = [n for n in linear if fnmatch.fnmatchcase(n, target)]
        else:
            hits = [n for n in linear if n.rpartition(".")[2] == target]
        resolved += hits
        if not hits:
            unknown.append(target)
    return list(dict.fromkeys(resolved)), unknown


def _target_problem(model: nn.Module, lora: LoRA, trained: list[str]) -> tuple[str, str] | None:
    """``(key, problem)`` for targets that match no ``nn.Linear`` or that match a tied one."""
    targets, unknown = _targets(model, lora, trained)
    if unknown:
        names = {name.rpartition(".")[2] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
        return (
            "lora.target_modules",
            f"{sorted(unknown)} match no nn.Linear of {type(model).__name__} "
            f"(its linear modules: {', '.join(sorted(names))}); name some of them, or [{ALL_LINEAR}]",
        )
    if tied := _tied(model, targets):
        return (
            "lora.target_modules",
            f"{tied} share their weight with another module (tied embeddings), so their adapters "
            f"cannot be merged into the rollout's weights; leave them out ({ALL_LINEAR} does)",
        )
    return None


def attach_lora(policy: Any) -> None:
    """Put the policy's adapters on ``policy.model`` (in place; ``A`` drawn under a fixed seed, so
    every replica starts alike), freeze the base and unfreeze its ``train_modules``; nothing when
    the policy has no ``lora``. Raises naming the config key when a target matches no module or a
    tied one, or a train module does not exist."""
    lora = lora_of(policy)
    if lora is None:
        return
    from peft import LoraConfig, inject_adapter_in_model

    model, trained = policy.model, _trained(policy, lora)
    if problem := _target_problem(model, lora, trained):
        raise ValueError(f"policy.{problem[0]}: {problem[1]}")
    targets = _targets(model, lora, trained)[0]
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets)
    with torch.random.fork_rng(devices=[]):  # A's random start, the same on every replica and run
        torch.manual_seed(0)
        inject_adapter_in_model(config, model, adapter_name=ADAPTER)  # freezes every other parameter
    for name in trained:
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise ValueError(
                f"policy.lora.train_modules: {type(model).__name__} has no module {name!r}"
            ) from None
        if module is not None:  # an optional part the model was built without (e.g. no state input)
            module.requires_grad_(True)


def is_adapter(name: str) -> bool:
    return name.endswith((LORA_A, LORA_B))


def sync_names(model: nn.Module) -> set[str]:
    """The parameters :func:`merged_weights` reads: the trainable ones and the base weights that
    adapters change."""
    return {n for n, p in model.named_parameters() if p.requires_grad or n.endswith(BASE)}


def merged_weights(
    named: Iterable[tuple[str, torch.Tensor]], scaling: float
) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights of the plain (un-adapted) model that differ from the base, under its names:
    ``x.weight = x.base_layer.weight + scaling * B @ A`` (computed in float32, returned in the
    base's dtype) for every adapted module, and every other tensor of ``named`` as it is.

    ``named`` is a LoRA model's :func:`sync_names` parameters (full tensors); each adapted module's
    three tensors are merged as soon as all three have arrived."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        for part in (BASE, LORA_A, LORA_B):
            if name.endswith(part):
                module = name[: -len(part)]
                got = pending.setdefault(module, {})
                got[part] = tensor
                if len(got) == 3:
                    del pending[module]
                    w = got[BASE]
                    delta = got[LORA_B].float() @ got[LORA_A].float()
                    yield f"{module}.weight", (w.float() + scaling * delta.to(w.device)).to(w.dtype)
                break
        else:
            yield name, tensor
    if pending:
        raise RuntimeError(f"LoRA merge: modules without base weight or adapters: {sorted(pending)[:5]}")


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a LoRA checkpoint holds: the trainable tensors (adapters and ``train_modules``)."""
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def load_trainable_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load :func:`trainable_state` back; raises naming the first trainable tensor it lacks or
    the first name the model does not have."""
    params = dict(model.named_parameters())
    trainable = {n for n, p in params.items() if p.requires_grad}
    if unexpected := sorted(set(state) - set(params)):
        raise KeyError(f"LoRA checkpoint: the model has no parameter {unexpected[0]!r}")
    if missing := sorted(trainable - set(state)):
        raise KeyError(f"LoRA checkpoint: no tensor for trainable parameter {missing[0]!r}")
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor.to(params[name].device, params[name].dtype))


# -- the base a checkpoint's adapters belong to ---------------------------------------------------

_FINGERPRINTS: dict[tuple, str] = {}


def base_fingerprint(policy: Any) -> dict[str, Any]:
    """The identity of the weights the adapters were trained on: ``{"path", "sha256"}``. With a
    ``model_path``: a SHA-256 over its weight files and config.json (cached per file size and
    modification time, so a run hashes a base once). Without one (a network built from a seed): a
    SHA-256 of the policy's hyper-parameters, which determine that network."""
    path = getattr(policy, "model_path", None)
    if path is None:
        keep = {k: repr(v) for k, v in sorted(vars(policy).items()) if not k.startswith("_") and k != "lora"}
        keep.pop("training", None)
        return {"path": None, "sha256": hashlib.sha256(json.dumps(keep).encode()).hexdigest()}
    root = Path(path)
    files = sorted(
        f for f in root.rglob("*")
        if f.is_file() and (f.suffix in (".safetensors", ".bin", ".pt") or f.name == "config.json")
    )  # fmt: skip
    key = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    if key not in _FINGERPRINTS:
        digest = hashlib.sha256()
        for f in files:
            digest.update(str(f.relative_to(root)).encode())
            with open(f, "rb") as fh:
                while chunk := fh.read(1 << 24):
                    digest.update(chunk)
        _FINGERPRINTS[key] = digest.hexdigest()
    return {"path": str(path), "sha256": _FINGERPRINTS[key]}


def checkpoint_mismatch(policy: Any, saved: dict[str, Any] | None) -> str | None:
    """Why a checkpoint whose LoRA record is ``saved`` (``None``: full weights) cannot resume
    ``policy``, or ``None``."""
    lora = lora_of(policy)
    if saved is None:
        return None if lora is None else "it holds full weights, not adapters; resume without policy.lora"
    if lora is None:
        return "it holds LoRA adapters; resume with the policy.lora that wrote them"
    if saved["config"] != asdict(lora):
        return f"its adapters were made with policy.lora {saved['config']}, not {asdict(lora)}"
    now = base_fingerprint(policy)
    was = saved["base"]
    if was["sha256"] != now["sha256"]:
        return (
            f"its adapters were trained on base {was['path']} (sha256 {was['sha256'][:12]}), but "
            f"policy.model_path {now['path']} has sha256 {now['sha256'][:12]}; resume with the same base"
        )
    return None


def lora_record(policy: Any) -> dict[str, Any]:
    """What a checkpoint says about its adapters: the LoRA config and the base's identity."""
    return {"config": asdict(lora_of(policy)), "base": base_fingerprint(policy)}


# -- export ----------------------------------------------------------------------------------------
# ``trained`` below is a LoRA checkpoint's weights: ``load_checkpoint(path)[0]["model"]``.


def _base_copy(policy: Any) -> Any:
    """The policy's base network, built as ``configure_model`` builds it (no adapters)."""
    plain = copy.deepcopy(policy)
    plain.lora = None
    plain.configure_model()
    return plain


def save_adapters(policy: Any, trained: dict[str, torch.Tensor], path: str | Path) -> Path:
    """peft's ``save_pretrained`` layout under ``path``: ``adapter_config.json`` and
    ``adapter_model.safetensors`` (keys ``base_model.model.<module>.lora_A.weight``), loadable with
    ``peft.PeftModel.from_pretrained(base, path)``. Fully trained modules are its
    ``modules_to_save``."""
    from peft import LoraConfig, get_peft_model_state_dict
    from safetensors.torch import save_file

    lora, net = lora_of(policy), _base_copy(policy)
    targets = _targets(net.model, lora, _trained(net, lora))[0]  # full names, before peft wraps them
    net.lora = lora
    attach_lora(net)
    load_trainable_state(net.model, trained)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    full = sorted({n.rpartition(".")[0] for n in trained if not is_adapter(n)})
    config = LoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
        target_modules=targets,
        base_model_name_or_path=getattr(policy, "model_path", None),
        modules_to_save=full or None,
    )  # fmt: skip
    config.save_pretrained(str(path))
    state = get_peft_model_state_dict(net.model, adapter_name=ADAPTER)
    state.update({n: t for n, t in trained.items() if not is_adapter(n)})
    tensors = {f"base_model.model.{k}": v.detach().cpu().clone().contiguous() for k, v in state.items()}
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    return path


def save_merged(policy: Any, trained: dict[str, torch.Tensor], path: str | Path) -> Path:
    """A plain model directory under ``path`` (the policy's ``save_pretrained``; ``LMPolicy``:
    weights, config and tokenizer, loadable with ``from_pretrained``): the base with the adapters
    merged in (:func:`merged_weights`) and the fully trained modules' weights."""
    lora, plain = lora_of(policy), _base_copy(policy)
    base = dict(plain.model.named_parameters())
    adapted = {n: t for n, t in trained.items() if is_adapter(n)}
    for name in {n[: -len(LORA_A)] for n in adapted if n.endswith(LORA_A)}:
        adapted[f"{name}{BASE}"] = base[f"{name}.weight"].detach()
    updates = dict(merged_weights(adapted.items(), lora.scaling))
    updates.update({n: t for n, t in trained.items() if not is_adapter(n)})
    with torch.no_grad():
        for name, tensor in updates.items():
            base[name].copy_(tensor)
    plain.save_pretrained(path)
    return Path(path)
