"""The memory estimate (``flow.memory``): parameter counts from config.json alone, the actor's
estimate against what its engine really allocates, the per-worker sum (or the largest share under
context switching), and the refusal of a model too big for this machine through the real CLI."""

from __future__ import annotations

import json
import math
import shutil
import struct
import time
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from rlinf_lightning.algorithms import GRPO
from rlinf_lightning.assets import build_tiny_qwen2
from rlinf_lightning.cli import main
from rlinf_lightning.engines.train import TrainSpec
from rlinf_lightning.flow import BatchShape, MemoryPart, Stage, StageContext, Workflow
from rlinf_lightning.flow.memory import GIB, host_memory, memory_problems, worker_memory
from rlinf_lightning.policies import LMPolicy
from rlinf_lightning.policies.model_dir import config_shapes
from rlinf_lightning.strategies import STRATEGIES, HybridStrategy, Resources
from rlinf_lightning.tasks.data import make_arithmetic_splits
from rlinf_lightning.workflows.reasoning.actor import ActorStage
from rlinf_lightning.workflows.specs import RolloutSpec, RunSpec
from trainer_defaults import cli_fit_args, scaled


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """A tiny Qwen2 (random weights: nothing here trains it) and small arithmetic splits, in the
    layout ``cli_fit_args`` takes (``sft`` is the model directory)."""
    root = tmp_path_factory.mktemp("memory")
    data = make_arithmetic_splits(root / "data", n_train=64, n_test=16)
    return {"sft": build_tiny_qwen2(root / "tiny-qwen2"), "train": data["train"], "test": data["test"]}


def test_parameter_count_from_config_equals_the_real_models(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    built = AutoModelForCausalLM.from_pretrained(tiny["sft"])
    assert LMPolicy(str(tiny["sft"])).parameter_count() == sum(p.numel() for p in built.parameters())

    # a larger Qwen2, untied, from a config.json alone (no weights exist): Qwen2's layer by hand
    h, inter, layers, heads, kv, vocab = 512, 1376, 4, 8, 2, 1000
    cfg = json.loads((tiny["sft"] / "config.json").read_text())
    cfg.pop("layer_types", None)
    cfg.update(hidden_size=h, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
               num_key_value_heads=kv, vocab_size=vocab, tie_word_embeddings=False)  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    kv_dim = kv * h // heads
    attention = (h * h + h) + 2 * (h * kv_dim + kv_dim) + h * h  # q (bias), k and v (bias), o
    per_layer = attention + 3 * h * inter + 2 * h  # gate, up, down; two RMSNorms
    expected = vocab * h + layers * per_layer + h + vocab * h  # embedding, layers, norm, lm_head
    t0 = time.perf_counter()
    assert LMPolicy(str(tmp_path)).parameter_count() == expected
    assert LMPolicy(str(tmp_path)).parameter_count() == expected  # again: the cached meta model
    assert time.perf_counter() - t0 < scaled(5)


@pytest.mark.parametrize(("precision", "per_parameter"), [("32-true", 16), ("bf16-true", 8)])
def test_actor_estimate_is_what_its_engine_allocates(tiny, precision, per_parameter):
    """Weights and gradients after a backward, the optimizer's state after the step (sums of
    tensor nbytes, not RSS) against the estimate, within 0.1%: all the estimate leaves out is the
    optimizer's scalar step counter per tensor (measured: 0.002% here). bf16-mixed's 2 bytes more
    are autocast's bf16 weight copies, alive only inside a forward and backward, so they are not
    measured here."""
    policy = LMPolicy(str(tiny["sft"]))
    actor = ActorStage(policy, RunSpec(GRPO(), TrainSpec("single", {}, precision)), RolloutSpec())
    estimate = actor.memory_bytes("cpu", 1, 8)
    assert estimate == policy.parameter_count() * per_parameter

    actor.setup(StageContext("cpu"))
    gen = torch.Generator().manual_seed(0)
    batch = TensorDict(
        {
            "input_ids": torch.randint(4, 90, (8, 12), generator=gen),
            "attention_mask": torch.ones(8, 12, dtype=torch.long),
            "response_mask": torch.ones(8, 4),
            "rollout_logprobs": torch.full((8, 4), -4.0),
            "advantage": torch.randn(8, generator=gen),
            "policy_version": torch.zeros(8, dtype=torch.long),  # sampled by the initial weights
        },
        batch_size=[8],
    )
    actor.begin_iteration(1)  # as a worker does before the first micro-batch
    actor.process(batch)
    params = list(actor.engine.policy.parameters())
    weights_and_grads = sum(p.nbytes + p.grad.nbytes for p in params)  # every parameter got one
    actor.end_iteration()  # the optimizer step: Adam's state exists from now on
    state = actor.engine.optimizer.state.values()
    optimizer = sum(v.nbytes for st in state for v in st.values() if torch.is_tensor(v))
    real = weights_and_grads + optimizer
    assert estimate <= real <= 1.001 * estimate, (real, estimate)
    actor.teardown()


class Holds(Stage):
    """A stage that says it holds ``nbytes`` (what memory_problems adds up)."""

    def __init__(self, name: str, nbytes: int) -> None:
        self.name, self.nbytes = name, nbytes

    def memory(self, device: str, replicas: int, micro_batch: int) -> list[MemoryPart]:
        return [MemoryPart(self.nbytes, "test state")]


def _plan(strategy: str, workflow: Workflow):
    return STRATEGIES.resolve(strategy).plan(workflow, Resources(1), BatchShape(8, 2))


def test_a_worker_holds_the_sum_of_its_stages_or_the_largest_when_they_take_turns():
    """Two stages of 0.6 x this machine's memory each: together they cannot fit, in turns they do."""
    share = int(0.6 * host_memory())
    workflow = Workflow("two").chain(Holds("a", share), Holds("b", share - 1)).role("train", "a")
    (worker,) = worker_memory(workflow, _plan("collocated", workflow))
    assert worker.nbytes == 2 * share - 1
    ((key, message),) = memory_problems(workflow, _plan("collocated", workflow))
    assert key == "trainer.strategy"
    assert f"a {share / GIB:.1f} GiB = test state" in message
    assert f"which has {host_memory() / GIB:.1f} GiB" in message
    assert f"trainer.strategy=collocated_offload (stages take turns: {share / GIB:.1f} GiB)" in message

    (worker,) = worker_memory(workflow, _plan("collocated_offload", workflow))
    assert worker.nbytes == share
    assert memory_problems(workflow, _plan("collocated_offload", workflow)) == []


def test_overlapping_groups_that_take_turns_count_the_largest_worker():
    """The same two stages in overlapping groups (``a`` on slots 0-1, ``b`` on slot 1), all on this
    machine's memory: resident side by side they cannot fit; offloading around their turns, the
    workers taking turns on slot 1 count the larger one (and ``a``'s replica on slot 0 adds its own)."""
    share = int(0.3 * host_memory())
    workflow = Workflow("two").chain(Holds("a", share), Holds("b", 2 * share)).role("train", "a")

    def plan(offload: bool):
        strategy = HybridStrategy(placement="a: 0-1, b: 1", offload=offload)
        return strategy.plan(workflow, Resources(2), BatchShape(8, 2))

    ((key, message),) = memory_problems(workflow, plan(offload=False))  # 0.3 + 0.3 + 0.6
    assert "needs" in message and "shared by 3 workers" in message
    assert memory_problems(workflow, plan(offload=True)) == []  # 0.3 + max(0.3, 0.6)


@pytest.fixture
def huge_model(tiny, tmp_path):
    """A model directory that passes every file check yet declares a model of 153 B parameters
    (2.4 TiB of actor state): the tiny model's tokenizer and config.json grown to 48 layers of
    width 16384, and bfloat16 safetensors shards of at most 4 GiB whose headers name every tensor
    with its shape, their data a hole (sparse files: a few KiB on disk in all; removed after the
    test, since their apparent size is 285 GiB)."""
    out = tmp_path / "huge"
    out.mkdir()
    for f in tiny["sft"].iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("layer_types", None)
    cfg.update(hidden_size=16384, intermediate_size=53248, num_hidden_layers=48, num_attention_heads=128,
               num_key_value_heads=8)  # fmt: skip
    (out / "config.json").write_text(json.dumps(cfg))
    shards: list[dict[str, list[int]]] = [{}]
    for name, shape in config_shapes(out).items():
        if sum(2 * math.prod(s) for s in shards[-1].values()) + 2 * math.prod(shape) > 4 * GIB:
            shards.append({})
        shards[-1][name] = shape
    index = {}
    for i, shard in enumerate(shards):
        header, offset = {}, 0
        for name, shape in shard.items():
            header[name] = {
                "dtype": "BF16",
                "shape": shape,
                "data_offsets": [offset, offset + 2 * math.prod(shape)],
            }
            offset += 2 * math.prod(shape)
        blob = json.dumps(header).encode()
        blob += b" " * (-len(blob) % 8)
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        with open(out / file, "wb") as f:
            f.write(struct.pack("<Q", len(blob)) + blob)
            f.truncate(8 + len(blob) + offset)
        index.update(dict.fromkeys(shard, file))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    yield out
    shutil.rmtree(out)


def test_a_model_too_big_for_this_machine_is_refused_before_anything_loads(
    tiny, huge_model, tmp_path, capsys
):
    """`rlinf fit` run in this process, as tests/test_bad_inputs.py runs it: exit 2, one message
    naming the stages and their GiB against this machine's, no traceback, nothing started."""
    argv = cli_fit_args(tiny, tmp_path, "--trainer.max_iterations=1", f"--policy.model_path={huge_model}")[3:]
    t0 = time.perf_counter()
    try:
        status = main(argv)
    except SystemExit as exc:
        status = exc.code
    elapsed = time.perf_counter() - t0
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.startswith("rlinf") and "Traceback" not in err, err
    problems = [line for line in err.splitlines() if line.startswith("  ")]
    assert len(problems) == 1 and problems[0].startswith("  trainer.strategy: plan 'collocated' needs "), err
    assert f"(CPU memory), which has {host_memory() / GIB:.1f} GiB: actor " in err, err
    assert "153.01 B parameters x " in err and "rollout " in err and "KV cache" in err, err
    assert elapsed < scaled(10), f"took {elapsed:.1f} s"
    assert not (tmp_path / "run").exists()  # nothing written, no worker started
