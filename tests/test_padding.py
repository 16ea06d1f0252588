"""Actor micro-batches without padding compute: trimmed and token-budgeted micro-batches give the
update of the padded batch, and compute fewer padded tokens."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from rlinf_lightning.algorithms import GRPO
from rlinf_lightning.engines.rollout import HFRolloutEngine, SamplingParams
from rlinf_lightning.engines.train import SingleTrainEngine
from rlinf_lightning.flow.stage import StageContext
from rlinf_lightning.policies import LMPolicy, ValueModel
from rlinf_lightning.workflows.padding import micro_batches, trim_padding
from rlinf_lightning.workflows.reasoning.actor import PolicyLoss
from rlinf_lightning.workflows.reasoning.rollout import pack_samples

PROMPTS = ["What is 1+2?=", "What is 30+45?=", "What is 7+8?=", "Add 12 and 9, then write the sum: 12+9="]


@pytest.fixture(scope="module")
def batch(assets) -> TensorDict:
    """Real rollouts of prompts of different lengths; responses stop at EOS or after 8 tokens."""
    tok = LMPolicy(str(assets["sft"])).load_tokenizer()
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    completions = HFRolloutEngine(str(assets["sft"])).generate(
        prompts, list(range(4)), 4, SamplingParams(max_new_tokens=8), 0, tok.eos_token_id
    )
    td = TensorDict(pack_samples(prompts, completions, tok.pad_token_id), batch_size=[16])
    td["advantage"] = torch.linspace(-1.0, 1.0, 16)
    assert td["response_mask"].sum(-1).unique().numel() > 1  # responses of several lengths
    return td


def _gradient(
    assets, chunks: list[TensorDict], widths: list | None = None, **policy
) -> tuple[torch.Tensor, dict]:
    """The mean gradient and loss over ``chunks``; ``widths`` collects the width of each forward."""
    engine = SingleTrainEngine()
    engine.setup(LMPolicy(str(assets["sft"]), lr=1e-3, **policy), StageContext(), "32-true")
    if widths is not None:
        engine.policy.model.register_forward_pre_hook(
            lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[-1]), with_kwargs=True
        )
    for chunk in chunks:
        engine.accumulate(chunk, PolicyLoss(GRPO(), 1.0))
    grad = torch.cat([p.grad.reshape(-1) / engine._count for p in engine.policy.parameters()])
    return grad, {"count": engine._count, "loss": engine._loss_sum / engine._count}


def _padded_tokens(chunks: list[TensorDict]) -> int:
    return sum(c["input_ids"].numel() for c in chunks)


def test_trimming_drops_padding_only(batch):
    for chunk in batch.split(4):
        trimmed = trim_padding(chunk)
        assert trimmed["attention_mask"].sum() == chunk["attention_mask"].sum()
        assert trimmed["response_mask"].sum() == chunk["response_mask"].sum()
        assert trimmed["input_ids"].shape[-1] - trimmed["response_mask"].shape[-1] == int(
            trimmed["attention_mask"][:, : -trimmed["response_mask"].shape[-1]].sum(-1).max()
        )  # no prompt column that every row pads


@pytest.mark.parametrize("max_samples,max_tokens", [(4, None), (None, 40), (None, 100), (None, 1)])
def test_trimmed_and_token_budget_micro_batches_give_the_padded_update(
    assets, batch, max_samples, max_tokens
):
    padded_grad, padded = _gradient(assets, list(batch.split(4)))
    chunks = micro_batches(batch, max_samples, max_tokens)
    grad, got = _gradient(assets, chunks)
    assert sum(len(c) for c in chunks) == len(batch)
    assert got["count"] == padded["count"] and got["loss"] == pytest.approx(padded["loss"], abs=1e-6)
    torch.testing.assert_close(grad, padded_grad, rtol=1e-4, atol=1e-6)
    assert _padded_tokens(chunks) < _padded_tokens(list(batch.split(4)))  # less compute
    if max_tokens and max_tokens > 1:  # within the budget (a row longer than it goes alone)
        assert all(c["input_ids"].numel() <= max_tokens or len(c) == 1 for c in chunks)


def test_a_fit_with_a_token_budget_equals_one_by_samples(assets, tmp_path):
    from rlinf_lightning import RLTrainer
    from trainer_defaults import MetricsRecorder, tiny_task, tiny_trainer_kwargs

    def fit(name, **over):
        kw = tiny_trainer_kwargs(tmp_path / name, max_iterations=2, precision="32-true")
        steps = MetricsRecorder()
        trainer = RLTrainer(**{**kw, "callbacks": [steps]})
        task = tiny_task(assets, eval_size=4, format_reward="number_format", **over)
        trainer.fit(LMPolicy(str(assets["sft"]), lr=1e-3), task)
        return steps.metrics

    by_samples = fit("samples", train_micro_batch_size=8)
    by_tokens = fit("tokens", train_micro_batch_size=None, train_max_tokens_per_micro_batch=96)
    assert any(m["actor/grad_norm"] > 0 for m in by_samples)  # the format reward gives a signal
    for a, b in zip(by_samples, by_tokens, strict=True):
        assert b["actor/loss"] == pytest.approx(a["actor/loss"], abs=1e-5)
        assert b["actor/grad_norm"] == pytest.approx(a["actor/grad_norm"], rel=1e-4)


def test_forwards_run_at_a_multiple_of_their_width_with_the_same_update(assets, batch):
    """``policy.pad_to_multiple_of``: the model sees widths that are multiples of 8 (a few shapes,
    each of which a CPU bf16 matmul keeps compiled kernels for), and the loss and gradient equal
    those of forwards at each micro-batch's own width."""
    chunks = micro_batches(batch, 4, None)
    assert any(c["input_ids"].shape[-1] % 8 for c in chunks)  # some need masked columns added
    exact_grad, exact = _gradient(assets, chunks, pad_to_multiple_of=None)
    widths: list[int] = []
    grad, got = _gradient(assets, chunks, widths, pad_to_multiple_of=8)
    assert len(widths) == len(chunks) and all(w % 8 == 0 for w in widths), widths
    assert got["loss"] == pytest.approx(exact["loss"], abs=1e-6)
    torch.testing.assert_close(grad, exact_grad, rtol=1e-4, atol=1e-6)


def test_the_critic_values_a_batch_padded_to_a_multiple_of_8_as_at_its_own_width(assets, batch):
    """``task.critic.pad_to_multiple_of``: the value model's forward adds masked columns on the
    prompts' side, and every response token's value is what it is without them."""
    critic = ValueModel(str(assets["sft"]))
    critic.configure_model()
    torch.manual_seed(0)
    torch.nn.init.normal_(critic.model.head.weight)  # its zero start values every state 0
    chunks = micro_batches(batch, 4, None)
    assert any(c["input_ids"].shape[-1] % 8 for c in chunks)  # some need masked columns added
    widths: list[int] = []
    critic.model.register_forward_pre_hook(lambda module, args: widths.append(args[0].shape[-1]))
    with torch.no_grad():
        for chunk in chunks:
            critic.pad_to_multiple_of = 8
            padded = critic.forward_values(chunk)
            critic.pad_to_multiple_of = None
            exact = critic.forward_values(chunk)
            torch.testing.assert_close(padded, exact, rtol=1e-4, atol=1e-5)
    assert all(w % 8 == 0 for w in widths[::2]) and widths[1::2] == [c["input_ids"].shape[-1] for c in chunks]
