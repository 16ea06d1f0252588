"""Warm start: a short supervised fine-tune so RL starts from a policy that is sometimes right.

GRPO learns only from groups whose samples disagree; from a policy that is never right every
group is all-zero and nothing is learned. The output directory is a normal ``save_pretrained``
checkpoint and is cached: a second call with the same settings returns at once.

With ``tools``, each problem becomes a multi-turn trace that teaches the call format: the policy
calls a tool on the problem's expression (``<calc>12+7</calc>``), the environment's reply
(``<res>19</res>``, made by the same :class:`~rlinf_lightning.tools.ToolEnvironment` the rollouts
use) is context only, masked out of the loss, and the policy then answers (``19``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from rlinf_lightning.assets import is_model_dir
from rlinf_lightning.errors import InputError
from rlinf_lightning.prompts import PLACEHOLDER, PromptFormat
from rlinf_lightning.tasks.data import Problem, expression_of, load_problems

log = logging.getLogger(__name__)

#: the settings of a warm start with tools only (a plain one's cache ignores them)
TOOL_SETTINGS = ("tools", "max_turns", "max_new_tokens")
#: the prompt's settings: its cache key is the layout they give (none where it is the raw text)
PROMPT_SETTINGS = ("prompt_template", "chat_template", "system_prompt")


def run_sft(
    base_model: str = "artifacts/tiny-qwen2",
    train_path: str = "data/arithmetic/train.jsonl",
    test_path: str = "data/arithmetic/test.jsonl",
    output_dir: str = "artifacts/tiny-qwen2-sft",
    steps: int = 120,
    batch_size: int = 64,
    lr: float = 1e-3,
    seed: int = 0,
    eval_size: int = 500,
    num_threads: int = 0,
    force: bool = False,
    tools: list[str] | None = None,
    max_turns: int = 2,
    max_new_tokens: int = 16,
    prompt_template: str = "{prompt}",
    chat_template: bool = True,
    system_prompt: str | None = None,
) -> dict:
    """Fine-tune ``base_model`` on prompt -> answer pairs (loss on the answer tokens) and save it.

    A π0 ``base_model`` (config.json ``model_type: pi0``) is fine-tuned with its flow-matching loss
    instead (:func:`~rlinf_lightning.policies.pi0.sft.run_pi0_sft`): ``train_path`` is then a
    demonstration file (``policies/pi0/demos.py`` documents the format), ``test_path`` held-out
    demonstrations (their loss is reported; a path not ending in ``.safetensors`` is ignored).

    Args:
        base_model: ``from_pretrained`` directory to start from.
        train_path: JSONL problems to imitate.
        test_path: JSONL held-out problems; greedy accuracy on them is reported.
        output_dir: where the fine-tuned model (and tokenizer) are saved.
        steps: optimizer steps.
        batch_size: problems per step.
        lr: AdamW learning rate.
        seed: data order and initialisation seed.
        eval_size: held-out problems to evaluate on.
        num_threads: torch threads (0 leaves the default).
        force: retrain even if ``output_dir`` holds a result with the same settings.
        tools: train on tool-use traces with these tools (registry ``rlinf_lightning.tools.TOOLS``,
            e.g. ``[calculator]``), replies masked; evaluated with them (``docs/tools.md``).
        max_turns: with ``tools``, the turns per sample when evaluating.
        max_new_tokens: with ``tools``, the longest turn when evaluating.
        prompt_template: the prompt around each problem, ``{prompt}`` marking the problem text;
            as the task's key of the same name, so that RL starts on the layout SFT taught.
        chat_template: wrap prompts in the tokenizer's chat template when it has one (chat
            models; the answer then ends the assistant's turn); as the task's key.
        system_prompt: the chat's system message (``None``: the chat template's default).
    """
    settings = {
        k: v
        for k, v in locals().items()
        if k not in ("force", "num_threads", *PROMPT_SETTINGS) and (tools or k not in TOOL_SETTINGS)
    }
    if problem := _sft_problem(
        base_model, train_path, test_path, steps, batch_size, eval_size, tools, max_turns
    ):
        raise InputError(problem)
    if _is_pi0(base_model):
        from rlinf_lightning.policies.pi0.sft import run_pi0_sft

        if num_threads:
            torch.set_num_threads(num_threads)
        held_out = test_path if str(test_path).endswith(".safetensors") else None
        return run_pi0_sft(base_model, train_path, output_dir, steps, batch_size, lr, seed, held_out)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlinf_lightning.engines.rollout import HFRolloutEngine, SamplingParams
    from rlinf_lightning.evaluation import greedy_accuracy
    from rlinf_lightning.tools import ToolEnvironment, TurnLoop
    from rlinf_lightning.tools.loop import default_budget

    prompt = PromptFormat(prompt_template, chat_template, system_prompt)
    if problems := prompt.problems():
        raise InputError(f"--prompt_template: {problems[0]}")
    if is_model_dir(base_model):  # the layout, where it is not the raw text (older caches' layout)
        layout = prompt.render(AutoTokenizer.from_pretrained(base_model), PLACEHOLDER)
        settings.update({"prompt_layout": layout} if layout != PLACEHOLDER else {})
    train = load_problems(train_path)
    # the cache holds for the same problems, not only the same path: `rlinf prepare` rewrites data
    # split by an older rule in place
    pairs = json.dumps([[p.prompt, p.answer] for p in train]).encode()
    settings["train_sha1"] = hashlib.sha1(pairs).hexdigest()
    out = Path(output_dir)
    meta = out / "sft_settings.json"
    if not force and is_model_dir(out) and meta.is_file():
        cached = json.loads(meta.read_text())
        if cached.get("settings") == settings:
            log.info("sft: cached result in %s (held-out accuracy %.3f)", out, cached["eval_accuracy"])
            return cached
    if num_threads:
        torch.set_num_threads(num_threads)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = AutoTokenizer.from_pretrained(base_model)
    model = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    test = load_problems(test_path)[:eval_size]
    env = ToolEnvironment(list(tools)) if tools else None
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        batch = [train[rng.randrange(len(train))] for _ in range(batch_size)]
        rows = [_example(tok, prompt, p, env) for p in batch]
        width = max(len(seq) for seq, _ in rows)
        ids = torch.full((batch_size, width), tok.pad_token_id)
        labels = torch.full((batch_size, width), -100)
        mask = torch.zeros((batch_size, width), dtype=torch.long)
        for i, (seq, target) in enumerate(rows):
            ids[i, width - len(seq) :] = torch.tensor(seq)
            labels[i, width - len(seq) :] = torch.tensor(target)
            mask[i, width - len(seq) :] = 1
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        loss = model(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 20 == 0 or step == steps:
            log.info("sft step %d/%d loss %.4f", step, steps, loss.item())
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    engine = HFRolloutEngine(str(tmp))
    prompts, golds = [p.prompt for p in test], [p.answer for p in test]
    result = {"settings": settings}
    if env is None:
        acc = greedy_accuracy(engine, tok, prompts, golds, prompt_format=prompt)
    else:
        budget = default_budget(max_turns, max_new_tokens)
        loop = TurnLoop(lambda: ToolEnvironment(list(tools)), max_turns, budget)
        acc, calling = loop.evaluate(
            engine, tok, prompt, prompts, golds, "math_verify", SamplingParams(max_new_tokens=max_new_tokens)
        )
        result["eval_calling_share"] = calling
    result.update(eval_accuracy=acc, train_s=time.perf_counter() - t0)
    (tmp / "sft_settings.json").write_text(json.dumps(result, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log.info("sft: held-out accuracy %.3f on %d problems; saved to %s", acc, len(test), out)
    return result


def _example(tok: Any, prompt: PromptFormat, problem: Problem, env: Any) -> tuple[list[int], list[int]]:
    """``(token ids, labels)`` of one problem: the prompt as ``prompt`` lays it out (label -100),
    then the answer and the end of sequence (of the assistant's turn, in a chat template); with a
    tool environment ``env``, first a call on the problem's expression and the environment's
    reply to it (label -100: context, not imitated)."""
    ids = prompt.encode(tok, [problem.prompt])[0]
    labels = [-100] * len(ids)
    if env is not None:
        tag = next(iter(env.tools))
        call = tok(f"<{tag}>{expression_of(problem.prompt)}</{tag}>", add_special_tokens=False)["input_ids"]
        reply, _ = env.step(tok.decode(call))
        reply_ids = tok(reply, add_special_tokens=False)["input_ids"]
        ids, labels = ids + call + reply_ids, labels + call + [-100] * len(reply_ids)
    answer = tok(problem.answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return ids + answer, labels + answer


def _sft_problem(
    base_model: str,
    train_path: str,
    test_path: str,
    steps: int,
    batch_size: int,
    eval_size: int,
    tools: list[str] | None,
    max_turns: int,
) -> str | None:
    """The first bad input of ``rlinf sft``, as one line naming its option, before any model loads:
    the numbers, the tools, the base model's directory and the data files (read here: a bad
    record fails now, naming its file and line)."""
    from rlinf_lightning.tools.tool import TOOLS

    for key, value in (("steps", steps), ("batch_size", batch_size), ("eval_size", eval_size),
                       ("max_turns", max_turns)):  # fmt: skip
        if value < 1:
            return f"--{key}: must be >= 1, got {value}"
    for tool in tools or []:
        if tool not in TOOLS:
            return f"--tools: {TOOLS.unknown_message(tool)}"
    if not is_model_dir(base_model):
        return f"--base_model {base_model}: not a model directory (no config.json); run `rlinf prepare` first"
    pi0 = _is_pi0(base_model)
    # a π0's held-out demonstrations are optional (a test_path not ending in .safetensors is ignored)
    paths = [("train_path", train_path)] + [("test_path", test_path)] * (
        not pi0 or test_path.endswith(".safetensors")
    )
    for key, path in paths:
        if not any(ch in str(path) for ch in "*?[") and not Path(path).is_file():
            return f"--{key} {path}: no such file"
        try:
            if pi0:
                from rlinf_lightning.policies.pi0.demos import load_demos

                load_demos(path)
            else:
                load_problems(path)
        except InputError as exc:
            return f"--{key} {exc}"
    return None


def _is_pi0(path: str) -> bool:
    config = Path(path) / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("model_type") == "pi0"


def record_expert_demos(
    env: str = "FetchReachDense-v4",
    episodes: int = 64,
    chunk: int = 8,
    out: str = "data/fetchreach_demos.safetensors",
    seed: int = 0,
    env_kwargs: dict | None = None,
) -> dict:
    """Write demonstrations of ``env``'s scripted expert for π0's SFT (``rlinf demos``; the format
    is documented in ``policies/pi0/demos.py``).

    Args:
        env: an env with a scripted expert (``policies.pi0.demos.EXPERTS``).
        episodes: one episode per env, env ``i`` reset with ``seed + i``.
        chunk: actions per row (at least the policy's ``task.chunk``; π0's ``chunk_size`` at most).
        out: the ``.safetensors`` file written.
        seed: the first episode's reset seed.
        env_kwargs: keyword arguments of the env factory (PickCube-v1's expert:
            ``{"obs_mode": "state", "control_mode": "pd_ee_delta_pos"}``).
    """
    from rlinf_lightning.envs import make_env
    from rlinf_lightning.policies.pi0.demos import EXPERTS, record_demos
    from rlinf_lightning.registry import load_plugins

    load_plugins()  # plugins add experts for their envs (rlinf-maniskill: PickCube-v1)
    if env not in EXPERTS:
        raise InputError(
            f"--env {env}: no scripted expert for it (there is one for {', '.join(sorted(EXPERTS))})"
        )
    for key, value in (("episodes", episodes), ("chunk", chunk)):
        if value < 1:
            raise InputError(f"--{key}: must be >= 1, got {value}")
    batch = make_env(env, episodes, **(env_kwargs or {}))
    return record_demos(batch, EXPERTS[env], chunk, out, seed=seed, env=env)
