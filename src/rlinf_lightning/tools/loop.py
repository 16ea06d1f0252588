"""The turn loop: multi-turn rollouts as a layer above any rollout engine.

Each sample alternates the policy's turns and its environment's replies::

    prompt | turn 1 <calc>12*34</calc> | reply <res>408</res> | turn 2 408</s>
             ^ generated (loss mask 1)   ^ context only (0)     ^ generated (1)

The loop calls ``engine.generate`` once per turn on the samples still running, with each one's
context so far as its prompt (``n=1`` after the first step), stopping at the end-of-sequence token
or where the turn's decoded text first contains one of the environment's stop strings (a closing
tag: matched on text, since a BPE tokenizer merges it with its neighbours, ``</calc>.`` ending in
the one token ``>.``). The turn is cut exactly after the stop string: when its last token runs past
it (``>.``), that token is replaced by the string's rest re-tokenised (``>``), as context (mask 0,
log-prob 0: the policy did not sample it), so the ids the trainer sees are the ids the engine is
given next. The turn's text up to the stop string is then answered by ``env.step`` (run
abandonably, the steps due at once concurrently: a raise, a timeout or a malformed call becomes an
error reply, counted). A sample ends at its answer (the end-of-sequence token), when its
environment says done, after ``max_turns`` turns, when its response span reaches ``max_tokens``
or a reply does not fit in it (``budget``), or when a turn reaches ``max_new_tokens`` without
ending.

Sampling stays reproducible per sample, whatever the batching: the first step draws as a
single-turn rollout does (group ``g``, sample ``j``), and the ``k``-th later step of a sample draws
from its own stream, a function of ``(seed, g, j, k)`` (:func:`step_group`). Every step of a call to
:meth:`TurnLoop.generate` uses the engine's weights of that moment, so all turns of a sample come
from one policy version (a weight sync lands between calls).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from rlinf_lightning.engines.rollout import Completion, RolloutEngine, SamplingParams
from rlinf_lightning.engines.sampling import end_token_ids, stop_string_end
from rlinf_lightning.flow.metrics import Metrics
from rlinf_lightning.prompts import PromptFormat
from rlinf_lightning.seeds import row_seed
from rlinf_lightning.tools.environment import ToolEnvironment, checked_reset, checked_reward, checked_step
from rlinf_lightning.tools.tool import Outcome, run_abandonable

log = logging.getLogger(__name__)

#: mixed into the seed of a sample's later steps (apart from the first step's stream)
TURN_SEED = 15485863
#: why a sample ended, as counted in ``tools/ended_<why>``
ENDINGS = ("answer", "done", "turns", "budget", "length")
#: the counts a run's summary adds up over its iterations (``tools/<count>``)
COUNTS = ("calls", "errors", "timeouts", "malformed", "replies_cut", *(f"ended_{w}" for w in ENDINGS))
#: the room per reply that the default response budget keeps (``default_budget``): an error reply
#: fits (``<res>error: timed out after 5 s</res>`` is 37 tokens even for a character tokenizer)
REPLY_TOKENS = 64


def default_budget(max_turns: int, max_new_tokens: int) -> int:
    """The response budget when a task sets none: every turn at its longest, and a reply of
    :data:`REPLY_TOKENS` between two turns, so a failed call's error reply reaches the context."""
    return max_turns * max_new_tokens + (max_turns - 1) * REPLY_TOKENS


def step_group(group: int, sample: int, step: int) -> int:
    """The group id under which sample ``sample`` of ``group`` draws its ``step``-th later step
    (with ``n=1``): a per-sample stream independent of which samples share the engine call."""
    return row_seed(TURN_SEED + step, group, sample)


def final_turn(completion: Completion) -> list[int]:
    """The tokens after the last environment reply (all of them without one): the answer."""
    mask = completion.mask or []
    last_reply = max((i for i, m in enumerate(mask) if not m), default=-1)
    return completion.token_ids[last_reply + 1 :]


def environment_factory(spec: dict[str, Any] | None, tools: list[str]) -> Callable[[], Any]:
    """A function building one environment: ``spec``'s ``{class_path, init_args}``, or a
    :class:`ToolEnvironment` with ``tools``. A ``partial``, not a closure: the stage holding it is
    pickled to the workers of the ``processes`` launcher."""
    if spec is None:
        return partial(ToolEnvironment, list(tools))
    module, _, name = spec["class_path"].rpartition(".")
    cls, kwargs = getattr(importlib.import_module(module), name), dict(spec.get("init_args") or {})
    return partial(cls, **kwargs)


def environment_problems(spec: Any, tools: list[str], problem: str | None = None) -> list[tuple[str, str]]:
    """``(key, problem)`` for an environment that cannot be built or breaks its contract (checked
    before any worker starts: the class imports, it has ``step``, an instance builds, and its
    ``reset`` of ``problem``, the first training problem, returns the prompt text), or unknown tools."""
    from rlinf_lightning.tools.tool import TOOLS

    problems = [("tools", TOOLS.unknown_message(t)) for t in tools if t not in TOOLS]
    why = _environment_problem(spec, tools, problem) if spec is not None else None
    return problems + ([("environment", why)] if why else [])


def _environment_problem(spec: Any, tools: list[str], problem: str | None) -> str | None:
    from rlinf_lightning.tools.environment import broken

    if tools:
        return "set task.tools or task.environment, not both (an environment builds its own tools)"
    if not isinstance(spec, dict) or not isinstance(spec.get("class_path"), str):
        return f"must be {{class_path, init_args}}, got {spec!r}"
    if extra := sorted(set(spec) - {"class_path", "init_args"}):
        return (
            f"{extra[0]!r} is not class_path or init_args: an argument of the class goes under "
            f"init_args (--task.environment.init_args.{extra[0]}=...)"
        )
    path = spec["class_path"]
    try:
        factory = environment_factory(spec, tools)
    except (ImportError, AttributeError, ValueError) as exc:
        return f"cannot import {path!r} ({type(exc).__name__}: {exc}); give an importable module.Class"
    try:
        env = factory()
    except Exception as exc:  # noqa: BLE001 - the user's class: any failure is reported by key
        return f"cannot build {path}: {type(exc).__name__}: {exc}"
    if missing := [m for m in ("reset", "step") if not callable(getattr(env, m, None))]:
        return f"{path} has no {' or '.join(missing)} method"
    if problem is None:
        return None
    try:
        text = env.reset(problem)
    except Exception as exc:  # noqa: BLE001
        what = f"{type(env).__qualname__}.reset raised {type(exc).__name__}: {exc}"
        return f"{what} on the first training problem {problem[:60]!r}"
    return None if isinstance(text, str) else broken(env, "reset", text)


@dataclass
class _Sample:
    env: Any
    prompt: list[int]
    group: int
    index: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turn_start: int = 0  # where the current turn began in ``tokens``
    turns: int = 1
    calls: int = 0  # tool calls answered
    steps: int = 0  # engine calls after the first
    pending: str | None = None  # a finished turn waiting for its environment's step
    ended: str = ""


@dataclass
class TurnLoop:
    """Multi-turn generation (see the module docstring).

    Args:
        environment: builds one environment per sample (:func:`environment_factory`).
        max_turns: the policy's turns per sample (a call in the last one gets no reply).
        max_tokens: the response span's budget: generated tokens and replies together.
        timeout_s: how long one ``env.step`` (a tool call) may take before it is abandoned.
    """

    environment: Callable[[], Any]
    max_turns: int
    max_tokens: int
    timeout_s: float = 5.0
    _warned: bool = field(default=False, init=False, repr=False, compare=False)  # of a cut reply

    def generate(
        self,
        engine: RolloutEngine,
        tokenizer: Any,
        prompt_format: PromptFormat,
        problems: list[str],
        groups: list[int],
        n: int,
        params: SamplingParams,
        seed: int,
        metrics: Metrics | None = None,
        answers: list[str] | None = None,
    ) -> tuple[list[list[int]], list[list[Completion]]]:
        """``(prompt_ids, completions)`` as ``engine.generate`` gives them for a single turn, each
        completion's ``mask`` marking the replies (0) among its tokens. With ``answers`` (one per
        problem), a sample whose environment has a ``reward`` method gets
        ``reward(final turn's text, answer)`` as its completion's ``reward``."""
        metrics = metrics if metrics is not None else Metrics()
        for counter in ("calls", "errors", "timeouts", "malformed", "replies_cut"):
            metrics.sum(f"tools/{counter}", 0)
        samples, prompt_ids = [], []
        for problem, group in zip(problems, groups):
            envs = [self.environment() for _ in range(n)]
            texts = [checked_reset(env, problem) for env in envs]  # the first's text is the prompt
            (ids,) = prompt_format.encode(tokenizer, texts[:1])
            prompt_ids.append(ids)
            samples += [_Sample(env, ids, group, j) for j, env in enumerate(envs)]
        stops = tuple(getattr(samples[0].env, "stop", ())) if samples else ()
        ends = end_token_ids(tokenizer)
        first = replace(params, max_new_tokens=min(params.max_new_tokens, self.max_tokens))
        outs = engine.generate(prompt_ids, groups, n, first, seed, ends, stop=stops)
        firsts = (c for cs in outs for c in cs)
        running = [s for s, c in zip(samples, firsts) if self._advance(s, c, tokenizer, stops, ends, params)]
        running = self._answer(running, tokenizer, metrics)
        while running:
            cap = max(self._cap(s, params) for s in running)
            outs = engine.generate(
                [s.prompt + s.tokens for s in running],
                [step_group(s.group, s.index, s.steps) for s in running],
                1,
                replace(params, max_new_tokens=cap),
                seed,
                ends,
                stop=stops,
            )
            for s in running:
                s.steps += 1
            running = [
                s for s, (c,) in zip(running, outs) if self._advance(s, c, tokenizer, stops, ends, params)
            ]
            running = self._answer(running, tokenizer, metrics)
        self._count(samples, metrics)
        completions = [Completion(s.tokens, s.logprobs, s.mask) for s in samples]
        if answers is not None:
            for i, (s, c) in enumerate(zip(samples, completions)):
                reward = getattr(s.env, "reward", None)
                if callable(reward):
                    text = tokenizer.decode(final_turn(c), skip_special_tokens=True)
                    c.reward = checked_reward(s.env, reward(text, answers[i // n]))
        return prompt_ids, [completions[i : i + n] for i in range(0, len(completions), n)]

    def _advance(
        self,
        s: _Sample,
        new: Completion,
        tokenizer: Any,
        stops: tuple[str, ...],
        ends: list[int],
        params: SamplingParams,
    ) -> bool:
        """Append a turn's tokens to ``s`` (cut to its own caps, and after its first stop string),
        marking a finished call as ``pending``; whether ``s`` keeps running."""
        cap = self._cap(s, params)
        tokens, logprobs = new.token_ids[:cap], new.logprobs[:cap]
        called = stop_string_end(tokenizer, tokens, stops)
        if called is not None:
            tokens, logprobs = tokens[:called], logprobs[:called]
        s.tokens += tokens
        s.logprobs += logprobs
        s.mask += [1] * len(tokens)
        if called is not None:
            s.pending = self._cut_after_stop(s, tokenizer, stops)
            return True
        if tokens and tokens[-1] in ends:
            return self._end(s, "answer")
        if len(s.tokens) >= self.max_tokens:
            return self._end(s, "budget")
        return self._end(s, "length")  # the turn used its max_new_tokens without ending

    @staticmethod
    def _cut_after_stop(s: _Sample, tokenizer: Any, stops: tuple[str, ...]) -> str:
        """The turn's text up to the end of its first stop string (what ``env.step`` reads). When
        the turn's last token runs past the string (``>.`` for ``</calc>``), it is replaced by the
        string's rest tokenised alone, as context: the policy sampled ``>.``, not ``>``."""
        text = tokenizer.decode(s.tokens[s.turn_start :], skip_special_tokens=True)
        end = min(text.find(stop) + len(stop) for stop in stops if stop in text)
        if end == len(text):
            return text
        head = tokenizer.decode(s.tokens[s.turn_start : -1], skip_special_tokens=True)
        if not text[:end].startswith(head):  # a token that decodes with its neighbours: kept whole
            return text[:end]
        rest = tokenizer(text[len(head) : end], add_special_tokens=False)["input_ids"]
        del s.tokens[-1], s.logprobs[-1], s.mask[-1]
        s.tokens += rest
        s.logprobs += [0.0] * len(rest)
        s.mask += [0] * len(rest)
        return text[:end]

    def _answer(self, running: list[_Sample], tokenizer: Any, metrics: Metrics) -> list[_Sample]:
        """Run the pending steps of ``running`` at once (each abandoned after ``timeout_s``) and
        append their replies; the samples still running."""
        calling = [s for s in running if s.pending is not None]
        outcomes = run_abandonable([partial(s.env.step, s.pending) for s in calling], self.timeout_s)
        ended = {id(s) for s, out in zip(calling, outcomes) if not self._reply(s, out, tokenizer, metrics)}
        return [s for s in running if id(s) not in ended]

    def _reply(self, s: _Sample, outcome: Outcome, tokenizer: Any, metrics: Metrics) -> bool:
        s.calls, s.pending = s.calls + 1, None
        metrics.sum("tools/calls", 1)
        if outcome.status == "ok":
            reply, done = checked_step(s.env, outcome.value)
            if done:
                return self._end(s, "done")
        else:
            metrics.sum("tools/errors", 1)  # every failed call; timeouts and malformed ones also apart
            if outcome.status == "timeout":
                metrics.sum("tools/timeouts", 1)
            elif outcome.status == "malformed":
                metrics.sum("tools/malformed", 1)
            error = getattr(s.env, "error", None)
            reply = error(outcome.message) if error is not None else f"error: {outcome.message}"
        if s.turns >= self.max_turns:
            return self._end(s, "turns")
        ids = tokenizer(str(reply), add_special_tokens=False)["input_ids"]
        if len(s.tokens) + len(ids) >= self.max_tokens:  # no room left to answer after it
            metrics.sum("tools/replies_cut", 1)
            if not self._warned:
                self._warned = True
                log.warning(
                    "a tool reply of %d tokens did not fit in task.max_response_tokens=%d after a "
                    "%d-token response; the sample ended there unanswered (counted in "
                    "rollout/tools/replies_cut): raise task.max_response_tokens",
                    len(ids), self.max_tokens, len(s.tokens),
                )  # fmt: skip
            return self._end(s, "budget")
        s.tokens += ids
        s.logprobs += [0.0] * len(ids)
        s.mask += [0] * len(ids)
        s.turns, s.turn_start = s.turns + 1, len(s.tokens)
        return True

    def _cap(self, s: _Sample, params: SamplingParams) -> int:
        """How many more tokens ``s`` may generate now: its turn's and its budget's rest."""
        return min(params.max_new_tokens - (len(s.tokens) - s.turn_start), self.max_tokens - len(s.tokens))

    @staticmethod
    def _end(s: _Sample, why: str) -> bool:
        s.ended = why
        return False

    @staticmethod
    def _count(samples: list[_Sample], metrics: Metrics) -> None:
        if not samples:
            return
        metrics.distribution("tools/turns", [s.turns for s in samples])
        metrics.sum("tools/masked_tokens", sum(len(s.mask) - sum(s.mask) for s in samples))
        metrics.mean("tools/calling_share", sum(s.calls > 0 for s in samples) / len(samples), len(samples))
        for why in ENDINGS:
            metrics.sum(f"tools/ended_{why}", sum(s.ended == why for s in samples))

    def evaluate(
        self,
        engine: RolloutEngine,
        tokenizer: Any,
        prompt_format: PromptFormat,
        prompts: list[str],
        answers: list[str],
        reward: str,
        sampling: SamplingParams,
        batch_size: int = 256,
    ) -> tuple[float, float]:
        """Greedy held-out ``(accuracy, share of samples that called a tool)``: the final turn's
        text judged by ``reward``, each turn capped at ``sampling.max_new_tokens``."""
        from rlinf_lightning.rewards import RewardInput, load_reward, score

        judge = load_reward(reward)
        judge.setup()
        greedy = replace(sampling, temperature=0.0)
        correct = calling = 0.0
        for i in range(0, len(prompts), batch_size):
            chunk = prompts[i : i + batch_size]
            _, outs = self.generate(
                engine, tokenizer, prompt_format, chunk, list(range(i, i + len(chunk))), 1, greedy, 0
            )
            texts = [tokenizer.decode(final_turn(cs[0]), skip_special_tokens=True) for cs in outs]
            correct += float(score(judge, RewardInput(texts, answers[i : i + batch_size], chunk)).sum())
            calling += sum(0 in (cs[0].mask or []) for cs in outs)
        return correct / max(1, len(prompts)), calling / max(1, len(prompts))
