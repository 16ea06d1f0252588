"""The real-LLM data path: Parquet datasets (Hugging Face ``datasets``), the task's prompt template
and the tokenizer's chat template, and the chat recipe config run end to end on a tiny model saved in
Qwen2.5-Instruct's layout."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from datasets import Dataset
from transformers import AutoTokenizer

from rlinf_lightning.assets import TinyModelConfig, build_tiny_qwen2
from rlinf_lightning.errors import DataError
from rlinf_lightning.prompts import PromptFormat
from rlinf_lightning.tasks.data import Problem, load_problems
from trainer_defaults import logged_metrics

ROOT = Path(__file__).parents[1]
GSM8K = [
    {"question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
     "answer": f"He has {a} + {b} = {a + b} apples.\n#### {a + b}"}
    for a, b in [(3, 4), (10, 5), (7, 8), (1, 1), (12, 30), (6, 6), (9, 2), (4, 20)]
]  # fmt: skip
MATH = [{"problem": "What is $2^3$?", "solution": "We have $2^3 = \\boxed{8}$."}]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    """A tiny Qwen2 laid out as a chat checkpoint: Qwen2Tokenizer, ChatML template, EOS <|im_end|>."""
    path = tmp_path_factory.mktemp("chat") / "Qwen2.5-tiny-Instruct"
    return build_tiny_qwen2(path, TinyModelConfig(max_position_embeddings=512), chat=True)


@pytest.fixture(scope="module")
def warm_chat_model(chat_model, tmp_path_factory) -> Path:
    """The chat checkpoint after a short supervised warm start on GSM8K's answers, each question
    laid out exactly as the chat recipe lays it out (its prompt template in the ChatML template):
    a policy that is sometimes right, so GRPO's groups disagree and the update is not zero."""
    import yaml

    from rlinf_lightning.sft import run_sft

    task = yaml.safe_load((ROOT / "configs" / "math_grpo_qwen2.5_instruct.yaml").read_text())["task"]
    root = tmp_path_factory.mktemp("warm_chat")
    data = root / "gsm8k.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in GSM8K))
    run_sft(
        str(chat_model), str(data), str(data), str(root / "model"), steps=80, batch_size=8, eval_size=8,
        prompt_template=task["prompt_template"], system_prompt=task["system_prompt"],
    )  # fmt: skip
    return root / "model"


def _parquet(records: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Dataset.from_list(records).to_parquet(str(path))
    return path


def test_parquet_reads_like_jsonl_in_every_form(tmp_path):
    jsonl = tmp_path / "all.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in GSM8K + MATH))
    expected = load_problems(jsonl)
    assert expected[0] == Problem(GSM8K[0]["question"], "7") and expected[-1].answer == "8"

    # a split as a dataset snapshot from the Hub lays it out: main/train-0000N-of-0000M.parquet
    split = tmp_path / "gsm8k" / "main"
    _parquet(GSM8K[:5], split / "train-00000-of-00003.parquet")
    _parquet(GSM8K[5:], split / "train-00001-of-00003.parquet")
    _parquet(MATH, split / "train-00002-of-00003.parquet")  # a file has one layout (one schema)
    assert load_problems(split / "train-*.parquet") == expected
    assert load_problems(split) == expected  # a directory of Parquet files
    assert load_problems(split / "train-00000-of-00003.parquet") == expected[:5]


def test_bad_parquet_records_name_file_and_record(tmp_path):
    no_gold = _parquet([GSM8K[0], {"question": "q", "answer": None}], tmp_path / "no_gold.parquet")
    with pytest.raises(DataError, match=r"no_gold.parquet: record 2: no gold answer"):
        load_problems(no_gold)
    layout = _parquet([{"text": "q", "label": "1"}], tmp_path / "layout.parquet")
    with pytest.raises(DataError, match=r"layout.parquet: record 1: unrecognised keys \['label', 'text'\]"):
        load_problems(layout)
    truncated = tmp_path / "truncated.parquet"
    truncated.write_bytes(_parquet(GSM8K, tmp_path / "ok.parquet").read_bytes()[:-40])
    with pytest.raises(DataError, match=r"truncated.parquet: not a readable Parquet file"):
        load_problems(truncated)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"a directory with no .parquet files"):
        load_problems(tmp_path / "empty")


def test_prompt_template_and_chat_template(chat_model, assets):
    chat = AutoTokenizer.from_pretrained(chat_model)
    plain = AutoTokenizer.from_pretrained(assets["base"])  # the character tokenizer: no chat template
    fmt = PromptFormat("{prompt}\nPut the final answer within \\boxed{}.")
    user = "What is 2+3?\nPut the final answer within \\boxed{}."  # braces other than {prompt} literal
    assert fmt.text("What is 2+3?") == user
    assert fmt.render(chat, "What is 2+3?") == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = fmt.encode(chat, ["What is 2+3?"])[0]
    im_start, im_end = chat.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids.count(im_start) == 3 and ids.count(im_end) == 2  # turn markers are single tokens
    system = PromptFormat(system_prompt="Answer with a number.").render(chat, "1+1?")
    assert system.startswith("<|im_start|>system\nAnswer with a number.<|im_end|>\n")
    assert PromptFormat(chat_template=False).render(chat, "1+1?") == "1+1?"
    assert fmt.render(plain, "What is 2+3?") == user  # no chat template: the text as it is
    assert PromptFormat("Solve.").problems() and not fmt.problems()


def test_rollout_stage_generates_from_the_chat_prompt(chat_model):
    from tensordict import TensorDict

    from rlinf_lightning.engines.rollout import SamplingParams
    from rlinf_lightning.flow.stage import StageContext
    from rlinf_lightning.policies import LMPolicy
    from rlinf_lightning.workflows.reasoning.rollout import RolloutStage
    from rlinf_lightning.workflows.specs import RolloutSpec, RunSpec

    fmt = PromptFormat("{prompt} Answer:")
    spec = RolloutSpec(sampling=SamplingParams(max_new_tokens=4), prompt_format=fmt)
    stage = RolloutStage(LMPolicy(str(chat_model)), RunSpec(), spec)
    stage.setup(StageContext())
    batch = TensorDict({"prompt": ["1+1?"], "answer": ["2"], "group_id": [0]}, batch_size=[1])
    out = stage.process(batch)
    tok = stage.tokenizer
    prompt = tok.decode(out["input_ids"][0, : -out["response_mask"].shape[-1]], skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>user\n1+1? Answer:<|im_end|>\n<|im_start|>assistant\n")
    assert prompt.startswith("<|im_start|>system\n")


@pytest.mark.slow  # 72 s in CI: parquet, the chat template and its rollout stay in the tests above
def test_gsm8k_parquet_with_a_chat_model_runs_the_chat_recipe(warm_chat_model, tmp_path):
    """configs/math_grpo_qwen2.5_instruct.yaml as shipped, pointed at the (warm-started) tiny chat
    checkpoint and a GSM8K-layout Parquet split, with the rollout engine and sizes of this CPU."""
    split = tmp_path / "gsm8k" / "main"
    _parquet(GSM8K, split / "train-00000-of-00001.parquet")
    _parquet(GSM8K[:4], split / "test-00000-of-00001.parquet")
    run = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "rlinf_lightning.cli", "fit",
        f"--config={ROOT / 'configs' / 'math_grpo_qwen2.5_instruct.yaml'}",
        f"--policy.model_path={warm_chat_model}",
        f"--task.train_path={split / 'train-*.parquet'}", f"--task.test_path={split / 'test-*.parquet'}",
        "--task.rollout=hf", "--task.rollout_engine_options={}", "--trainer.accelerator=cpu",
        "--trainer.max_iterations=2",
        "--task.group_size=4", "--task.rollout_batch_size=16", "--task.train_micro_batch_size=8",
        "--task.sampling.max_new_tokens=8", "--trainer.eval_every=0", "--trainer.ckpt_every=0",
        "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={run}", "--trainer.timeout_s=120",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = logged_metrics(run)
    iterations = {s: m for s, m in metrics.items() if "actor/loss" in m}
    assert sorted(iterations) == [1, 2]
    rewards = {s: float(m["reward/reward"]) for s, m in iterations.items()}
    for m in iterations.values():
        assert math.isfinite(float(m["actor/loss"])) and 0 < float(m["rollout/response_length"]) <= 8
        # a gradient exactly when some group's samples disagree (GRPO's advantage is zero otherwise)
        assert (float(m["actor/grad_norm"]) > 0) == (float(m["advantage/groups_with_signal"]) > 0)
    # the warm start is sometimes right through the recipe's prompts: rewards, and an update
    assert any(0 < r < 1 for r in rewards.values()), rewards
    assert max(float(m["actor/grad_norm"]) for m in iterations.values()) > 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval_problems"] == 4
