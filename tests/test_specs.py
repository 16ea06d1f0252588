"""Settings as frozen specs built once from a task's keys (``workflows/specs.py``), and declared
interfaces instead of probes: an algorithm or a policy that lacks what a workflow reads is refused
in one line naming its key, when the workflow is built, before any worker starts."""

from __future__ import annotations

import dataclasses

import gymnasium
import pytest

from rlinf_lightning import RLTrainer
from rlinf_lightning.algorithms import ALGORITHMS, GRPO
from rlinf_lightning.algorithms.contract import interface_problems
from rlinf_lightning.engines.rollout import SamplingParams
from rlinf_lightning.errors import ConfigError
from rlinf_lightning.policies import LMPolicy, MLPActorCritic
from rlinf_lightning.tasks import EmbodiedTask
from rlinf_lightning.workflows.specs import BudgetSpec, EmbodiedSpec, ReasoningSpec, RolloutSpec, RunSpec
from trainer_defaults import tiny_task, tiny_trainer_kwargs


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (RunSpec(), "seed"),
        (RolloutSpec(), "group_size"),
        (BudgetSpec(), "max_tokens"),
        (ReasoningSpec(), "reward"),
        (EmbodiedSpec("CartPole-v1"), "steps"),
        (SamplingParams(), "max_new_tokens"),
    ],
)
def test_a_spec_is_frozen(spec, field):
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(spec, field, getattr(spec, field))


def test_a_math_tasks_spec_carries_its_keys_to_the_stages(assets):
    """Built once from the task's keys; the stages read the very values."""
    sampling = SamplingParams(temperature=0.7, max_new_tokens=12)
    task = tiny_task(assets, rollout_dtype="float32", sampling=sampling, train_micro_batch_size=None,
                     train_max_tokens_per_micro_batch=512, inference_max_tokens_per_micro_batch=256,
                     format_weight=0.3, prompt_template="Q: {prompt}")  # fmt: skip
    policy = LMPolicy(str(assets["sft"]))
    spec = task.workflow_spec(policy)
    assert spec.rollout == RolloutSpec(
        engine="hf",
        dtype="float32",
        sampling=sampling,
        group_size=4,
        prompts=4,  # rollout_batch_size 16 / group_size 4
        prompt_format=task.prompt_format,
        max_prompt_tokens=task.longest_prompt_tokens(policy),
        eval_prompts=8,
    )
    assert (spec.actor, spec.inference) == (BudgetSpec(None, 512), BudgetSpec(None, 256))
    assert (spec.reward, spec.format_weight, spec.critic) == ("math_verify", 0.3, None)
    assert len(spec.train_problems) == len(task.train)

    stages = task.build_workflow(policy, RunSpec(GRPO(kl_coef=0.01), seed=3)).stages
    actor = stages["actor"]
    assert (actor.max_tokens, actor.temperature, actor.horizon) == (512, 0.7, 12)
    assert actor.prompts_per_iteration == 4 and actor.seed == stages["rollout"].seed == 3
    assert stages["rollout"].spec == spec.rollout and stages["inference"].max_tokens == 256


def test_every_registered_algorithm_declares_what_the_workflows_read():
    assert {name: interface_problems(ALGORITHMS.resolve(name)) for name in ALGORITHMS} == {
        name: [] for name in ALGORITHMS
    }


class Bare:
    """An algorithm object that is no ``Algorithm``: it reads rewards and groups and has a loss,
    but none of the options the reasoning workflow reads (``kl_coef``, ``tis_cap``, ...)."""

    reads = frozenset({"rewards", "group_ids"})
    needs_reference = False

    def compute_advantages(self, inputs):
        return inputs["rewards"]

    def loss(self, *args, **kwargs):
        raise AssertionError("never reached: refused before any worker starts")


def test_an_algorithm_lacking_a_declared_attribute_is_refused_in_one_line(assets, tmp_path):
    """Before: the workflows probed it with getattr defaults and ran on with whatever it had."""
    trainer = RLTrainer(algorithm=Bare(), **tiny_trainer_kwargs(tmp_path))
    with pytest.raises(ConfigError) as info:
        trainer.fit(LMPolicy(str(assets["sft"])), tiny_task(assets))
    assert info.value.keys == ["trainer.algorithm"]
    (why,) = [m for _, m in info.value.problems]
    assert why.startswith("Bare lacks kl_coef, kl_in_reward") and "tis_cap" in why and "\n" not in why
    assert trainer.fit_loop is None  # no worker started


def test_an_env_without_a_time_limit_is_refused_naming_task_time_aware():
    """The env wrapper names its key itself (no routing by the message's text)."""
    if "EndlessCartPole-v0" not in gymnasium.registry:
        gymnasium.register("EndlessCartPole-v0", entry_point="gymnasium.envs.classic_control:CartPoleEnv")
    task = EmbodiedTask("EndlessCartPole-v0", num_envs=2, steps=4, time_aware=True)
    with pytest.raises(ConfigError) as info:
        task.build_workflow(MLPActorCritic(), RunSpec(ALGORITHMS.resolve("ppo")))
    assert info.value.keys == ["task.time_aware"] and "time limit" in str(info.value)
