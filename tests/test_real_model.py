"""The LLM pieces on a real pretrained chat model (SmolLM2-135M-Instruct: Llama, BPE, ChatML, tied
head), each checked where a character-level toy model would hide a defect."""

from __future__ import annotations

from transformers import AutoTokenizer

from rlinf_lightning.sft import _example
from rlinf_lightning.tasks import MathTask
from rlinf_lightning.tasks.data import Problem


def test_sft_lays_examples_out_as_the_task_lays_out_rollout_prompts(smollm2_dir, tmp_path):
    """`rlinf sft` imitates the answer after the prompt in the chat template (the task's default
    layout, so RL starts on what SFT taught), the answer closing the assistant's turn."""
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    task = MathTask(str(tmp_path / "train.jsonl"), str(tmp_path / "test.jsonl"))
    problem = Problem("What is 12 + 30?", "42")
    prompt = task.prompt_format.encode(tok, [problem.prompt])[0]
    assert tok.decode(prompt).endswith("user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n")
    ids, labels = _example(tok, task.prompt_format, problem, None)
    assert ids[: len(prompt)] == prompt and labels[: len(prompt)] == [-100] * len(prompt)
    assert tok.decode(ids[len(prompt) :]) == "42<|im_end|>" and labels[len(prompt) :] == ids[len(prompt) :]
