"""Multi-turn rollouts with tools: the calculator, the turn loop's endings and failure replies, the
loss mask with holes (no gradient, no count on tool replies), behaviour log-probs, and a run that
goes on through failing tools."""

from __future__ import annotations

import math
import pickle
import time
from csv import DictReader
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from rlinf_lightning import LMPolicy, RLTrainer
from rlinf_lightning.algorithms import ALGORITHMS
from rlinf_lightning.algorithms.advantages import returns_to_go, token_gae
from rlinf_lightning.cli import main
from rlinf_lightning.engines.rollout import Completion, HFRolloutEngine, RolloutEngine, SamplingParams
from rlinf_lightning.engines.sampling import stop_string_end
from rlinf_lightning.errors import ConfigError
from rlinf_lightning.flow.metrics import Metrics
from rlinf_lightning.prompts import RAW
from rlinf_lightning.tasks.data import load_problems, make_arithmetic_splits, operand_multiset
from rlinf_lightning.tasks.tool_traces import calculator_traces
from rlinf_lightning.tools import Tool, ToolEnvironment, TurnLoop, calculate, environment_factory, final_turn
from rlinf_lightning.workflows.padding import trim_padding
from rlinf_lightning.workflows.reasoning.actor import PolicyLoss
from rlinf_lightning.workflows.reasoning.rollout import pack_samples
from trainer_defaults import MetricsRecorder, scaled, tiny_task, tiny_trainer_kwargs

DIGITS = "rlinf_lightning.testing.DigitTurns"
PROMPTS = ["What is 12+7?=", "What is 3+30?=", "What is 41+5?="]
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=8)


@pytest.fixture(scope="module")
def engine(assets):
    return HFRolloutEngine(str(assets["sft"]))


@pytest.fixture(scope="module")
def tokenizer(assets):
    return LMPolicy(str(assets["sft"])).load_tokenizer()


def _loop(mode="reply", max_turns=3, max_tokens=40, timeout_s=5.0, **env):
    spec = {"class_path": DIGITS, "init_args": {"mode": mode, **env}}
    return TurnLoop(environment_factory(spec, []), max_turns, max_tokens, timeout_s)


def _run(loop, engine, tokenizer, prompts=PROMPTS, groups=None, n=2, sampling=SAMPLING):
    metrics = Metrics()
    groups = list(range(len(prompts))) if groups is None else groups
    ids, comps = loop.generate(engine, tokenizer, RAW, prompts, groups, n, sampling, 0, metrics)
    return ids, comps, metrics.compute()


def _replies(tokenizer, completion) -> list[str]:
    """The texts of a completion's masked runs (the environment's replies)."""
    runs, current = [], []
    for t, m in zip(completion.token_ids, completion.mask):
        if not m:
            current.append(t)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs + ([tokenizer.decode(current)] if current else [])


def test_calculator_computes_arithmetic_and_refuses_everything_else():
    assert [calculate(e) for e in ("12*34", "-(3+4)/2", "7/7", " 2 - -3 ")] == ["408", "-3.5", "1", "5"]
    for bad in ("__import__('os')", "2**3", "a+1", "(1).real", "[1]", "1 if 1 else 2", "", "9" * 201):
        with pytest.raises(ValueError):
            calculate(bad)
    with pytest.raises(ZeroDivisionError):
        calculate("1/0")


@pytest.mark.parametrize(
    ("mode", "counter", "message"),
    [("raise", None, "error: RuntimeError: the tool broke"),
     ("sleep", "tools/timeouts", "error: timed out after 0.2 s"),
     ("malformed", "tools/malformed", "error: MalformedCall: not a call")],
)  # fmt: skip
def test_a_failing_call_gets_an_error_reply_and_is_counted(engine, tokenizer, mode, counter, message):
    """A step that raises, outlives its timeout or reads a malformed call: the policy gets an error
    reply as context and goes on to its next turn; the failure is counted, and nothing hangs."""
    start = time.perf_counter()
    _, comps, metrics = _run(_loop(mode, max_turns=2, timeout_s=0.2, sleep_s=60.0), engine, tokenizer)
    assert time.perf_counter() - start < scaled(30)  # calls that sleep a minute, none waited for
    calls = metrics["tools/calls"]
    assert calls >= 4, metrics  # a digit ends the warm start's first turn in most samples
    assert metrics["tools/errors"] == calls
    if counter:
        assert metrics[counter] == calls
    replies = [r for cs in comps for c in cs for r in _replies(tokenizer, c)]
    # every call is answered, but a call in the last turn has nothing after it to read its reply
    assert len(replies) == calls - metrics["tools/ended_turns"] > 0 and set(replies) == {message}


def test_turn_cap_and_token_budget_end_samples(engine, tokenizer):
    _, comps, metrics = _run(_loop(max_turns=2, max_tokens=40), engine, tokenizer)
    assert metrics["tools/turns_max"] == 2 and metrics["tools/ended_turns"] >= 1, metrics
    for c in (c for cs in comps for c in cs):
        assert len(_replies(tokenizer, c)) <= 1  # a call in the last turn gets no reply
    # a budget of 5: a one-digit turn and its 4-token reply leave no room to answer, so every
    # sample that calls ends there, although 10 turns are allowed
    _, comps, metrics = _run(_loop(max_turns=10, max_tokens=5), engine, tokenizer)
    assert metrics["tools/ended_budget"] >= metrics["tools/calls"] >= 1, metrics
    assert max(len(c.token_ids) for cs in comps for c in cs) <= 5
    _, _, metrics = _run(_loop(done_after=1), engine, tokenizer)
    assert metrics["tools/ended_done"] >= 3 and metrics["tools/turns_max"] == 1, metrics


def test_multi_turn_sampling_does_not_depend_on_the_batch(engine, tokenizer):
    """A sample's turns draw from its own streams: alone or beside others, it is the same (hot
    sampling, so that a later turn drawn from another stream would differ)."""
    hot = SamplingParams(temperature=3.0, max_new_tokens=8)
    _, together, _ = _run(_loop(), engine, tokenizer, n=4, sampling=hot)
    _, apart, _ = _run(_loop(), engine, tokenizer, PROMPTS[1:], [1, 2], n=4, sampling=hot)
    assert [[c.token_ids for c in cs] for cs in together[1:]] == [[c.token_ids for c in cs] for cs in apart]
    assert any(0 in c.mask for cs in apart for c in cs)  # several turns were taken


def _multi_turn_batch(engine, tokenizer) -> TensorDict:
    ids, comps, metrics = _run(_loop(), engine, tokenizer)
    assert metrics["tools/masked_tokens"] > 0
    tensors = pack_samples(ids, comps, tokenizer.pad_token_id)
    return TensorDict(tensors, batch_size=[len(tensors["input_ids"])])


def test_behaviour_logprobs_of_multi_turn_samples_equal_the_actors(assets, engine, tokenizer):
    batch = _multi_turn_batch(engine, tokenizer)
    policy = LMPolicy(str(assets["sft"]))
    policy.configure_model()
    with torch.no_grad():
        actor = policy.forward_logprobs(batch, 1.0)
    mask = batch["response_mask"]
    assert (mask == 0).logical_and(batch["attention_mask"][:, -mask.shape[1] :] == 1).any()  # holes
    torch.testing.assert_close(actor * mask, batch["rollout_logprobs"], atol=2e-4, rtol=0)


def test_tool_reply_tokens_get_no_gradient_and_no_count(assets, engine, tokenizer):
    """The loss over a multi-turn batch: zero gradient on every reply token's log-prob, the token
    count is the generated tokens only, and the reply tokens' advantages change nothing."""
    batch = _multi_turn_batch(engine, tokenizer)
    mask = batch["response_mask"]
    span = batch["attention_mask"][:, -mask.shape[1] :]
    replies = (span == 1) & (mask == 0)
    batch["advantage"] = torch.linspace(0.5, 1.5, mask.numel()).view(mask.shape)  # non-zero everywhere
    policy = LMPolicy(str(assets["sft"]))
    policy.configure_model()
    algorithm = ALGORITHMS.get("grpo")(loss_agg="token-mean")
    logp = policy.forward_logprobs(batch, 1.0).detach().requires_grad_(True)
    loss, count, _ = algorithm.loss(logp, batch["rollout_logprobs"], batch["advantage"], mask)
    (grad,) = torch.autograd.grad(loss, logp)
    assert count == mask.sum() < span.sum()
    assert bool((grad[replies] == 0).all()) and bool((grad[mask == 1] != 0).all())
    # through the actor's loss on the policy: the reply tokens' advantages do not move it
    full = PolicyLoss(algorithm, 1.0)(policy, batch)
    batch["advantage"] = torch.where(replies, 100.0, batch["advantage"])
    again = PolicyLoss(algorithm, 1.0)(policy, batch)
    assert full[1] == count and torch.equal(full[0], again[0])


def test_the_recursions_and_the_reward_skip_tool_replies():
    """With holes in the mask, returns and GAE equal those of the generated tokens alone, the
    reward sits on the last generated token, and trimming keeps the whole span."""
    mask = torch.tensor([[1.0, 1, 0, 0, 1, 1, 0], [1, 0, 1, 0, 0, 0, 0]])
    rewards = torch.tensor([[0.1, 0.2, 5.0, 5.0, 0.3, 1.0, 9.0], [0.5, 7.0, 1.0, 0, 0, 0, 0]])
    values = torch.tensor([[0.4, 0.3, 8.0, 8.0, 0.2, 0.1, 8.0], [0.6, 8.0, 0.5, 0, 0, 0, 0]])
    dense = [torch.tensor([[0.1, 0.2, 0.3, 1.0]]), torch.tensor([[0.5, 1.0]])]
    dense_v = [torch.tensor([[0.4, 0.3, 0.2, 0.1]]), torch.tensor([[0.6, 0.5]])]
    adv, ret = token_gae(rewards, values, mask, gamma=0.9, lam=0.8)
    g = returns_to_go(rewards, mask, 0.9)
    for row, (r, v) in enumerate(zip(dense, dense_v)):
        keep = mask[row] > 0
        a, rt = token_gae(r, v, torch.ones_like(r), gamma=0.9, lam=0.8)
        torch.testing.assert_close(adv[row][keep], a[0])
        torch.testing.assert_close(ret[row][keep], rt[0])
        torch.testing.assert_close(g[row][keep], returns_to_go(r, torch.ones_like(r), 0.9)[0])
        assert bool((adv[row][~keep] == 0).all())
    grpo = ALGORITHMS.get("grpo")()
    placed = grpo.token_rewards(torch.tensor([1.0, 2.0]), mask, None, 0.0)
    assert placed[0, 5] == 1.0 and placed[1, 2] == 2.0 and placed.sum() == 3.0
    attention = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 0, 0, 0, 0]])
    batch = TensorDict(
        {"input_ids": torch.zeros(2, 9, dtype=torch.long), "attention_mask": attention,
         "response_mask": torch.cat([mask[:, :6], torch.zeros(2, 1)], 1)[:, :7]},
        batch_size=[2],
    )  # fmt: skip
    assert trim_padding(batch)["response_mask"].shape[-1] == 6  # the span, past its last 1 (column 5)


#: DigitTurns scoring every other sample 1: each group (of an even size) holds both rewards, so every
#: group carries signal whatever the policy samples and however this CPU rounds
HALVES = """
import itertools

from rlinf_lightning.testing import DigitTurns

_scored = itertools.count()


class RewardedHalves(DigitTurns):
    def reward(self, completion, answer):
        return float(next(_scored) % 2)
"""


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])  # `auto` without / with native bf16
def test_a_run_goes_on_through_failing_tools(assets, tmp_path, monkeypatch, precision):
    """Three iterations, asynchronous (``max_staleness=1``), whose every call sleeps past its
    timeout: the run ends normally (every sample's turns within the staleness bound the actor
    checks), its samples keep their turns, the timeouts are logged, and the actor trains. The
    environment's reward gives every group signal: with the task's, whether a few-prompt
    iteration had any hinged on one machine's numerics (bf16-mixed left the first groups without
    signal on one CPU), which says nothing about the tools."""
    (tmp_path / "halves.py").write_text(HALVES)
    monkeypatch.syspath_prepend(str(tmp_path))
    steps = MetricsRecorder()
    kw = tiny_trainer_kwargs(tmp_path, max_staleness=1, callbacks=[steps], precision=precision)
    trainer = RLTrainer(**kw)
    env = {"class_path": "halves.RewardedHalves", "init_args": {"mode": "sleep", "sleep_s": 2.0}}
    task = tiny_task(assets, environment=env, tool_timeout_s=0.1, eval_size=4)
    summary = trainer.fit(LMPolicy(str(assets["sft"]), lr=1e-3), task)
    assert summary["iterations"] == 3
    calls = sum(m["rollout/tools/calls"] for m in steps.metrics)
    assert summary["tools"]["timeouts"] == summary["tools"]["calls"] == calls > 0, summary["tools"]
    assert {"calling", "tool errors", "replies cut"} <= set(task.headline.values())  # the progress line
    for m in steps.metrics:
        assert m["rollout/tools/timeouts"] == m["rollout/tools/calls"] > 0, m
        assert m["rollout/tools/masked_tokens"] > 0 and math.isfinite(m["actor/loss"]), m
    for m in steps.metrics:  # every group had signal, so every iteration trained
        assert m["reward/reward"] == 0.5 and m["actor/grad_norm"] > 0, m


@pytest.mark.parametrize(
    ("over", "key"),
    [({"tools": ["calculater"]}, "task.tools"),
     ({"tools": ["calculator"], "environment": {"class_path": DIGITS}}, "task.environment"),
     ({"environment": {"class_path": "nowhere.Env"}}, "task.environment"),
     ({"tools": ["calculator"], "max_turns": 0}, "task.max_turns")],
)  # fmt: skip
def test_bad_tool_settings_are_refused_by_key(assets, tmp_path, over, key):
    trainer = RLTrainer(**tiny_trainer_kwargs(tmp_path))
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        trainer.fit(LMPolicy(str(assets["sft"])), tiny_task(assets, **over))


def test_final_turn_is_the_answer_after_the_last_reply(engine, tokenizer):
    _, comps, _ = _run(_loop(), engine, tokenizer)
    for c in (c for cs in comps for c in cs):
        last = max((i for i, m in enumerate(c.mask) if not m), default=-1)
        assert final_turn(c) == c.token_ids[last + 1 :] and all(c.mask[last + 1 :])


#: a user's environment module: answers ``</calc>`` calls with ``<res>0</res>`` and scores a sample
#: by its own rule (the final turn's length, plus 100 when it is the gold answer, plus ``offset``)
GRADED = """
from rlinf_lightning.tools import Environment


class GradedCalls(Environment):
    stop = ("</calc>",)

    def __init__(self, offset=0.0):
        self.offset = offset

    def step(self, turn):
        return "<res>0</res>", False

    def reward(self, completion, answer):
        return self.offset + len(completion) + 100.0 * (completion == answer)
"""


def _graded(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "graded.py").write_text(GRADED)
    monkeypatch.syspath_prepend(str(tmp_path))


def test_an_environments_reward_is_given_the_final_turn_and_the_answer(
    engine, tokenizer, tmp_path, monkeypatch
):
    _graded(tmp_path, monkeypatch)
    loop = TurnLoop(environment_factory({"class_path": "graded.GradedCalls"}, []), 2, 16)
    answers = ["19", "33", "46"]
    _, comps = loop.generate(engine, tokenizer, RAW, PROMPTS, [0, 1, 2], 2, SAMPLING, 0, answers=answers)
    for answer, cs in zip(answers, comps):
        for c in cs:
            text = tokenizer.decode(final_turn(c), skip_special_tokens=True)
            assert c.reward == len(text) + 100.0 * (text == answer)
    _, comps = loop.generate(engine, tokenizer, RAW, PROMPTS, [0, 1, 2], 2, SAMPLING, 0)
    assert all(c.reward is None for cs in comps for c in cs)  # no answers: the task's reward


def test_environment_factories_pickle_for_the_process_launchers_workers(tmp_path, monkeypatch):
    """The rollout stage holding the factory is pickled to each ``processes`` worker (a closure
    here failed every multi-turn run on that launcher)."""
    _graded(tmp_path, monkeypatch)
    for spec, tools in ((None, ["calculator"]), ({"class_path": "graded.GradedCalls"}, [])):
        factory = pickle.loads(pickle.dumps(environment_factory(spec, tools)))
        assert type(factory()) is type(environment_factory(spec, tools)())


def test_an_environments_reward_from_yaml_is_the_samples_reward(assets, tmp_path, monkeypatch):
    """``rlinf fit`` with an environment chosen by ``class_path`` whose ``reward`` is below 0 (the
    task's ``math_verify`` never is): every sample's reward is the environment's, while the
    accuracy is still the task's."""
    _graded(tmp_path, monkeypatch)
    (tmp_path / "env.yaml").write_text(
        "task:\n  tools: []\n  environment:\n    class_path: graded.GradedCalls\n"
        "    init_args: {offset: -1000.0}\n"
    )
    config = Path(__file__).parents[1] / "configs" / "math_grpo_tools_tiny.yaml"
    run = tmp_path / "run"
    status = main([
        "fit", f"--config={config}", f"--config={tmp_path / 'env.yaml'}",
        f"--policy.model_path={assets['sft']}", f"--task.train_path={assets['train']}",
        f"--task.test_path={assets['test']}", f"--trainer.default_root_dir={run}",
        "--trainer.max_iterations=2", "--trainer.eval_every=0", "--trainer.ckpt_every=0",
        "--task.eval_size=4", "--task.rollout_batch_size=16", "--trainer.enable_progress_bar=false",
    ])  # fmt: skip
    assert status == 0
    (csv,) = run.glob("logs/version_*/metrics.csv")
    rows = [row for row in DictReader(csv.open()) if row["reward/reward"]]  # not the eval rows
    assert len(rows) == 2
    for row in rows:
        assert -1000.0 < float(row["reward/reward"]) < 0.0 <= float(row["reward/accuracy"]), row


def test_warm_start_traces_are_easier_than_the_task_and_miss_the_held_out(tmp_path):
    """The calculator recipe's warm-start problems: no product of two three-digit numbers (the task
    is left to RL), none sharing its operands with a held-out problem, every kind present."""
    split = make_arithmetic_splits(
        tmp_path / "hard", n_train=50, n_validation=100, n_test=200, max_value=999, ops="*"
    )
    traces = load_problems(calculator_traces([split["validation"], split["test"]], tmp_path / "traces.jsonl"))
    held_out = {operand_multiset(p.prompt) for s in ("validation", "test") for p in load_problems(split[s])}
    assert 900 < len(traces) <= 1000 and not {operand_multiset(p.prompt) for p in traces} & held_out
    products = [sorted(operand_multiset(p.prompt)) for p in traces if "*" in p.prompt]
    assert all(small < 100 for small, _ in products) and any(big >= 100 for _, big in products)
    assert max(len(p.answer) for p in traces if "*" not in p.prompt) == 7  # long copies: 1999998, -999998


class ScriptedTurns(RolloutEngine):
    """Writes the next of ``turns`` at each call (token ids of real text, a real tokenizer's), up
    to ``max_new_tokens`` and the first stop id as the interface says; its text stop strings are
    left to the loop, which must cut the turn there itself."""

    def __init__(self, tokenizer, turns: list[str]) -> None:
        super().__init__("scripted")
        self.turns = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in turns]

    def generate(self, prompt_ids, groups, n, params, seed, eos_token_id, stop=()):
        ids = self.turns.pop(0)[: params.max_new_tokens]
        stops = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        ids = ids[: next((i + 1 for i, t in enumerate(ids) if t in stops), len(ids))]
        return [[Completion(ids, [-0.5] * len(ids))] for _ in prompt_ids]

    def update_weights(self, named_tensors, *, partial=False):
        raise NotImplementedError


def test_a_closing_tag_merged_with_the_next_character_ends_the_turn(smollm2_dir):
    """SmolLM2's BPE writes ``</calc>.`` as ``</``, ``calc``, ``>.``: the turn ends there (matched on
    the decoded text), cut exactly after the tag (``>.`` becomes ``>``, context the policy did not
    sample), and the call is answered; the opening tag's ``>`` ends nothing."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    call = tok("<calc>12*34</calc>. So", add_special_tokens=False)["input_ids"]
    merged = tok.convert_tokens_to_ids(">.")
    assert merged in call and stop_string_end(tok, call, ("</calc>",)) == call.index(merged) + 1
    opening = tok("<calc>12*34", add_special_tokens=False)["input_ids"]
    assert stop_string_end(tok, opening, ("</calc>",)) is None
    engine = ScriptedTurns(tok, ["<calc>12*34</calc>. So it is", "408<|im_end|>"])
    loop = TurnLoop(environment_factory(None, ["calculator"]), max_turns=2, max_tokens=64)
    metrics = Metrics()
    turn = SamplingParams(max_new_tokens=24)
    _, comps = loop.generate(engine, tok, RAW, ["What is 12*34?"], [0], 1, turn, 0, metrics)
    (c,) = comps[0]
    assert tok.decode(c.token_ids) == "<calc>12*34</calc><res>408</res>408<|im_end|>"
    tag_end = len(tok("<calc>12*34</calc>", add_special_tokens=False)["input_ids"])
    sampled = call[: tag_end - 1]  # the tokens the policy wrote, up to the one it merged
    assert c.token_ids[: tag_end - 1] == sampled and c.mask[: tag_end - 1] == [1] * len(sampled)
    assert c.mask[tag_end - 1] == 0 and c.logprobs[tag_end - 1] == 0.0  # ">", re-tokenised
    assert final_turn(c) == tok("408<|im_end|>", add_special_tokens=False)["input_ids"]
    assert metrics.compute()["tools/calls"] == 1 and metrics.compute()["tools/ended_answer"] == 1


def test_an_error_reply_reaches_the_context_at_the_default_budget(assets, tokenizer, caplog):
    """The shipped tools recipe's turns (2 of up to 24 tokens) with no ``max_response_tokens``:
    a 20-token call that times out gets its 39-token error reply and the policy answers after it.
    A budget with no room for the reply ends the sample there, counted and warned once."""
    turn = SamplingParams(max_new_tokens=24)
    task = tiny_task(assets, tools=["calculator"], max_turns=2, sampling=turn)
    slow = Tool("calculator", lambda arg: time.sleep(30), tag="calc")

    def run(budget: int) -> tuple[list, dict]:
        loop = TurnLoop(lambda: ToolEnvironment([slow]), 2, budget, timeout_s=0.2)
        metrics = Metrics()
        engine = ScriptedTurns(tokenizer, ["<calc>123*456</calc>", "56088</s>"])
        prompts = ["What is 123*456?"] * 2
        _, comps = loop.generate(engine, tokenizer, RAW, prompts, [0, 1], 1, turn, 0, metrics)
        return [c for cs in comps for c in cs], metrics.compute()

    comps, metrics = run(task.turns.max_tokens)
    assert [tokenizer.decode(c.token_ids) for c in comps] == [
        "<calc>123*456</calc><res>error: timed out after 0.2 s</res>56088</s>"
    ] * 2
    assert metrics["tools/ended_answer"] == 2 and metrics["tools/replies_cut"] == 0
    with caplog.at_level("WARNING", logger="rlinf_lightning.tools.loop"):
        comps, metrics = run(48)  # the recipe's budget before: 20 + 39 tokens never fit
    assert metrics["tools/ended_budget"] == metrics["tools/replies_cut"] == 2
    assert all("<res>" not in tokenizer.decode(c.token_ids) for c in comps)
    assert [r.getMessage().count("task.max_response_tokens=48") for r in caplog.records] == [1]
