"""The embodied-RL macro flow (PPO over simulated environments) as stages:

    env shards -> env <-> rollout (a loop: steps + 1 turns) -> advantage -> actor   (stream)
    actor ==weights==> rollout                                                     (sync)

Each input micro-batch names a shard of the envs. The env stage owns its shards' simulators (it is
``sticky``: shard ``k`` always lands on the same replica) and sends their observations round the
loop; the rollout stage answers with actions, log-probs and values; the env steps. After ``steps``
steps, one more turn values the last observation (GAE's bootstrap), and the shard's trajectory goes
downstream. Episodes run on across iterations. The rollout draws each env's action noise from a
generator seeded by ``(seed, env id, global step)``, so the trajectories do not depend on how the
plan cut the envs into shards or placed them.

Two ways to advantages, chosen by what the algorithm ``reads`` (:func:`advantage_mode`): GAE
over the steps with the critic's values (PPO), or GRPO over episodes as RLinf offers it (no critic):
every iteration starts new episodes, the envs of a group reset with the same seed, each episode gets
one score (success at any step), scores are normalised within the group, every step of an episode
until its first end carries its score's advantage, and groups whose episodes all succeeded or all
failed are dropped (they carry no signal). An algorithm reading anything else is refused before
anything loads.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict

from rlinf_lightning.algorithms.advantages import groups_with_signal
from rlinf_lightning.engines.precision import AUTO_ROLLOUT_DTYPE, resolve_rollout_dtype
from rlinf_lightning.engines.train import TrainSpec
from rlinf_lightning.envs import EnvBatch, import_env, make_env
from rlinf_lightning.errors import ConfigError
from rlinf_lightning.flow.memory import weights_part
from rlinf_lightning.flow.metrics import Metrics
from rlinf_lightning.flow.stage import MemoryPart, Stage, StageContext
from rlinf_lightning.policies.module import RLModule
from rlinf_lightning.seeds import SEED_STRIDE, row_seed
from rlinf_lightning.workflows.training import TrainStage, policy_dtype

#: training resets draw their seeds below this and evaluation episodes from it up (episode ``k``
#: resets with ``EVAL_SEED + k``), so no evaluation episode replays a training episode; both stay
#: below 2**32, which simulators that seed numpy's ``RandomState`` require
EVAL_SEED = 2**31
#: evaluation's cap on an episode when the env declares no time limit: a policy that never ends an
#: episode costs bounded time instead of hanging the run
EVAL_MAX_STEPS = 10_000
#: what the workflow gives an algorithm, by the way it computes advantages: GAE over each step's
#: reward with the critic's values, or one score per episode compared within a group of envs
PROVIDES = {
    "gae": frozenset({"rewards", "values", "dones", "old_logprobs", "proximal_logprobs"}),
    "episodes": frozenset({"rewards", "group_ids", "response_mask", "old_logprobs", "proximal_logprobs"}),
}


def advantage_mode(algorithm: Any) -> str:
    """The ``PROVIDES`` entry that serves ``algorithm`` (``gae`` when it reads values, else
    ``episodes``); a :class:`ConfigError` naming what it reads that neither provides."""
    reads = frozenset(getattr(algorithm, "reads", ()))
    name = type(algorithm).__name__
    if not reads:
        raise ConfigError([("trainer.algorithm", f"{name} declares no `reads` (the inputs it needs)")])
    mode = "gae" if "values" in reads else "episodes"
    if missing := sorted(reads - PROVIDES[mode]):
        why = (f"{name} reads {', '.join(missing)}, which the embodied workflow does not provide "
               f"(it gives {', '.join(sorted(PROVIDES[mode]))})")  # fmt: skip
        raise ConfigError([("trainer.algorithm", why)])
    return mode


@dataclass
class _Shard:
    """One shard's envs and the trajectory being collected this iteration."""

    env: EnvBatch
    shard: int
    first_env: int
    obs: TensorDict
    final_obs: TensorDict | None = None
    t: int = 0
    steps: dict[str, list[torch.Tensor | TensorDict]] = field(default_factory=dict)
    episode_return: torch.Tensor | None = None
    episode_length: torch.Tensor | None = None
    succeeded: torch.Tensor | None = None  # per env: success at some step of this iteration
    running: torch.Tensor | None = None  # per env: still in the iteration's first episode


class _Episodes:
    """The episodes that ended this iteration (mean success, return and length; how many; how many
    reported no success, NaN: an env without a notion of success) and the env steps taken; counts
    are per second as ``perf/*_per_s`` where named ``*_total``."""

    def __init__(self) -> None:
        self.metrics = Metrics()
        self.metrics.sum("episodes_total", 0)
        self.metrics.sum("env_steps_total", 0)
        self.metrics.sum("episodes_without_success", 0)

    def steps(self, n: int) -> None:
        self.metrics.sum("env_steps_total", n)

    def ended(self, success: torch.Tensor, returns: torch.Tensor, lengths: torch.Tensor) -> None:
        reported = ~torch.isnan(success)
        self.metrics.sum("episodes_total", len(success))
        self.metrics.sum("episodes_without_success", (~reported).sum())
        self.metrics.mean("return", float(returns.mean()), len(returns))
        self.metrics.mean("length", float(lengths.float().mean()), len(lengths))
        if reported.any():
            self.metrics.mean("success", float(success[reported].mean()), int(reported.sum()))


class EnvStage(Stage):
    """Steps its shards' envs with the rollout's actions; emits each shard's trajectory.

    Args:
        env: an ``ENVS`` name or a gymnasium id.
        env_kwargs: keyword arguments of the env factory.
        steps: env steps per iteration (actions per env; a chunk of ``chunk`` steps counts once).
        chunk: actions per policy call, executed open-loop (rewards summed over the chunk).
        seed: env ``i`` is reset with ``seed + i`` (with ``group_size`` > 1: its group's seed).
        group_size: envs that share reset seeds (a GRPO group).
        episodic: start new episodes every iteration (GRPO), instead of running episodes on.
    """

    name = "env"
    sticky = True
    in_keys = ("shard", "first_env", "envs")
    # round the loop: observations; downstream: each shard's trajectory
    out_keys = ("obs", "final_obs", "bootstrap", "env_id", "step", "action", "logprob", "value", "reward",
                "terminated", "truncated", "final_value", "next_value", "mask", "score",
                "group_id", "policy_version")  # fmt: skip

    def __init__(
        self,
        env: str,
        env_kwargs: dict[str, Any] | None,
        steps: int,
        chunk: int = 1,
        seed: int = 0,
        group_size: int = 1,
        episodic: bool = False,
    ) -> None:
        self.env_name, self.env_kwargs = env, dict(env_kwargs or {})
        self.steps, self.chunk, self.seed = steps, chunk, seed
        self.group_size, self.episodic = group_size, episodic

    def setup(self, ctx: StageContext) -> None:
        self.shards: dict[int, _Shard] = {}
        import_env(self.env_name, **self.env_kwargs)  # the envs are made with their shards, in iteration 1

    def begin_iteration(self, iteration: int) -> None:
        self.iteration = iteration
        self.episodes = _Episodes()

    def process(self, batch: TensorDict) -> TensorDict:
        if "action" not in batch.keys():
            return self._start(int(batch["shard"]), int(batch["first_env"]), int(batch["envs"]))
        return self._answer(self.shards[int(batch["shard"][0])], batch)

    def _seeds(self, first_env: int, n: int) -> list[int]:
        """Reset seeds of envs ``first_env .. first_env + n``: their group's, below ``EVAL_SEED``."""
        groups = [(first_env + i) // self.group_size for i in range(n)]
        # GRPO: new episodes, and new group seeds, every iteration (SEED_STRIDE > groups per iteration)
        base = self.seed + (SEED_STRIDE * self.iteration if self.episodic else 0)
        return [(base + g) % EVAL_SEED for g in groups]

    def _start(self, shard: int, first_env: int, n: int) -> TensorDict:
        s = self.shards.get(shard)
        if s is None or self.episodic:
            env = s.env if s is not None else make_env(self.env_name, n, **self.env_kwargs)
            s = self.shards[shard] = _Shard(env, shard, first_env, env.reset(self._seeds(first_env, n)))
            s.episode_return, s.episode_length = torch.zeros(n), torch.zeros(n, dtype=torch.long)
        s.t, s.steps = 0, {k: [] for k in ("obs", "action", "logprob", "value", "policy_version", "reward",
                                          "terminated", "truncated", "final_value", "mask")}  # fmt: skip
        s.succeeded, s.running = torch.zeros(n, dtype=torch.bool), torch.ones(n, dtype=torch.bool)
        return self._observation(s)

    def _observation(self, s: _Shard) -> TensorDict:
        n = s.env.num_envs
        step = (self.iteration - 1) * self.steps + s.t  # the same whatever the plan: seeds the actions
        return TensorDict(
            {
                "obs": s.obs,
                "final_obs": s.final_obs if s.final_obs is not None else s.obs,
                "bootstrap": s.steps["truncated"][-1] if s.t > 0 else torch.zeros(n, dtype=torch.bool),
                "env_id": torch.arange(s.first_env, s.first_env + n),
                "shard": torch.full((n,), s.shard),
                "step": torch.full((n,), step),
            },
            batch_size=[n],
        )

    def _answer(self, s: _Shard, answer: TensorDict) -> TensorDict:
        if s.t > 0:  # the value of the last step's final observations (bootstrap where truncated)
            s.steps["final_value"].append(answer["final_value"])
        if s.t == self.steps:  # the extra turn: the value of the last observation, then the trajectory
            return self._trajectory(s, answer["value"])
        for key in ("action", "logprob", "value", "policy_version"):
            s.steps[key].append(answer[key])
        s.steps["obs"].append(s.obs)
        self._step(s, answer["action"])
        s.t += 1
        return self._observation(s)

    def _step(self, s: _Shard, action: torch.Tensor) -> None:
        env = s.env
        n = env.num_envs
        actions = action.reshape(n, self.chunk, *env.action_shape)
        low, high = env.action_low, env.action_high
        reward = torch.zeros(n)
        terminated = torch.zeros(n, dtype=torch.bool)
        truncated = torch.zeros(n, dtype=torch.bool)
        final_obs = None
        s.steps["mask"].append(s.running.clone())  # a step of the iteration's first episode
        for i in range(self.chunk):
            step = env.step(torch.maximum(torch.minimum(actions[:, i], high), low))
            self.episodes.steps(n)
            live = ~(terminated | truncated)  # an env that ended inside the chunk adds nothing more
            reward += torch.where(live, step.reward, torch.zeros(n))
            s.episode_return += torch.where(live, step.reward, torch.zeros(n))
            s.episode_length += live.long()
            s.succeeded |= live & s.running & (step.success == 1.0)
            ended = live & (step.terminated | step.truncated)
            if ended.any():
                final_obs = step.obs.clone() if final_obs is None else final_obs
                final_obs[ended] = step.final_obs[ended]
                self.episodes.ended(step.success[ended], s.episode_return[ended], s.episode_length[ended])
                s.episode_return[ended], s.episode_length[ended] = 0.0, 0
            terminated |= live & step.terminated
            truncated |= live & step.truncated
            s.obs = step.obs
        s.final_obs = final_obs
        s.running &= ~(terminated | truncated)
        s.steps["reward"].append(reward)
        s.steps["terminated"].append(terminated)
        s.steps["truncated"].append(truncated & ~terminated)

    def _trajectory(self, s: _Shard, next_value: torch.Tensor) -> TensorDict:
        n = s.env.num_envs
        per_step = {k: torch.stack(v, dim=1) for k, v in s.steps.items()}
        env_id = torch.arange(s.first_env, s.first_env + n)
        return TensorDict(
            {**per_step, "next_value": next_value, "env_id": env_id, "score": s.succeeded.float(),
             "group_id": env_id // self.group_size},
            batch_size=[n],
        )  # fmt: skip

    def end_iteration(self) -> Metrics:
        return self.episodes.metrics

    def teardown(self) -> None:
        for s in self.shards.values():
            s.env.close()


class EnvRolloutStage(Stage):
    """Answers the env: actions, their log-probs and values; the values of ended episodes' last
    observations. Takes new weights from the actor once per iteration; evaluates (role ``evaluate``).

    ``dtype`` is ``task.rollout_dtype``: the dtype the policy's forward computes in here, by
    autocast (the weights stay the policy's). ``auto`` follows the actor's ``precision`` on this
    stage's device (``engines.precision.resolve_rollout_dtype``): where the actor trains under
    bf16 autocast, the rollout runs the same bf16 forward (the behaviour log-probs are then the
    ones the actor computes, and a 21 M-parameter VLA infers 1.8x faster on an AVX512-BF16 CPU).
    Every output is float32 whatever the compute dtype.
    """

    name = "rollout"
    in_keys = ("obs", "final_obs", "bootstrap", "env_id", "step")
    out_keys = ("action", "logprob", "value", "final_value", "shard", "policy_version")

    def __init__(
        self,
        policy: RLModule,
        seed: int = 0,
        chunk: int = 1,
        dtype: str | None = AUTO_ROLLOUT_DTYPE,
        precision: str = "32-true",
    ) -> None:
        self.policy, self.seed, self.chunk = policy, seed, chunk
        self.dtype_setting, self.precision = dtype, precision

    def dtype(self, device: str) -> str:
        """The dtype the policy computes in on ``device``."""
        return resolve_rollout_dtype(self.dtype_setting, self.precision, device, policy_dtype(self.policy))

    def _compute(self) -> contextlib.AbstractContextManager:
        """Autocast to the rollout dtype where it is not the weights' own."""
        if self.compute_dtype == policy_dtype(self.policy):
            return contextlib.nullcontext()
        return torch.autocast(torch.device(self.device).type, dtype=getattr(torch, self.compute_dtype))

    def memory(self, device: str, replicas: int, micro_batch: int) -> list[MemoryPart] | None:
        """The policy's weights (parameter count x dtype bytes); not its forward's activations."""
        n = self.policy.parameter_count()
        return None if n is None else [weights_part(n, policy_dtype(self.policy))]

    def setup(self, ctx: StageContext) -> None:
        self.device, self.compute_dtype = ctx.device, self.dtype(ctx.device)
        self.net = copy.deepcopy(self.policy)
        self.net.configure_model()
        self.net.to(ctx.device).eval().requires_grad_(False)

    def _generators(self, env_ids: torch.Tensor, step: int) -> list[torch.Generator]:
        return [torch.Generator().manual_seed(row_seed(self.seed, int(e), step)) for e in env_ids]

    @torch.no_grad()
    def process(self, batch: TensorDict) -> TensorDict:
        batch = batch.to(self.device)
        gens = self._generators(batch["env_id"], int(batch["step"][0]))
        # GAE bootstraps only where the last step truncated an episode: value just those rows
        # (most steps none; a forward pass over every final observation would double the cost)
        rows = batch["bootstrap"].nonzero().squeeze(-1)
        with self._compute():
            out = _float32(self.net.act(batch["obs"], generators=gens))
            final_value = torch.zeros_like(out["value"])
            if len(rows):
                final_value[rows] = self.net.value(batch["final_obs"][rows]).float()
        out["final_value"] = final_value
        out["shard"] = batch["shard"]  # which of the env stage's shards asked
        out["policy_version"] = torch.full_like(batch["shard"], self.policy_version)
        return out.to("cpu")

    def apply_sync(self, source: str, state: TensorDict) -> None:
        params = dict(self.net.model.named_parameters())
        with torch.no_grad():
            for name, tensor in state.items():
                params[name].copy_(tensor.to(params[name].device, params[name].dtype))

    @torch.no_grad()
    def evaluate(self, env: str, env_kwargs: dict[str, Any], episodes: int, seed: int) -> dict[str, float]:
        """Success rate and return of one deterministic episode in each of ``episodes`` envs."""
        batch = make_env(env, episodes, **env_kwargs)
        try:
            obs = batch.reset(seed)
            returns, success = torch.zeros(episodes), torch.full((episodes,), float("nan"))
            done = torch.zeros(episodes, dtype=torch.bool)
            limit = batch.max_episode_steps or EVAL_MAX_STEPS
            for _ in range(0, limit, self.chunk):
                with self._compute():
                    action = self.net.act(obs.to(self.device), deterministic=True)["action"].float().cpu()
                for a in action.reshape(episodes, self.chunk, *batch.action_shape).unbind(1):  # open-loop
                    step = batch.step(torch.maximum(torch.minimum(a, batch.action_high), batch.action_low))
                    returns += torch.where(done, torch.zeros(episodes), step.reward)
                    ended = ~done & (step.terminated | step.truncated)
                    success[ended] = step.success[ended]
                    done |= ended
                    obs = step.obs
                if bool(done.all()):
                    break
        finally:
            batch.close()
        reported = success[~torch.isnan(success)]  # NaN: the env has no notion of success
        return {
            "success": float(reported.mean()) if len(reported) else float("nan"),
            "return": float(returns.mean()),
            "episodes": float(episodes),
        }


def _float32(out: TensorDict) -> TensorDict:
    """``out`` with its floating entries in float32 (a bf16 forward's actions, log-probs, values)."""
    return out.apply(lambda t: t.float() if t.is_floating_point() else t)


class GAEStage(Stage):
    """GAE over each shard's trajectory; emits its steps as samples (with a global sample id)."""

    name = "advantage"
    in_keys = ("reward", "value", "terminated", "truncated", "final_value", "next_value", "env_id",
               "policy_version")  # fmt: skip
    out_keys = ("advantage", "return", "sample_id")

    def __init__(self, algorithm: Any) -> None:
        self.algorithm = algorithm

    def memory(self, device: str, replicas: int, micro_batch: int) -> list[MemoryPart]:
        return []  # a few numbers per sample

    def process(self, traj: TensorDict) -> TensorDict:
        adv, ret = self.algorithm.compute_advantages(
            traj["reward"], traj["value"], traj["terminated"], traj["truncated"], traj["final_value"],
            traj["next_value"],
        )  # fmt: skip
        n, steps = adv.shape
        samples = TensorDict(
            {
                "obs": traj["obs"],
                "action": traj["action"],
                "logprob": traj["logprob"],
                "value": traj["value"],
                "policy_version": traj["policy_version"],
                "advantage": adv,
                "return": ret,
                "sample_id": traj["env_id"][:, None] * steps + torch.arange(steps),
            },
            batch_size=[n, steps],
        )
        return samples.reshape(-1)


class EpisodeAdvantageStage(Stage):
    """GRPO over episodes: one score per env's episode, normalised within its group (whole groups
    share a shard); every step of the episode until its first end gets that advantage. Groups
    whose scores are all equal carry no signal and are dropped (masked out)."""

    name = "advantage"
    in_keys = ("score", "group_id", "mask", "env_id", "policy_version")
    out_keys = ("advantage", "mask", "sample_id")

    def __init__(self, algorithm: Any) -> None:
        self.algorithm = algorithm

    def memory(self, device: str, replicas: int, micro_batch: int) -> list[MemoryPart]:
        return []  # a few numbers per sample

    def setup(self, ctx: StageContext) -> None:
        self.metrics = Metrics()

    def process(self, traj: TensorDict) -> TensorDict:
        adv = self.algorithm.compute_advantages({"rewards": traj["score"], "group_ids": traj["group_id"]})
        signal = groups_with_signal(adv, traj["group_id"], self.metrics)
        n, steps = traj["mask"].shape
        samples = TensorDict(
            {
                "obs": traj["obs"],
                "action": traj["action"],
                "logprob": traj["logprob"],
                "value": traj["value"],
                "policy_version": traj["policy_version"],
                "advantage": adv[:, None].expand(n, steps),
                "mask": traj["mask"] & signal[:, None],
                "sample_id": traj["env_id"][:, None] * steps + torch.arange(steps),
            },
            batch_size=[n, steps],
        )
        return samples.reshape(-1)

    def end_iteration(self) -> Metrics:
        return self.metrics.take()


class EpisodeGRPOLoss:
    """GRPO's clipped surrogate on the masked steps (no critic); picklable, for every rank."""

    in_keys = ("obs", "action", "logprob", "advantage", "mask", "sample_id", "policy_version")

    def __init__(self, algorithm: Any) -> None:
        self.algorithm = algorithm

    def __call__(self, policy: RLModule, mb: TensorDict):
        logprob, entropy, _ = policy.evaluate(mb)
        mask = mb["mask"].float()[:, None]
        proximal = mb.get("proximal_logprob", None)
        loss_sum, count, metrics = self.algorithm.loss(
            logprob[:, None],
            mb["logprob"][:, None],
            mb["advantage"],
            mask,
            proximal_logprobs=None if proximal is None else proximal[:, None],
        )
        mean_entropy = (entropy.detach() * mask[:, 0]).sum() / mask.sum().clamp_min(1.0)
        return loss_sum, count, {**metrics, "entropy": mean_entropy}


class PPOLoss:
    """``(policy, minibatch) -> (loss_sum, count, metrics)``; picklable, for every rank."""

    in_keys = ("obs", "action", "logprob", "value", "advantage", "return", "sample_id", "policy_version")

    def __init__(self, algorithm: Any) -> None:
        self.algorithm = algorithm

    def __call__(self, policy: RLModule, mb: TensorDict):
        logprob, entropy, value = policy.evaluate(mb)
        # with a proximal policy the value clip, too, is around the critic the actor holds
        old_value = mb["proximal_value"] if "proximal_value" in mb.keys() else mb["value"]
        return self.algorithm.loss(
            logprob, mb["logprob"], mb["advantage"], value, old_value, mb["return"], entropy,
            proximal_logprobs=mb.get("proximal_logprob", None),
        )  # fmt: skip


def proximal_outputs(policy: RLModule, mb: TensorDict) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-probs of ``mb``'s actions and the values under ``policy`` as it is (no gradient: the
    caller runs it through ``engine.forward_all``); module-level, so a distributed engine's ranks
    can run it."""
    logprob, _, value = policy.evaluate(mb)
    return logprob, value


class PPOActorStage(TrainStage):
    """Keeps the iteration's samples; at its end, ``update_epochs`` passes of ``num_minibatches``
    optimizer steps on ``loss`` (PPO's, or GRPO's over episodes), fewer passes when the
    algorithm's ``target_kl`` stops them. Minibatches are cut by a permutation of the *global*
    sample ids (seeded by iteration and epoch), and advantages normalised (and the explained
    variance and early-stop KL measured) over the whole batch, so replicas of a data-parallel group
    together take exactly the steps one replica would."""

    name = "actor"
    end_per_sample = True  # every pass runs at the end, on the samples this replica kept

    def __init__(
        self,
        policy: RLModule,
        algorithm: Any,
        loss: PPOLoss | EpisodeGRPOLoss,
        train: TrainSpec,
        total_samples: int,
        seed: int = 0,
        max_staleness: int = 0,
        micro_batch_size: int | None = None,
    ) -> None:
        super().__init__(policy, train, max_staleness)
        self.algorithm, self.loss, self.total_samples, self.seed = algorithm, loss, total_samples, seed
        self.micro_batch_size = micro_batch_size
        self.in_keys = loss.in_keys
        self.update_epochs = getattr(algorithm, "update_epochs", 1)
        self.num_minibatches = getattr(algorithm, "num_minibatches", 1)
        self.norm_adv = getattr(algorithm, "norm_adv", False)
        self.target_kl = getattr(algorithm, "target_kl", None)

    def begin_iteration(self, iteration: int) -> None:
        super().begin_iteration(iteration)
        self.iteration, self.buffer, self.metrics = iteration, [], Metrics()

    def process(self, batch: TensorDict) -> None:
        self.check_staleness(self.iteration, batch["policy_version"], self.metrics)
        self.buffer.append(batch)
        return None

    def _moments(self, *columns: torch.Tensor) -> tuple[list[tuple[float, float]], float]:
        """Each column's mean and (population) variance over the whole batch, every replica's
        samples pooled, and the number of samples."""
        x = [c.double() for c in columns]
        sums = [c.sum() for c in x] + [(c**2).sum() for c in x] + [torch.tensor(float(len(x[0])))]
        totals = torch.stack(sums).to(torch.float64)
        self.ctx.all_reduce([totals])
        *moments, count = totals.tolist()
        k, n = len(x), max(count, 1.0)
        return [(moments[i] / n, moments[k + i] / n - (moments[i] / n) ** 2) for i in range(k)], count

    def _normalize(self, data: TensorDict | None) -> None:
        adv = data["advantage"] if data is not None else torch.zeros(0)
        [(mean, var)], count = self._moments(adv)
        std = max(var * count / max(count - 1, 1.0), 0.0) ** 0.5
        if data is not None:
            data["advantage"] = (adv - mean) / (std + 1e-8)

    def _explained_variance(self, data: TensorDict | None, metrics: Metrics) -> None:
        """CleanRL's ``1 - Var(returns - values) / Var(returns)`` of the rollout's values, over
        the whole batch: how much of the returns the critic predicts (1: all; <= 0: nothing)."""
        returns = data["return"] if data is not None else torch.zeros(0)
        error = returns.double() - data["value"].double() if data is not None else torch.zeros(0)
        [(_, var_returns), (_, var_error)], _ = self._moments(returns, error)
        if var_returns > 0:
            metrics.mean("explained_variance", 1.0 - var_error / var_returns)

    def _kl_exceeded(self, kl_sum: float, count: float) -> bool:
        """Whether the approximate KL of a pass's last minibatch (summed over the replicas) is
        above ``target_kl``: every replica decides alike."""
        totals = torch.tensor([kl_sum, count], dtype=torch.float64)
        self.ctx.all_reduce([totals])
        return bool(totals[1] > 0) and float(totals[0] / totals[1]) > self.target_kl

    def end_iteration(self) -> Metrics:
        data = torch.cat(self.buffer) if self.buffer else None
        metrics = self.metrics
        if "return" in self.loss.in_keys:
            self._explained_variance(data, metrics)
        if self.norm_adv:
            self._normalize(data)
        if "proximal_logprobs" in self.algorithm.reads:  # the actor before its steps (every rank calls)
            chunks = []
            if data is not None:  # a minibatch per forward, or a micro-batch where that is smaller
                size = max(1, -(-len(data) // self.num_minibatches))
                chunks = list(data.split(min(size, self.micro_batch_size or size)))
            proximal = self.engine.forward_all(chunks, proximal_outputs)
            if data is not None:
                data["proximal_logprob"] = torch.cat([lp.cpu() for lp, _ in proximal])
                data["proximal_value"] = torch.cat([v.cpu() for _, v in proximal])
        epochs = 0
        for epoch in range(self.update_epochs):
            g = torch.Generator().manual_seed(row_seed(self.seed, self.iteration, epoch))
            position = torch.empty(self.total_samples, dtype=torch.long)
            position[torch.randperm(self.total_samples, generator=g)] = torch.arange(self.total_samples)
            minibatch = (
                position[data["sample_id"]] * self.num_minibatches // self.total_samples
                if data is not None
                else None
            )
            for m in range(self.num_minibatches):
                kl_sum, count = 0.0, 0.0
                if data is not None and bool((minibatch == m).any()):
                    mb = data[minibatch == m]
                    for piece in mb.split(self.micro_batch_size or len(mb)):  # gradient accumulation
                        stats = self.engine.accumulate(piece, self.loss)
                        for k, v in stats.items():
                            metrics.mean(k, v, len(piece))
                        kl_sum += stats.get("approx_kl", 0.0) * len(piece)
                        count += float(len(piece))
                metrics.merge(self.engine.step())
            epochs += 1
            if self.target_kl is not None and self._kl_exceeded(kl_sum, count):
                break
        metrics.mean("epochs", epochs)
        return metrics


def embodied_workflow(
    *,
    policy: RLModule,
    algorithm: Any,
    env: str,
    env_kwargs: dict[str, Any] | None,
    num_envs: int,
    steps: int,
    chunk: int,
    group_size: int,
    train: TrainSpec,
    seed: int,
    max_staleness: int = 0,
    rollout_dtype: str | None = AUTO_ROLLOUT_DTYPE,
    train_micro_batch_size: int | None = None,
) -> Any:
    """PPO (an algorithm reading values: GAE) or GRPO over episodes, by :func:`advantage_mode`."""
    from rlinf_lightning.flow.workflow import Workflow

    ppo = advantage_mode(algorithm) == "gae"
    if getattr(algorithm, "critic_warmup", 0):
        why = "the embodied critic is the policy's value head, which trains with it; set it to 0"
        raise ConfigError([("trainer.algorithm.critic_warmup", why)])
    advantage = GAEStage(algorithm) if ppo else EpisodeAdvantageStage(algorithm)
    loss = PPOLoss(algorithm) if ppo else EpisodeGRPOLoss(algorithm)
    actor = PPOActorStage(
        policy, algorithm, loss, train, num_envs * steps, seed, max_staleness, train_micro_batch_size
    )
    return (
        Workflow("embodied")
        .chain(EnvStage(env, env_kwargs, steps, chunk, seed, group_size, episodic=not ppo), advantage, actor)
        .add(EnvRolloutStage(policy, seed, chunk, rollout_dtype, train.precision))
        .loop("env", "rollout", turns=steps + 1)
        .sync("actor", "rollout", "weights", staleness=max_staleness)
        .role("train", "actor")
        .role("evaluate", "rollout")
    )
