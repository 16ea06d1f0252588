"""TinyVLA (policies/vla/): the rollout's log-probs are the trainer's, a row's action is its
generator's, deterministic actions are greedy, saved models act alike, and one PPO-like step learns."""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict

from rlinf_lightning.policies.vla import NUM_BINS, TinyVLA, action_to_bins, bin_centres

CHUNK, ACTION_DIM, STATE_DIM = 2, 3, 5


def _obs(n: int, seed: int = 0, instructions: list[str] | None = None) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    if instructions is None:
        instructions = [
            ["pick up the red cube", "push the blue cube to the target"][(seed + i) % 2] for i in range(n)
        ]
    return TensorDict(
        {
            "rgb": torch.randint(0, 256, (n, 64, 64, 3), generator=g, dtype=torch.uint8),
            "state": torch.randn(n, STATE_DIM, generator=g),
            "instruction": instructions,
        },
        batch_size=[n],
    )


def _policy(obs: TensorDict | None = None, **kwargs) -> TinyVLA:
    policy = TinyVLA(**kwargs)
    policy.configure_spaces(obs if obs is not None else _obs(2), (CHUNK, ACTION_DIM))
    policy.configure_model()
    return policy


def _gens(seeds: list[int]) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(s) for s in seeds]


def test_bins_are_the_top_vocabulary_ids_and_centres_map_back_exactly():
    assert torch.equal(action_to_bins(bin_centres()), torch.arange(NUM_BINS))
    policy = _policy()
    vocab = policy.model.lm.get_output_embeddings().weight.shape[0]
    assert vocab >= 512 and len(policy.tokenizer) == vocab
    assert policy.tokenizer.convert_ids_to_tokens(list(range(vocab - NUM_BINS, vocab))) == [
        f"<bin_{b}>" for b in range(NUM_BINS)
    ]
    # the same seed gives the same weights (every replica starts alike)
    other = _policy()
    assert all(torch.equal(v, other.model.state_dict()[k]) for k, v in policy.model.state_dict().items())


@pytest.mark.parametrize("lm", ["qwen2", "llama"])
@pytest.mark.parametrize("decode", ["oft", "autoregressive"])
def test_act_log_probs_and_values_equal_evaluate(decode, lm):
    policy = _policy(decode=decode, lm=lm, temperature=0.7)
    if lm == "llama":
        assert type(policy.model.lm).__name__ == "LlamaForCausalLM"
    obs = _obs(4)
    out = policy.act(obs, generators=_gens([0, 1, 2, 3]))
    assert out["action"].shape == (4, CHUNK * ACTION_DIM) and out["logprob"].shape == out["value"].shape == (
        4,
    )
    logprob, entropy, value = policy.evaluate(TensorDict({"obs": obs, "action": out["action"]}, [4]))
    assert torch.allclose(logprob, out["logprob"], atol=1e-5, rtol=0)
    assert torch.allclose(value, out["value"], atol=1e-5, rtol=0)
    assert torch.allclose(policy.value(obs), out["value"], atol=1e-5, rtol=0)
    assert bool((entropy > 0).all()) and bool(
        (entropy <= CHUNK * ACTION_DIM * math.log(NUM_BINS) + 1e-3).all()
    )
    # as the workflow hands them to the actor: steps stacked per env, then flattened
    later = _obs(4, seed=1)
    again = policy.act(later, generators=_gens([4, 5, 6, 7]))
    samples = TensorDict(
        {
            "obs": torch.stack([obs, later], dim=1),
            "action": torch.stack([out["action"], again["action"]], dim=1),
        },
        batch_size=[4, 2],
    ).reshape(-1)
    flat, _, _ = policy.evaluate(samples)
    assert torch.allclose(flat, torch.stack([out["logprob"], again["logprob"]], dim=1).reshape(-1), atol=1e-5)


def test_the_rollout_computes_as_a_bf16_mixed_actor_does():
    """``task.rollout_dtype: auto`` beside a bf16-mixed actor: the rollout stage's forward runs
    under bf16 autocast, so its behaviour log-probs and values are the ones the actor computes
    (float32 tensors), not a float32 forward's; beside a 32-true actor it stays float32."""
    from rlinf_lightning.flow.stage import StageContext
    from rlinf_lightning.workflows.embodied.rollout import EnvRolloutStage

    obs = _obs(4)
    batch = TensorDict(
        {"obs": obs, "final_obs": obs, "bootstrap": torch.tensor([True, False, False, True]),
         "env_id": torch.arange(4), "shard": torch.zeros(4, dtype=torch.long),
         "step": torch.zeros(4, dtype=torch.long)},
        batch_size=[4],
    )  # fmt: skip
    outs = {}
    for precision in ("bf16-mixed", "32-true"):
        stage = EnvRolloutStage(_policy(obs), dtype="auto", precision=precision)
        stage.setup(StageContext("cpu", 0, 1, 1, [0]))
        outs[precision] = out = stage.process(batch)
        assert {out[k].dtype for k in ("action", "logprob", "value", "final_value")} == {torch.float32}
    actor = _policy(obs)
    samples = TensorDict({"obs": obs, "action": outs["bf16-mixed"]["action"]}, [4])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        mixed, _, mixed_value = actor.evaluate(samples)
    with torch.no_grad():
        exact, _, _ = actor.evaluate(samples)
    assert torch.allclose(outs["bf16-mixed"]["logprob"], mixed, atol=1e-4, rtol=0)
    assert torch.allclose(outs["bf16-mixed"]["value"], mixed_value, atol=1e-4, rtol=0)
    assert torch.allclose(outs["bf16-mixed"]["final_value"][[0, 3]], mixed_value[[0, 3]], atol=1e-4, rtol=0)
    assert (outs["bf16-mixed"]["logprob"] - exact).abs().max() > 1e-3  # bf16's rounding is visible
    exact32, _, _ = actor.evaluate(TensorDict({"obs": obs, "action": outs["32-true"]["action"]}, [4]))
    assert torch.allclose(outs["32-true"]["logprob"], exact32, atol=1e-5, rtol=0)


@pytest.mark.parametrize("decode", ["oft", "autoregressive"])
def test_actions_are_bin_centres_and_a_rows_noise_is_its_generators(decode):
    policy = _policy(decode=decode)
    obs = _obs(4)
    out = policy.act(obs, generators=_gens([10, 11, 12, 13]))
    action = out["action"]
    assert bool((action >= -1).all()) and bool((action <= 1).all())
    assert torch.equal(bin_centres()[action_to_bins(action)], action)
    # row 0 with the same generator seed but other companions (images, states, instructions, seeds)
    companions = _obs(4, seed=7, instructions=["a", "stack the green cube", "", "open the drawer"])
    mixed = torch.cat([obs[:1], companions[1:]])
    assert torch.equal(policy.act(mixed, generators=_gens([10, 21, 22, 23]))["action"][0], action[0])
    assert not torch.equal(policy.act(obs, generators=_gens([99, 11, 12, 13]))["action"][0], action[0])


@pytest.mark.parametrize("decode", ["oft", "autoregressive"])
def test_deterministic_actions_are_greedy_and_repeatable(decode):
    policy = _policy(decode=decode)
    obs = _obs(3)
    first = policy.act(obs, deterministic=True)
    assert torch.equal(
        policy.act(obs, deterministic=True, generators=_gens([1, 2, 3]))["action"], first["action"]
    )
    bins = action_to_bins(first["action"])
    with torch.no_grad():
        logits, _ = policy._logits(policy._prompt(obs), bins)  # teacher-forced on the greedy bins
    assert torch.equal(logits.argmax(-1), bins)


def test_the_instruction_is_read_and_defaults_when_missing():
    policy = _policy(default_instruction="open the drawer")
    obs = _obs(2, instructions=["open the drawer", "close the drawer"])
    assert policy.value(obs)[0] != policy.value(_obs(2, instructions=["close the drawer"] * 2))[0]
    default = _obs(2, instructions=["open the drawer"] * 2)
    assert torch.equal(policy.value(default.exclude("instruction")), policy.value(default))
    assert policy.validate_config() == []
    bad = TinyVLA(lm="gpt", decode="beam", temperature=0.0, hidden_size=63, model_path="/nonexistent")
    assert {k for k, _ in bad.validate_config()} == {
        "lm",
        "decode",
        "temperature",
        "hidden_size",
        "model_path",
    }


@pytest.mark.parametrize("lm", ["qwen2", "llama"])
def test_save_pretrained_then_load_acts_identically(tmp_path, lm):
    policy = _policy(lm=lm, decode="autoregressive", default_instruction="stack the cubes")
    with torch.no_grad():  # move off the seeded init, so loading must really read the files
        for p in policy.model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    path = policy.save_pretrained(tmp_path / "vla")
    loaded = TinyVLA(model_path=str(path), decode="autoregressive", seed=123, hidden_size=32)
    assert loaded.validate_config() == []
    obs = _obs(3)
    loaded.configure_spaces(obs, (CHUNK, ACTION_DIM))
    loaded.configure_model()
    assert loaded.default_instruction == "stack the cubes" and loaded.hidden_size == policy.hidden_size
    for key, value in policy.model.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[key], value), key
    expected = policy.act(obs, deterministic=True)
    got = loaded.act(obs, deterministic=True)
    assert torch.equal(got["action"], expected["action"]) and torch.equal(got["value"], expected["value"])
    with pytest.raises(ValueError, match="chunks"):
        TinyVLA(model_path=str(path)).configure_spaces(obs, (CHUNK + 1, ACTION_DIM))


def test_one_optimizer_step_lowers_a_policy_gradient_loss():
    policy = _policy(lr=1e-3)
    optimizer = policy.configure_optimizers()
    obs = _obs(8)
    batch = TensorDict(
        {"obs": obs, "action": policy.act(obs, generators=_gens(list(range(8))))["action"]}, [8]
    )
    advantage = torch.randn(8, generator=torch.Generator().manual_seed(0))

    def loss() -> torch.Tensor:
        logprob, _, value = policy.evaluate(batch)
        return -(logprob * advantage).mean() + 0.5 * (value - advantage).pow(2).mean()

    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    first = loss()
    first.backward()
    optimizer.step()
    optimizer.zero_grad()
    assert any(not torch.equal(v, before[k]) for k, v in policy.model.state_dict().items())
    assert not torch.equal(policy.model.vision.position, before["vision.position"])  # the encoder trains too
    with torch.no_grad():
        assert float(loss()) < float(first)
