"""Pi0Policy (policies/pi0): the tiny π0 loads from a saved directory and its ODE is transformers'
``sample_actions``; Flow-Noise log-probs of a recorded chain are recomputed exactly (float32) and
to bf16's rounding under autocast; gradients reach the expert, the noise head and the value head;
LoRA trains adapters and heads only; an iteration is the same update under every plan; a checkpoint
resumes to the uninterrupted run's weights bit for bit."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file
from tensordict import TensorDict

from rlinf_lightning import RLTrainer
from rlinf_lightning.algorithms import GRPO, PPO
from rlinf_lightning.assets import TinyPi0Config, build_tiny_pi0
from rlinf_lightning.errors import ConfigError
from rlinf_lightning.policies import Pi0Policy
from rlinf_lightning.policies.lora import LoRA
from rlinf_lightning.policies.pi0.flow import LOG_2PI_E
from rlinf_lightning.policies.pi0.norm import STD_FLOOR, NormStats
from rlinf_lightning.tasks import EmbodiedTask

CHUNK, ACTION_DIM, STATE_DIM = 3, 4, 5
FETCH = {"image_keys": [], "state_keys": ["observation", "desired_goal"]}
RAW = {"normalize": False}  # the tiny π0 was fitted to no demonstrations: it has no norm_stats.json


@pytest.fixture(scope="module")
def pi0_dir(tmp_path_factory):
    return str(build_tiny_pi0(tmp_path_factory.mktemp("pi0") / "tiny-pi0", TinyPi0Config(chunk_size=4)))


def _obs(n: int, seed: int = 0) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    return TensorDict(
        {
            "rgb": torch.randint(0, 256, (n, 48, 48, 3), generator=g, dtype=torch.uint8),
            "state": torch.randn(n, STATE_DIM, generator=g),
            "instruction": [["pick up the cube", "open the drawer"][(seed + i) % 2] for i in range(n)],
        },
        batch_size=[n],
    )


def _policy(path: str, **kwargs) -> Pi0Policy:
    policy = Pi0Policy(path, **kwargs)
    policy.configure_spaces(_obs(2), (CHUNK, ACTION_DIM))
    policy.configure_model()
    return policy


def _gens(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def test_the_tiny_pi0_loads_from_its_directory_and_its_ode_is_sample_actions(pi0_dir):
    from transformers import PI0ForConditionalGeneration

    policy = _policy(pi0_dir)
    reference = PI0ForConditionalGeneration.from_pretrained(pi0_dir)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(policy.model.pi0.state_dict()[name], tensor), name
    obs = _obs(3)
    out = policy.act(obs, deterministic=True)
    inputs = policy.inputs(obs)
    config = reference.config
    ode = reference.sample_actions(
        state=inputs["state"], input_ids=inputs["input_ids"], pixel_values=inputs["pixel_values"],
        noise=torch.zeros(3, config.chunk_size, config.max_action_dim),
        attention_mask=inputs["attention_mask"], pixel_attention_mask=inputs["pixel_mask"],
        num_steps=policy.num_denoise_steps,
    )  # fmt: skip
    assert out["action"].shape == (3, CHUNK * ACTION_DIM)
    torch.testing.assert_close(out["action"], ode[:, :CHUNK, :ACTION_DIM].reshape(3, -1), atol=1e-6, rtol=0)
    assert Pi0Policy(pi0_dir, normalize=False).validate_config() == []


def test_act_then_evaluate_give_the_same_log_probs_and_values(pi0_dir):
    policy = _policy(pi0_dir)
    obs = _obs(4)
    out = policy.act(obs, generators=_gens([0, 1, 2, 3]))
    assert out["chain"].shape == (4, policy.num_denoise_steps + 1, 4, 8)
    batch = TensorDict({"obs": obs, "action": out["action"], "chain": out["chain"]}, [4])
    logprob, entropy, value = policy.evaluate(batch)
    torch.testing.assert_close(logprob, out["logprob"], atol=1e-5, rtol=0)
    torch.testing.assert_close(value, out["value"], atol=1e-5, rtol=0)
    torch.testing.assert_close(policy.value(obs), out["value"], atol=1e-5, rtol=0)
    # entropy of K Gaussians per executed entry with std in [0.08, 0.16]
    n = policy.num_denoise_steps * CHUNK * ACTION_DIM
    half_log_2pi_e = 0.5 * torch.log(torch.tensor(2 * torch.pi * torch.e))
    low, high = (n * (half_log_2pi_e + torch.log(torch.tensor(s))) for s in (0.08, 0.16))
    assert bool((entropy >= low - 1e-4).all()) and bool((entropy <= high + 1e-4).all())
    # another chain of the same observation has another log-prob; a row's chain is its generator's
    other = policy.act(obs, generators=_gens([9, 1, 2, 3]))
    assert not torch.equal(other["chain"][0], out["chain"][0]) and torch.equal(
        other["chain"][1], out["chain"][1]
    )
    mixed = torch.cat([obs[:1], _obs(3, seed=5)])
    assert torch.equal(policy.act(mixed, generators=_gens([0, 7, 8, 9]))["chain"][0], out["chain"][0])


def test_entry_log_probs_are_the_chunks_joint_one_spread_over_its_entries(pi0_dir):
    """``logprob_level``: ``entry`` (the default) gives one log-prob per executed entry, the mean
    of its K+1 chain terms, so the ``chunk`` level (the joint log-likelihood) is their sum x (K+1)."""
    entry, chunk = _policy(pi0_dir), _policy(pi0_dir, logprob_level="chunk")
    obs = _obs(3)
    a, b = entry.act(obs, generators=_gens([0, 1, 2])), chunk.act(obs, generators=_gens([0, 1, 2]))
    assert torch.equal(a["chain"], b["chain"])
    assert a["logprob"].shape == (3, CHUNK * ACTION_DIM) and b["logprob"].shape == (3,)
    joint = a["logprob"].sum(-1) * (entry.num_denoise_steps + 1)
    torch.testing.assert_close(joint, b["logprob"], atol=1e-4, rtol=1e-6)
    assert Pi0Policy(pi0_dir, logprob_level="token", **RAW).validate_config()[0][0] == "logprob_level"


def test_noise_at_the_last_step_is_a_gaussian_around_the_deterministic_action(pi0_dir):
    """``noisy_steps="last"``: the chain is π0's ODE up to its last step, so the chunk's mean is
    the deterministic action; ``evaluate`` recomputes that ODE and scores the executed chunk
    exactly, with gradient through every step."""
    policy = _policy(pi0_dir, noisy_steps="last", chain_start="mean")
    obs = _obs(3)
    out = policy.act(obs, generators=_gens([0, 1, 2]))
    det = policy.act(obs, deterministic=True)
    steps = policy.num_denoise_steps
    torch.testing.assert_close(out["chain"][:, :steps], det["chain"][:, :steps], atol=1e-6, rtol=0)
    assert not torch.allclose(out["action"], det["action"])
    assert out["logprob"].shape == (3, CHUNK * ACTION_DIM)
    batch = TensorDict({"obs": obs, "action": out["action"], "chain": out["chain"]}, [3])
    logprob, entropy, _ = policy.evaluate(batch)
    torch.testing.assert_close(logprob, out["logprob"], atol=1e-5, rtol=0)
    # the intermediate actions are recomputed under the current weights, not read from the chain
    scrambled = out["chain"].clone()
    scrambled[:, 1:-1] += 1.0
    again, _, _ = policy.evaluate(TensorDict({"obs": obs, "action": out["action"], "chain": scrambled}, [3]))
    torch.testing.assert_close(again, logprob, atol=1e-6, rtol=0)
    low, high = (CHUNK * ACTION_DIM * (0.5 * LOG_2PI_E + math.log(s)) for s in (0.08, 0.16))
    assert bool((entropy >= low - 1e-4).all()) and bool((entropy <= high + 1e-4).all())
    logprob.sum().backward()
    # A^0 = 0 reaches the last step through the earlier steps' actions: action_in_proj's weight
    # has a gradient only if it flows through the chain
    grads = {
        n: p.grad
        for n, p in policy.model.named_parameters()
        if "action_in_proj.weight" in n or "noise_head" in n
    }
    assert len(grads) >= 3 and all(g is not None and g.abs().sum() > 0 for g in grads.values()), grads.keys()
    assert Pi0Policy(pi0_dir, noisy_steps="first", **RAW).validate_config()[0][0] == "noisy_steps"


def test_the_value_head_reads_the_value_keys_beside_pi0s_feature(pi0_dir):
    """``value_keys``: more observation entries into the value head (the episode's time); they
    change the value and nothing π0 acts on; a key the env lacks names ``policy.value_keys``."""
    policy = Pi0Policy(pi0_dir, value_keys=["time"])
    obs = _obs(2)
    obs["time"] = torch.tensor([[0.0], [0.0]])
    policy.configure_spaces(obs, (CHUNK, ACTION_DIM))
    policy.configure_model()
    assert policy.model.value_head[0].in_features == policy.model.pi0.config.dit_config.hidden_size + 1
    early = policy.act(obs, generators=_gens([0, 1]))
    obs["time"] = torch.tensor([[0.9], [0.9]])
    late = policy.act(obs, generators=_gens([0, 1]))
    assert torch.equal(early["chain"], late["chain"]) and not torch.equal(early["value"], late["value"])
    with pytest.raises(ConfigError, match="policy.value_keys: the env's observation has no 'time'"):
        Pi0Policy(pi0_dir, value_keys=["time"]).configure_spaces(_obs(2), (CHUNK, ACTION_DIM))


def test_under_bf16_autocast_act_and_evaluate_agree_to_bf16s_rounding(pi0_dir):
    policy = _policy(pi0_dir)
    obs = _obs(4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = policy.act(obs, generators=_gens([0, 1, 2, 3]))
        batch = TensorDict({"obs": obs, "action": out["action"], "chain": out["chain"]}, [4])
        with torch.no_grad():
            logprob, _, value = policy.evaluate(batch)
    assert out["logprob"].dtype == torch.float32
    torch.testing.assert_close(logprob, out["logprob"], atol=1e-3, rtol=0)
    torch.testing.assert_close(value, out["value"], atol=1e-3, rtol=0)
    with torch.no_grad():
        exact, _, _ = policy.evaluate(batch)
    assert (exact - out["logprob"]).abs().max() > 1e-4  # the bf16 forward is visibly not float32's


def test_gradients_reach_the_action_expert_the_noise_head_and_the_value_head(pi0_dir):
    policy = _policy(pi0_dir, detach_critic_input=False)
    obs = _obs(4)
    out = policy.act(obs, generators=_gens([0, 1, 2, 3]))
    logprob, entropy, value = policy.evaluate(TensorDict({"obs": obs, "chain": out["chain"]}, [4]))
    (-(logprob.sum(-1) * torch.tensor([1.0, -1.0, 0.5, 2.0])).sum() + value.pow(2).sum()).backward()
    grads = {n: p.grad for n, p in policy.model.named_parameters()}
    for prefix in ("pi0.model.dit.", "pi0.action_out_proj.", "pi0.embed_action_time.", "noise_head.",
                   "value_head.", "pi0.model.vlm.language_model.",
                   "pi0.model.vlm.vision_tower."):  # fmt: skip
        assert any(g is not None and g.abs().sum() > 0 for n, g in grads.items() if n.startswith(prefix)), (
            prefix
        )


def test_save_pretrained_keeps_the_heads_and_loads_acting_alike(pi0_dir, tmp_path):
    policy = _policy(pi0_dir)
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    policy.save_pretrained(tmp_path / "saved")
    loaded = _policy(str(tmp_path / "saved"), seed=7)
    obs = _obs(3)
    a, b = policy.act(obs, generators=_gens([1, 2, 3])), loaded.act(obs, generators=_gens([1, 2, 3]))
    for key in ("action", "logprob", "value"):
        assert torch.equal(a[key], b[key]), key


def _task(grpo: bool) -> EmbodiedTask:
    """PPO: a 6-step time limit (episodes truncate, GAE bootstraps, episodes run across
    iterations). GRPO: 16 envs in groups of 2, new 12-step episodes every iteration; about one
    episode in ten reaches the goal, so some groups disagree and carry a gradient."""
    if grpo:
        return EmbodiedTask(
            "FetchReachDense-v4", num_envs=16, steps=4, chunk=3, eval_episodes=2, group_size=2
        )
    return EmbodiedTask(
        "FetchReachDense-v4",
        env_kwargs={"max_episode_steps": 6},
        num_envs=4,
        steps=2,
        chunk=2,
        eval_episodes=2,
    )


def _fit(
    root,
    pi0_dir,
    strategy="collocated",
    launcher="inprocess",
    iterations=3,
    algorithm=None,
    ckpt=None,
    **policy_kw,
):
    from trainer_defaults import MetricsRecorder

    steps = MetricsRecorder()
    task = _task(grpo=isinstance(algorithm, GRPO))
    policy = Pi0Policy(pi0_dir, lr=1e-3, max_instruction_len=4, **FETCH, **RAW, **policy_kw)
    trainer = RLTrainer(
        algorithm=algorithm or PPO(update_epochs=1, num_minibatches=2),
        strategy=strategy, launcher=launcher, precision="32-true", devices=2, num_threads=1,
        max_iterations=iterations, default_root_dir=str(root), logger=False, enable_progress_bar=False,
        callbacks=[steps], timeout_s=300,
    )  # fmt: skip
    summary = trainer.fit(policy, task, ckpt_path=ckpt)
    last = (root / "checkpoints" / "last").read_text()
    return summary, steps.metrics, load_file(str(root / "checkpoints" / last / "model.safetensors"))


PLANS = ("collocated", "disaggregated", "hybrid")


def _plan(name):
    from rlinf_lightning.strategies import CollocatedStrategy, HybridStrategy

    plans = {"one": CollocatedStrategy(replicas=1),
             "hybrid": HybridStrategy(placement="env,rollout: 0, advantage,actor: 1")}  # fmt: skip
    return plans.get(name, name)


def _algorithm(name):
    return PPO(update_epochs=1, num_minibatches=2) if name == "ppo" else GRPO()


@pytest.fixture(scope="module")
def reference(pi0_dir, tmp_path_factory):
    """The one-worker in-process run of an algorithm (made once each): what every plan under
    every launcher must reproduce."""
    runs = {}

    def run(algorithm):
        if algorithm not in runs:
            root = tmp_path_factory.mktemp(f"one-{algorithm}")
            _, metrics, weights = _fit(root, pi0_dir, _plan("one"), algorithm=_algorithm(algorithm))
            assert any(m["actor/grad_norm"] > 0 for m in metrics)
            runs[algorithm] = metrics, weights
        return runs[algorithm]

    return run


# in process by default; the processes and ray launchers (their own π0 per worker process, the
# weights and the recorded chains over their transports) with -m slow
EQUIVALENCE = [
    (algorithm, launcher)
    if launcher == "inprocess"
    else pytest.param(algorithm, launcher, marks=pytest.mark.slow)
    for algorithm in ("ppo", "grpo")
    for launcher in ("inprocess", "processes", "ray")
]


@pytest.mark.parametrize(("algorithm", "launcher"), EQUIVALENCE)
def test_three_iterations_are_the_same_updates_under_every_plan(
    pi0_dir, tmp_path, reference, algorithm, launcher
):
    """Three queued iterations: the loss, the grad norm and the env steps of each, and the final
    weights, are the one-worker plan's under every plan and launcher."""
    ref_metrics, ref_weights = reference(algorithm)
    for name in PLANS:
        _, metrics, weights = _fit(
            tmp_path / name, pi0_dir, _plan(name), launcher=launcher, algorithm=_algorithm(algorithm)
        )
        for it, (m, r) in enumerate(zip(metrics, ref_metrics, strict=True)):
            for key in ("actor/loss", "actor/grad_norm", "env/env_steps_total"):
                assert m[key] == pytest.approx(r[key], rel=1e-5, abs=1e-4), (name, launcher, it, key)
        assert weights.keys() == ref_weights.keys()
        diff = max(float((weights[k] - ref_weights[k]).abs().max()) for k in weights)
        assert diff <= 1e-4, (name, launcher, diff)


def test_critic_warmup_trains_the_value_head_alone_and_expert_only_freezes_the_vlm(pi0_dir, tmp_path):
    """PPO's ``critic_warmup`` in the embodied workflow: those iterations move the value head and
    nothing else (the critic's input is detached); ``train_expert_only`` then keeps PaliGemma fixed
    while the action expert trains."""
    from transformers import PI0ForConditionalGeneration

    base = PI0ForConditionalGeneration.from_pretrained(pi0_dir).state_dict()
    algorithm = PPO(update_epochs=1, num_minibatches=2, critic_warmup=2)
    _, metrics, weights = _fit(tmp_path / "warm", pi0_dir, iterations=2, algorithm=algorithm)
    assert [m["actor/warmup"] for m in metrics] == [1.0, 1.0]
    assert all(torch.equal(weights[f"pi0.{k}"], v) for k, v in base.items())
    _, metrics, trained = _fit(
        tmp_path / "expert", pi0_dir, iterations=3, algorithm=algorithm, train_expert_only=True
    )
    assert "actor/warmup" not in metrics[-1] and metrics[-1]["actor/grad_norm"] > 0
    vlm = [k for k in base if k.startswith("model.vlm.")]
    assert vlm and all(torch.equal(trained.get(f"pi0.{k}", base[k]), base[k]) for k in vlm)
    assert not torch.equal(trained["pi0.action_out_proj.weight"], base["action_out_proj.weight"])
    assert not torch.equal(
        trained["pi0.model.dit.layers.0.mlp.up_proj.weight"], base["model.dit.layers.0.mlp.up_proj.weight"]
    )
    assert not torch.equal(trained["value_head.0.weight"], weights["value_head.0.weight"])


def test_lora_on_the_action_expert_trains_adapters_and_heads_only(pi0_dir, tmp_path):
    lora = LoRA(rank=2, alpha=4, target_modules=["pi0.model.dit.*_proj"])
    _, metrics, weights = _fit(tmp_path, pi0_dir, "collocated", iterations=2, lora=lora)
    assert all(m["actor/grad_norm"] > 0 for m in metrics)
    assert weights and all(
        (".lora_" in k and k.startswith("pi0.model.dit.")) or k.startswith(("noise_head.", "value_head."))
        for k in weights
    ), sorted(weights)
    assert any(".lora_B." in k and weights[k].abs().sum() > 0 for k in weights)  # the adapters moved


def test_a_checkpoint_resumes_to_the_same_run(pi0_dir, tmp_path):
    """GRPO over episodes (every iteration resets its envs from seeds, so a resumed run sees the
    same episodes; PPO's episodes running across iterations live in the simulators, which no
    checkpoint holds): iteration 3 after a resume is iteration 3 of the uninterrupted run."""
    full = _fit(tmp_path / "full", pi0_dir, iterations=3, algorithm=GRPO())
    _fit(tmp_path / "split", pi0_dir, iterations=2, algorithm=GRPO())
    from trainer_defaults import MetricsRecorder

    steps = MetricsRecorder()
    task = _task(grpo=True)
    trainer = RLTrainer(
        algorithm=GRPO(), strategy="collocated", launcher="inprocess",
        precision="32-true", devices=2, num_threads=1, max_iterations=3,
        default_root_dir=str(tmp_path / "split"),
        logger=False, enable_progress_bar=False, callbacks=[steps], timeout_s=300,
    )  # fmt: skip
    trainer.fit(Pi0Policy(pi0_dir, lr=1e-3, max_instruction_len=4, **FETCH, **RAW), task, ckpt_path="last")
    assert any(m["actor/grad_norm"] > 0 for m in full[1])  # some groups disagreed: the weights moved
    # the weights and the episodes are restored exactly: the same gradient at iteration 3
    assert steps.metrics[-1]["actor/grad_norm"] == full[1][-1]["actor/grad_norm"]
    last = (tmp_path / "split" / "checkpoints" / "last").read_text()
    resumed = load_file(str(tmp_path / "split" / "checkpoints" / last / "model.safetensors"))
    # and the step taken with it: each thread replica's Adam moments are its own after the load
    # (they were one loaded copy, stepped twice: up to 4e-4 apart)
    assert resumed.keys() == full[2].keys()
    assert all(torch.equal(resumed[k], full[2][k]) for k in full[2])


def test_rlinf_sft_fits_pi0_to_scripted_demonstrations_with_its_flow_matching_loss(pi0_dir, tmp_path):
    from rlinf_lightning.policies.pi0.demos import load_demos
    from rlinf_lightning.policies.pi0.sft import _policy_for, flow_matching_loss
    from rlinf_lightning.sft import record_expert_demos, run_sft

    demos = record_expert_demos("FetchReachDense-v4", 4, 4, str(tmp_path / "demos.safetensors"))
    assert demos == {"expert_success": 1.0, "rows": 200, "episodes": 4}
    rows, meta = load_demos(tmp_path / "demos.safetensors")
    assert rows["action"].shape == (200, 4, 4) and not bool(rows["action_mask"][49, 1:].any())

    def loss(path):  # in the fitted model's standardised units, for the base π0 too
        policy = _policy_for(path, rows, meta)
        policy.norm = NormStats.load(tmp_path / "sft")
        with torch.no_grad():
            return float(flow_matching_loss(policy, rows, torch.Generator().manual_seed(0)))

    result = run_sft(pi0_dir, str(tmp_path / "demos.safetensors"), str(tmp_path / "demos.safetensors"),
                     str(tmp_path / "sft"), steps=60, batch_size=32, lr=3e-3)  # fmt: skip
    assert result["eval_loss"] == pytest.approx(loss(str(tmp_path / "sft")), rel=1e-4)
    assert loss(str(tmp_path / "sft")) < 0.8 * loss(pi0_dir)  # it fits the demonstrations (1.41 -> 1.01)
    # the demonstrations' statistics are saved with it (openpi's norm_stats.json) and read back
    stats = NormStats.load(tmp_path / "sft")
    state = torch.cat([rows["obs"]["observation"], rows["obs"]["desired_goal"]], -1)
    torch.testing.assert_close(stats.state_mean, state.mean(0))
    valid = rows["action"][rows["action_mask"]]
    torch.testing.assert_close(stats.action_std, valid.std(0).clamp_min(STD_FLOOR))
    assert float(stats.action_std[:3].min()) > 5 * STD_FLOOR
    assert float(stats.action_std[3]) == pytest.approx(STD_FLOOR)  # the unused gripper: floored
    fitted = _policy_for(str(tmp_path / "sft"), rows, meta)
    obs = rows["obs"][:3]
    inputs = fitted.inputs(obs)
    torch.testing.assert_close(inputs["state"][:, :13], (state[:3] - stats.state_mean) / stats.state_std)
    out = fitted.act(obs, deterministic=True)
    executed = out["chain"][:, -1, :4, :4] * stats.action_std + stats.action_mean  # back in the env's units
    assert torch.equal(out["action"], executed.reshape(3, -1))
    policy = Pi0Policy(str(tmp_path / "sft"), **FETCH)
    assert policy.validate_config() == []
