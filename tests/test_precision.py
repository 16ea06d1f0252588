"""Training precision (Lightning's names): bf16-mixed keeps float32 master weights, optimizer state,
log-probs and losses while the matmuls run in bf16; bf16-true trains bf16 weights; auto picks
bf16-mixed only where the device computes bf16 natively."""

from __future__ import annotations

import copy

import pytest
import torch

from rlinf_lightning.algorithms import GRPO
from rlinf_lightning.engines.precision import cpu_has_native_bf16, resolve_precision, resolve_rollout_dtype
from rlinf_lightning.engines.rollout import HFRolloutEngine, SamplingParams
from rlinf_lightning.engines.train import SingleTrainEngine
from rlinf_lightning.flow.stage import StageContext
from rlinf_lightning.policies import LMPolicy
from rlinf_lightning.workflows.reasoning.actor import PolicyLoss
from rlinf_lightning.workflows.reasoning.rollout import pack_samples


def test_auto_resolves_by_hardware_and_names_are_checked():
    assert resolve_precision("auto", "cpu") == ("bf16-mixed" if cpu_has_native_bf16() else "32-true")
    assert resolve_precision("bf16-true", "cpu") == "bf16-true"
    with pytest.raises(ValueError, match="precision must be one of auto, 32-true, bf16-mixed, bf16-true"):
        resolve_precision("16-mixed", "cpu")


def test_the_rollout_dtype_follows_the_actor_unless_named():
    native = "bfloat16" if cpu_has_native_bf16() else "float32"
    assert resolve_rollout_dtype("auto", "auto", "cpu", "float32") == native
    assert resolve_rollout_dtype("auto", "bf16-true", "cpu", "float32") == "bfloat16"
    assert resolve_rollout_dtype("auto", "32-true", "cpu", "float32") == "float32"  # exact float32
    assert resolve_rollout_dtype(None, "bf16-mixed", "cpu", "float32") == "float32"
    assert resolve_rollout_dtype("float16", "32-true", "cpu", "float32") == "float16"


def _batch(model_dir: str):
    """A real rollout batch (tokens, log-probs, advantages) from the tiny model."""
    policy = LMPolicy(model_dir)
    tok = policy.load_tokenizer()
    engine = HFRolloutEngine(model_dir)
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in ("What is 1+2?=", "What is 30+4?=")]
    completions = engine.generate(prompts, [0, 1], 4, SamplingParams(max_new_tokens=6), 0, tok.eos_token_id)
    batch = pack_samples(prompts, completions, tok.pad_token_id)
    from tensordict import TensorDict

    td = TensorDict(batch, batch_size=[8])
    td["advantage"] = torch.linspace(-1.0, 1.0, 8)
    return td


def _step(model_dir: str, batch, precision: str):
    engine = SingleTrainEngine()
    engine.setup(LMPolicy(model_dir, lr=1e-3), StageContext(), precision)
    compute_dtypes: set[torch.dtype] = set()
    hook = engine.policy.model.lm_head.register_forward_hook(lambda m, i, o: compute_dtypes.add(o.dtype))
    logps: list[torch.Tensor] = []

    def loss(policy, mb):
        logps.append(policy.forward_logprobs(mb, 1.0))
        return PolicyLoss(GRPO(), 1.0)(policy, mb)

    engine.accumulate(copy.deepcopy(batch), loss)
    hook.remove()
    grads = {p.grad.dtype for p in engine.policy.parameters()}
    flat_grad = torch.cat([p.grad.float().reshape(-1) for p in engine.policy.parameters()])
    metrics = engine.step().compute()
    state = engine.optimizer.state_dict()["state"]
    return {
        "compute": compute_dtypes,
        "logp": logps[0].dtype,
        "params": {p.dtype for p in engine.policy.parameters()},
        "grads": grads,
        "adam": {s["exp_avg"].dtype for s in state.values()},
        "metrics": metrics,
        "flat_grad": flat_grad,
    }


def test_bf16_mixed_keeps_float32_state_and_log_probs_and_tracks_the_float32_update(assets):
    batch = _batch(str(assets["sft"]))
    full = _step(str(assets["sft"]), batch, "32-true")
    mixed = _step(str(assets["sft"]), batch, "bf16-mixed")
    assert full["compute"] == {torch.float32}
    assert mixed["compute"] == {torch.bfloat16}  # the matmuls ran in bf16
    for key in ("logp", "params", "grads", "adam"):  # master weights, grads, Adam state, log-probs
        assert mixed[key] in ({torch.float32}, torch.float32), key
    a, b = full["metrics"], mixed["metrics"]
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=0.05)
    assert b["loss"] == pytest.approx(a["loss"], abs=0.02)
    # the gradient points the same way (one AdamW step moves each weight by about lr x sign(grad),
    # so the weights after a step would hide a wrong gradient scale; compare the gradients)
    cosine = torch.nn.functional.cosine_similarity(full["flat_grad"], mixed["flat_grad"], dim=0)
    assert cosine > 0.99


def test_bf16_true_trains_bf16_weights_with_the_float32_gradient(assets):
    batch = _batch(str(assets["sft"]))
    full = _step(str(assets["sft"]), batch, "32-true")
    out = _step(str(assets["sft"]), batch, "bf16-true")
    assert out["params"] == {torch.bfloat16} and out["adam"] == {torch.bfloat16}
    assert out["logp"] == torch.float32  # log-probs are computed in float32 from the logits
    # the same update to bf16's rounding: the gradient's size and direction are float32's
    assert out["metrics"]["grad_norm"] == pytest.approx(full["metrics"]["grad_norm"], rel=0.05)
    assert torch.nn.functional.cosine_similarity(full["flat_grad"], out["flat_grad"], dim=0) > 0.99


def test_a_bf16_rollout_shows_its_mismatch_and_tis_weights_it(warm_assets, tmp_path):
    """The rollout/actor log-prob mismatch is measured (actor/approx_kl): none with a float32 rollout
    and a float32 actor, some with a bf16 rollout, which GRPO(tis_cap) then weights: each token by
    min(pi_actor / pi_rollout, tis_cap), all 1 without a mismatch. rollout_dtype auto (the default)
    is float32 beside a 32-true actor and bf16 with TIS at cap 2 beside a bf16-mixed one."""
    from rlinf_lightning import RLTrainer
    from trainer_defaults import MetricsRecorder, tiny_task, tiny_trainer_kwargs

    assets = warm_assets

    def fit(name, rollout_dtype=None, **over):
        steps = MetricsRecorder()
        kw = tiny_trainer_kwargs(tmp_path / name, max_iterations=1, precision="32-true", callbacks=[steps])
        task = tiny_task(assets, eval_size=2, rollout_dtype=rollout_dtype, rollout_batch_size=64)
        RLTrainer(**{**kw, **over}).fit(LMPolicy(str(assets["sft"]), lr=1e-4), task)
        return steps.metrics[-1]

    exact = fit("fp32", rollout_dtype="auto", algorithm=GRPO(tis_cap=2.0))
    bf16 = fit("bf16", rollout_dtype="bfloat16", algorithm=GRPO(tis_cap=2.0))
    capped = fit("bf16-cap1", rollout_dtype="bfloat16", algorithm=GRPO(tis_cap=1.0))
    auto = fit("auto", rollout_dtype="auto", precision="bf16-mixed", algorithm=GRPO())
    assert exact["actor/approx_kl"] < 1e-6
    # auto beside bf16-mixed: the bf16 rollout's mismatch, and TIS on at cap 2 though GRPO() has none
    assert auto["actor/approx_kl"] > 100 * max(exact["actor/approx_kl"], 1e-9)
    # the mean weight's distance from 1, measured: 6e-8 in float32; with the bf16 rollout 1e-3 on
    # an Intel Xeon with AMX, 9e-5 to 3e-4 on an AMD EPYC (its bf16 kernels round differently, the
    # tokens' deviations partly cancel in the mean)
    drift = max(abs(exact["actor/tis_weight"] - 1.0), 1e-7)
    assert exact["actor/tis_weight"] == pytest.approx(1.0, abs=1e-6)
    assert abs(auto["actor/tis_weight"] - 1.0) > 100 * drift and auto["actor/tis_weight"] <= 2.0
    assert bf16["actor/approx_kl"] > 100 * max(exact["actor/approx_kl"], 1e-9)
    assert abs(bf16["actor/tis_weight"] - 1.0) > 100 * drift
    # a cap of 1 cuts the tokens the actor likes more than the rollout did: a smaller mean weight
    # and another gradient (the weight multiplies each token's loss; 64 samples, so that some
    # group's samples disagree and the gradient is not zero)
    assert bf16["advantage/groups_with_signal"] > 0
    assert capped["actor/tis_weight"] < min(bf16["actor/tis_weight"], 1.0)
    assert capped["actor/grad_norm"] != pytest.approx(bf16["actor/grad_norm"], rel=1e-4)


def _attention_ops(policy: LMPolicy, batch, bf16: bool, grad: bool) -> set[str]:
    """The scaled-dot-product-attention kernels one forward_logprobs ran."""
    from torch.profiler import profile

    with profile() as prof, torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        with torch.set_grad_enabled(grad):
            policy.forward_logprobs(batch, 1.0)
    return {e.key for e in prof.key_averages() if "attention" in e.key or e.key == "aten::bmm"}


def test_a_bf16_training_forward_on_cpu_takes_the_math_attention_kernel_with_the_same_gradient(assets):
    """PyTorch's CPU flash-attention backward is slow in bf16; a bf16 training forward takes the
    math kernel (matmuls) instead, and only there. The gradient is the flash kernel's, to bf16."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from rlinf_lightning.policies import lm

    batch = _batch(str(assets["sft"]))
    policy = LMPolicy(str(assets["sft"]))
    policy.configure_model()
    flash = "aten::_scaled_dot_product_flash_attention_for_cpu"
    assert flash not in _attention_ops(policy, batch, bf16=True, grad=True)
    assert "aten::bmm" in _attention_ops(policy, batch, bf16=True, grad=True)
    assert flash in _attention_ops(policy, batch, bf16=True, grad=False)  # rollout / inference
    assert flash in _attention_ops(policy, batch, bf16=False, grad=True)  # float32 training

    def grad(force_flash: bool) -> torch.Tensor:
        policy.model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if force_flash:
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    original = lm.MATH_ATTENTION_MAX_BYTES
                    lm.MATH_ATTENTION_MAX_BYTES = 0  # scores "too big": the default kernel stays
                    try:
                        logp = policy.forward_logprobs(batch, 1.0)
                    finally:
                        lm.MATH_ATTENTION_MAX_BYTES = original
            else:
                logp = policy.forward_logprobs(batch, 1.0)
        (logp * batch["response_mask"]).sum().backward()
        return torch.cat([p.grad.float().reshape(-1) for p in policy.model.parameters()])

    math, flash_grad = grad(False), grad(True)
    assert torch.nn.functional.cosine_similarity(math, flash_grad, dim=0) > 0.999


def test_under_bf16_autocast_the_rotary_embedding_rotates_in_bf16(assets):
    """Float32 master weights make the residual stream float32, and ``transformers`` casts cos and
    sin to it: the query/key rotation ran in float32 before autocast cast it to bf16 for attention.
    Under autocast they are now bf16 (the rollout's bf16 model rotates alike); in float32, float32;
    and a bf16-mixed step still tracks the float32 one (the test above)."""
    policy = LMPolicy(str(assets["sft"]))
    policy.configure_model()
    rotary = policy.model.model.rotary_emb
    x, pos = torch.zeros(1, 5, policy.model.config.hidden_size), torch.arange(5)[None]
    assert {t.dtype for t in rotary(x, pos)} == {torch.float32}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert {t.dtype for t in rotary(x, pos)} == {torch.bfloat16}
        batch = _batch(str(assets["sft"]))
        logp = policy.forward_logprobs(batch, 1.0)
    assert logp.dtype == torch.float32
