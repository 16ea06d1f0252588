"""The LLM pieces on a real pretrained chat model (SmolLM2-135M-Instruct: Llama, BPE, ChatML, tied
head), each checked where a character-level toy model would hide a defect."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from rlinf_lightning.sft import _example
from rlinf_lightning.tasks import MathTask
from rlinf_lightning.tasks.data import Problem

ROOT = Path(__file__).parents[1]


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


def _products(tmp_path) -> dict[str, str]:
    """A small twin-free split of the calculator recipe's products, and its warm-start traces."""
    from rlinf_lightning.tasks.tool_traces import word_traces
    from rlinf_lightning.tasks.word_problems import make_word_problem_splits

    splits = make_word_problem_splits(
        tmp_path / "products", kind="products", n_train=40, n_validation=4, n_test=8
    )
    traces = word_traces([splits["validation"], splits["test"]], tmp_path / "traces.jsonl", per_kind=4)
    return {"train": str(splits["train"]), "test": str(splits["test"]), "traces": str(traces)}


def test_the_smollm2_calculator_recipe_validates(smollm2_dir, tmp_path):
    """configs/math_grpo_smollm2_tools.yaml read as `rlinf fit` reads it (the warm start's output
    replaced by the model itself) passes the trainer's checks with the calculator on; its warm
    start's config passes `rlinf sft`'s, on traces in words whose calls read back from the question."""
    import inspect

    import yaml

    from rlinf_lightning.cli import algorithm_names_as_classes, build_parser, subcommand_parser
    from rlinf_lightning.sft import _sft_problem, run_sft
    from rlinf_lightning.tasks.data import expression_of, load_problems

    data = _products(tmp_path)
    argv = ["fit", f"--config={ROOT / 'configs' / 'math_grpo_smollm2_tools.yaml'}",
            f"--policy.model_path={smollm2_dir}", f"--task.train_path={data['train']}",
            f"--task.test_path={data['test']}", f"--trainer.default_root_dir={tmp_path / 'run'}"]  # fmt: skip
    parser = build_parser()
    init = subcommand_parser(parser, "fit").instantiate(
        parser.parse_args(algorithm_names_as_classes(argv))["fit"]
    )
    assert init.trainer.validate(init.policy, init.task) is not None
    assert init.task.tools == ["calculator"] and init.task.max_turns == 2

    sft = yaml.safe_load((ROOT / "configs" / "math_sft_tools_smollm2.yaml").read_text())
    assert set(sft) <= set(inspect.signature(run_sft).parameters)
    assert (
        sft["prompt_template"]
        == yaml.safe_load((ROOT / "configs" / "math_grpo_smollm2_tools.yaml").read_text())["task"][
            "prompt_template"
        ]
    )  # SFT lays the prompt out as RL will
    keys = ("steps", "batch_size", "eval_size", "tools", "max_turns")
    assert _sft_problem(str(smollm2_dir), data["traces"], data["test"], *(sft[k] for k in keys)) is None
    traces = load_problems(data["traces"])
    assert traces and all(eval(expression_of(p.prompt)) == int(p.answer) for p in traces)


def test_a_smollm2_rollout_calls_the_calculator_and_reads_its_reply(smollm2_dir):
    """The tool loop on the real model and its BPE tokenizer: shown one call in the chat, SmolLM2
    writes ``<calc>348*572</calc>`` itself (13 tokens, the closing tag spelled ``</``, ``calc``,
    ``>``), the turn ends on the tag, the calculator's reply is appended (masked), and the model
    takes a second turn after it."""
    from rlinf_lightning.engines.rollout import HFRolloutEngine, SamplingParams
    from rlinf_lightning.flow.metrics import Metrics
    from rlinf_lightning.prompts import PromptFormat
    from rlinf_lightning.tools.loop import TurnLoop, environment_factory

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    shown = [{"role": "user", "content": "What is 12 times 34?"},
             {"role": "assistant", "content": "<calc>12*34</calc><res>408</res>408"},
             {"role": "user", "content": "What is 348 times 572?"}]  # fmt: skip
    prompt = tok.apply_chat_template(shown, tokenize=False, add_generation_prompt=True)
    loop = TurnLoop(environment_factory(None, ["calculator"]), max_turns=2, max_tokens=64)
    metrics = Metrics()
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16)
    raw = PromptFormat("{prompt}", chat_template=False)  # the chat is laid out above
    _, outs = loop.generate(HFRolloutEngine(str(smollm2_dir)), tok, raw, [prompt], [0], 1, greedy, 0, metrics)
    (c,) = outs[0]
    text = tok.decode(c.token_ids)
    assert text.startswith("<calc>348*572</calc><res>199056</res>"), text
    call = len(tok("<calc>348*572</calc>", add_special_tokens=False)["input_ids"])
    res = len(tok("<res>199056</res>", add_special_tokens=False)["input_ids"])
    # the call sampled (its last token may be the tag's rest re-tokenised, context), the reply
    # masked, then a sampled second turn
    assert c.mask[: call - 1] == [1] * (call - 1) and c.mask[call : call + res] == [0] * res
    assert len(c.token_ids) > call + res and c.mask[-1] == 1
    counts = metrics.compute()
    assert counts["tools/calls"] == 1 and counts["tools/errors"] == 0 and counts["tools/turns"] == 2
