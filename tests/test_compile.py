"""``trainer.compile``: the actor's forward and backward under ``torch.compile`` train as eager
does (within float32 tolerance), and the compile seconds are reported, each second once. The
actor's test is slow: compiling a model takes tens of seconds on a CPU."""

from __future__ import annotations

import time

import pytest
import torch

from rlinf_lightning.algorithms import GRPO
from rlinf_lightning.engines import HFRolloutEngine
from rlinf_lightning.engines.rollout import SamplingParams
from rlinf_lightning.engines.train import TrainSpec, compile_seconds
from rlinf_lightning.flow.stage import StageContext
from rlinf_lightning.policies import LMPolicy
from rlinf_lightning.workflows.reasoning.actor import ActorStage
from rlinf_lightning.workflows.specs import RolloutSpec, RunSpec
from test_lora import _rollout

#: the samples' temperature (the rollout's)
T08 = RolloutSpec(sampling=SamplingParams(temperature=0.8))


@pytest.mark.slow
def test_a_compiled_actor_trains_as_eager_and_reports_compile_seconds(assets):
    """Gradients of the first iteration within float32 tolerance, then loss and gradient norm of
    each step (the weights themselves are not compared: Adam divides each gradient by its own
    magnitude, so a rounding difference in a near-zero gradient moves that weight by up to 2 x lr)."""
    tok = LMPolicy(str(assets["sft"])).load_tokenizer()
    engine = HFRolloutEngine(str(assets["sft"]))
    batches = [_rollout(engine, tok, seed=s) for s in range(2)]
    results = {}
    for compiled in (False, True):
        spec = TrainSpec("single", compile=compiled)
        actor = ActorStage(LMPolicy(str(assets["sft"]), lr=1e-3), RunSpec(GRPO(), spec), T08)
        actor.setup(StageContext())
        actor.begin_iteration(1)
        metrics, grads = [], None
        for batch in batches:
            actor.process(batch[:8])
            actor.process(batch[8:])
            if grads is None:
                grads = {n: p.grad.clone() for n, p in actor.engine.policy.model.named_parameters()}
            metrics.append(actor.end_iteration().compute())
        results[compiled] = metrics, grads
    (eager, eager_grads), (comp, comp_grads) = results[False], results[True]
    for name, g in eager_grads.items():
        torch.testing.assert_close(comp_grads[name], g, atol=1e-5, rtol=1e-4, msg=name)
    for a, b in zip(eager, comp):
        for key in ("loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    assert comp[0]["compile_s"] > 1.0 and "compile_s" not in eager[0]


def test_compile_seconds_count_a_dynamic_shapes_backward_once():
    """A third shape runs the graph compiled for dynamic shapes at the second, whose backward was
    compiled inside the forward's compile, not lazily: counting Inductor's backward timer too gave
    more compile seconds than the whole loop took (15.2 s in 13.6). Caches off, so it compiles."""
    f = torch.compile(lambda x, w: torch.tanh(x @ w).sum())
    w = torch.randn(8, 8, requires_grad=True)
    with (
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        spent, start = compile_seconds(), time.perf_counter()
        for rows in (3, 5, 7):
            f(torch.randn(rows, 8), w).backward()
        wall, spent = time.perf_counter() - start, compile_seconds() - spent
    assert 0.5 * wall < spent <= wall


@pytest.mark.slow
def test_a_deep_decoders_layers_share_one_compiled_graph(tmp_path):
    """``compile_model`` compiles each of 6 decoder layers, not the whole forward: over three
    micro-batch shapes the layers run two graphs (the first shape's and one with dynamic shapes),
    not one a layer, with eager's log-probs and gradients (float32)."""
    from tensordict import TensorDict
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    from rlinf_lightning.assets import TinyModelConfig, build_tiny_qwen2
    from rlinf_lightning.policies.module import repeated_blocks

    path = str(build_tiny_qwen2(tmp_path / "deep", TinyModelConfig(num_hidden_layers=6)))
    # at each batch's own width: all-ones masks throughout (masked columns added to some widths
    # and not others would give the layers another graph for the mask)
    eager, compiled = LMPolicy(path, pad_to_multiple_of=None), LMPolicy(path, pad_to_multiple_of=None)
    for policy in (eager, compiled):
        policy.configure_model()
    assert repeated_blocks(compiled.model) == list(compiled.model.model.layers)
    compiled.compile_model()
    gen = torch.Generator().manual_seed(0)
    for rows, length in ((3, 20), (4, 28), (2, 24)):
        ids = torch.randint(0, compiled.model.config.vocab_size, (rows, length), generator=gen)
        response = torch.ones(rows, length // 2)
        batch = TensorDict(
            {"input_ids": ids, "attention_mask": torch.ones_like(ids), "response_mask": response}
        )
        out = {}
        for name, policy in (("eager", eager), ("compiled", compiled)):
            policy.model.zero_grad(set_to_none=True)
            logp = policy.forward_logprobs(batch, 1.0)
            logp.sum().backward()
            out[name] = [logp.detach()] + [p.grad for p in policy.model.parameters()]
        for a, b in zip(out["eager"], out["compiled"], strict=True):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)
    cached = torch._dynamo.eval_frame._debug_get_cache_entry_list(Qwen2DecoderLayer.forward.__code__)
    assert len(cached) == 2


def test_the_actor_and_the_critic_compile_their_layers(assets):
    """``compile_model`` wraps each decoder layer's forward (compiling at its first call), not the
    model's: the actor's, and the critic's (whose value network had no forward of its own until
    FSDP2 needed one, so the whole-forward compile compiled nothing of it)."""
    from rlinf_lightning.policies import ValueModel

    for policy, layers in ((LMPolicy(str(assets["sft"])), "model.model.layers"),
                           (ValueModel(str(assets["sft"])), "model.backbone.layers")):  # fmt: skip
        policy.configure_model()
        policy.compile_model()
        blocks = policy.get_submodule(layers)
        assert len(blocks) >= 2 and all("forward" in vars(block) for block in blocks)
        assert "forward" not in vars(policy.model)
