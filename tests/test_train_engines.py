"""Distributed train engines (ddp, fsdp over rank processes) against the single-process one."""

from __future__ import annotations

import copy

import pytest
import torch
from tensordict import TensorDict

from rlinf_lightning.algorithms import GRPO
from rlinf_lightning.engines import TRAIN_ENGINES, HFRolloutEngine, SamplingParams
from rlinf_lightning.engines.distributed import RankError
from rlinf_lightning.policies import LMPolicy
from rlinf_lightning.workflows.reasoning import PolicyLoss, pack_samples


@pytest.fixture(scope="module")
def batches(assets) -> list[TensorDict]:
    """Three iterations x two micro-batches of real rollouts with random advantages."""
    tok = LMPolicy(str(assets["sft"])).load_tokenizer()
    engine = HFRolloutEngine(str(assets["sft"]))
    gen = torch.Generator().manual_seed(0)
    out = []
    for it in range(6):
        ids = [tok(f"What is {it}+{k}?=", add_special_tokens=False)["input_ids"] for k in range(3)]
        comps = engine.generate(
            ids, [10 * it + k for k in range(3)], 4, SamplingParams(1.0, max_new_tokens=6), 0, 2
        )
        td = TensorDict(pack_samples(ids, comps, tok.pad_token_id), batch_size=[12])
        td["advantage"] = torch.randn(12, generator=gen)
        out.append(td)
    return out


def _train(name: str, assets, batches, iterations=range(3), restore=None, **kw):
    """Train iterations ``iterations`` (two micro-batches each) after ``restore(engine)``, if given."""
    engine = TRAIN_ENGINES.get(name)(**kw)
    engine.setup(LMPolicy(str(assets["sft"]), lr=1e-3), "cpu")
    if restore is not None:
        restore(engine)
    loss = PolicyLoss(GRPO(), 1.0)
    metrics = []
    for it in iterations:
        for mb in batches[2 * it : 2 * it + 2]:
            engine.accumulate(mb, loss)
        metrics.append(engine.step())
    return engine, {k: v.clone() for k, v in engine.named_weights()}, metrics


def _maxdiff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def single(assets, batches):
    engine, weights, metrics = _train("single", assets, batches)
    return weights, metrics


@pytest.mark.parametrize("name", ["ddp", "fsdp"])
def test_two_ranks_equal_single(assets, batches, single, name):
    engine, weights, metrics = _train(name, assets, batches, ranks=2)
    try:
        assert set(weights) == set(single[0])
        assert _maxdiff(weights, single[0]) <= 1e-4
        assert abs(metrics[-1]["grad_norm"] - single[1][-1]["grad_norm"]) < 1e-4
        if name == "fsdp":
            params = sum(t.numel() * t.element_size() for t in weights.values())
            full = 4 * params  # a replica after a step: parameters, gradients, Adam's two moments
            assert max(engine.state_bytes()) < 0.75 * full  # sharded: each rank holds about half
    finally:
        engine.shutdown()


@pytest.mark.parametrize(("saved_on", "resumed_on"), [(2, 1), (1, 2)])
def test_sharded_checkpoint_resumes_on_a_different_number_of_ranks(
    assets, batches, single, tmp_path, saved_on, resumed_on
):
    first, _, _ = _train("fsdp", assets, batches, iterations=range(1), ranks=saved_on)
    first.save_sharded(str(tmp_path / "dcp"))
    first.shutdown()
    assert (tmp_path / "dcp" / ".metadata").is_file() and not list(tmp_path.glob("dcp.tmp-*"))
    restore = lambda e: e.load_sharded(str(tmp_path / "dcp"))  # noqa: E731
    second, resumed, metrics = _train(
        "fsdp", assets, batches, iterations=(1, 2), restore=restore, ranks=resumed_on
    )
    second.shutdown()
    assert _maxdiff(resumed, single[0]) <= 1e-4
    for later, uninterrupted in zip(metrics, single[1][1:], strict=True):  # the optimizer state came back
        assert later.keys() == uninterrupted.keys()
        assert all(abs(later[k] - uninterrupted[k]) < 1e-4 for k in later), (later, uninterrupted)


def test_full_state_moves_between_rank_counts(assets, batches, single):
    one, _, _ = _train("fsdp", assets, batches, iterations=range(1), ranks=1)
    state = copy.deepcopy(one.state_dict())
    one.shutdown()
    two, resumed, _ = _train(
        "fsdp", assets, batches, iterations=(1, 2), restore=lambda e: e.load_state_dict(state), ranks=2
    )
    two.shutdown()
    assert _maxdiff(resumed, single[0]) <= 1e-4


class BadLoss:
    def __call__(self, policy, mb):
        raise ValueError("loss exploded")


def test_a_failing_rank_names_itself(assets, batches):
    engine = TRAIN_ENGINES.get("ddp")(ranks=2, timeout_s=60)
    engine.setup(LMPolicy(str(assets["sft"])), "cpu")
    try:
        with pytest.raises(RankError, match=r"rank [01] failed:(.|\n)*ValueError: loss exploded"):
            engine.accumulate(batches[0], BadLoss())
    finally:
        engine.shutdown()


def test_fit_with_fsdp_checkpoints_shards_and_resumes_on_another_rank_count(assets, tmp_path):
    from safetensors.torch import load_file

    from rlinf_lightning import RLTrainer
    from rlinf_lightning.tasks.math import MathTask
    from trainer_defaults import tiny_trainer_kwargs

    def fit(root, iterations, devices, ckpt_path=None):
        kw = tiny_trainer_kwargs(root, max_iterations=iterations, train_strategy="fsdp", devices=devices)
        task = MathTask(str(assets["train"]), str(assets["test"]), eval_size=8)
        return RLTrainer(**kw).fit(LMPolicy(str(assets["sft"]), lr=1e-3), task, ckpt_path=ckpt_path)

    full = fit(tmp_path / "full", 2, devices=2)
    fit(tmp_path / "split", 1, devices=2)
    first = tmp_path / "split" / "run" / "checkpoints" / "iter-000001"
    assert (first / "sharded" / ".metadata").is_file() and not (first / "optimizer.pt").exists()
    resumed = fit(tmp_path / "split", 2, devices=1, ckpt_path="last")  # two ranks -> one
    assert full["train_strategy"] == "fsdp" and resumed["resumed_from_iteration"] == 1
    a = load_file(str(tmp_path / "full" / "run" / "checkpoints" / "iter-000002" / "model.safetensors"))
    b = load_file(str(tmp_path / "split" / "run" / "checkpoints" / "iter-000002" / "model.safetensors"))
    assert _maxdiff(a, b) <= 1e-5
