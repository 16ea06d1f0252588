import itertools
import logging
import sys
import time

import pytest
import torch

from rlinf_lightning.rewards import REWARDS, MathVerify, Reward, RewardInput, final_answer, load_reward, score
from trainer_defaults import scaled


def _math_verify(completion: str, gold: str, timeout_s: float = 5.0) -> float:
    return MathVerify(timeout_s)(RewardInput([completion], [gold]))[0]


@pytest.mark.parametrize(
    "completion, gold, expected",
    [
        ("46", "46", 1.0),
        ("45", "46", 0.0),
        ("46.0", "46", 1.0),
        ("\\boxed{46}", "46", 1.0),
        ("", "46", 0.0),
        ("x", "46", 0.0),
        ("\\frac{1}{2}", "0.5", 1.0),
    ],
)
def test_math_verify(completion, gold, expected):
    assert _math_verify(completion, gold) == expected


QUESTION = "What is 37 + 48?"
#: completions that restate the question (the first as SmolLM2 wrote it under a math-verify that
#: read the whole text, which evaluated its "37 + 48" to 85) and anchored answers copied from it
RESTATED = [
    "To add 37 + 48, we need to follow the order of operations: parentheses, exponents",
    "37 + 48",
    "The answer is 37 + 48.",
    "\\boxed{37 + 48}",
]
ANSWERED = [
    "To add 37 + 48, we add the tens and then the ones, so the answer is 85",
    "\\boxed{85}",
    "85",  # the tiny recipe's bare numbers
    "37 + 48 = 85",
    "Answer: **85**.",
]


@pytest.mark.parametrize("name", ["math_verify", "exact_match"])
def test_correctness_rewards_read_the_final_answer_not_the_question(name):
    reward = load_reward(name)
    batch = RewardInput(RESTATED + ANSWERED, ["85"] * 9, [QUESTION] * 9)
    assert score(reward, batch).tolist() == [0.0] * len(RESTATED) + [1.0] * len(ANSWERED)


@pytest.mark.parametrize(
    "completion, text, form",
    [("so \\boxed{\\frac{1}{2}} and 7", "\\frac{1}{2}", "boxed"),
     ("The answer is 3.5. Check: 7/2", "3.5", "marker"),
     ("The answer is 41 + 42 = 83, as", "83", "marker"),
     ("#### 1,234", "1,234", "marker"),
     ("59 + 63 = 1,220.", "1220", "number"),
     ("half: \\frac{1}{2}", "\\frac{1}{2}", "number"),
     ("\\boxed{12", "12", "number"),  # a box never closed (cut by the budget) answers nothing
     ("no idea", None, None)],
)  # fmt: skip
def test_the_final_answer_is_boxed_else_after_a_marker_else_the_last_number(completion, text, form):
    answer = final_answer(completion)
    assert (answer and answer.text, answer and answer.form) == (text, form)


def test_format_rewards_are_functions_scored_one_completion_at_a_time():
    batch = RewardInput(["12", "12 apples", "so \\boxed{3}"], ["", "", ""])
    assert score(load_reward("number_format"), batch).tolist() == [1.0, 0.0, 0.0]
    assert score(load_reward("boxed_format"), batch).tolist() == [0.0, 0.0, 1.0]


def test_plugins_extend_the_same_registry_with_functions_or_reward_objects():
    @REWARDS.register("test_len_reward")
    def length(completion: str, answer: str) -> float:
        return float(len(completion))

    @REWARDS.register("test_short_reward")
    class Short(Reward):
        """1.0 for responses of at most as many tokens as the prompt has words; set up once."""

        def setup(self) -> None:
            self.ready = True

        def __call__(self, batch: RewardInput) -> torch.Tensor:
            assert self.ready
            words = torch.tensor([len(p.split()) for p in batch.prompts])
            batch.metrics.sum("short", (batch.response_lengths <= words).sum())
            return (batch.response_lengths <= words).float()

    assert score(load_reward("test_len_reward"), RewardInput(["abc"], [""])).tolist() == [3.0]
    short = load_reward("test_short_reward")
    short.setup()
    batch = RewardInput(["a", "b"], ["", ""], ["two words", "two words"], torch.tensor([1, 5]))
    assert score(short, batch).tolist() == [1.0, 0.0] and batch.metrics.compute() == {"short": 1.0}
    assert ("test_len_reward", "built-in", "") in REWARDS.describe() and "test_short_reward" in REWARDS


def test_a_reward_with_the_wrong_number_of_scores_is_named():
    class Wrong(Reward):
        def __call__(self, batch):
            return [1.0]

    with pytest.raises(ValueError, match="reward Wrong returned 1 scores for 2 completions"):
        score(Wrong(), RewardInput(["a", "b"], ["", ""]))


PATHOLOGICAL = "\\boxed{9^{9^{9^{9}}}}"  # sympy evaluates 9^387420489 for minutes without a timeout
#: which sum of _slow_pair's the next call parses: sympy caches what it built, so a sum it has
#: parsed before in this process takes milliseconds, not seconds, and would not time out
_SLOW_SUMS = itertools.count()


def _slow_pair() -> tuple[str, str]:
    """A sum math-verify takes seconds to parse (9 s here), as completion and as gold (two slow
    parses), over symbols this process has not parsed before."""
    base = 800 * next(_SLOW_SUMS)
    gold = "\\boxed{" + "+".join(f"x_{{{i}}}^{{2}}" for i in range(base, base + 800)) + "}"
    return gold.replace("x_", "z_"), gold


def _timed_calls() -> tuple[list[float], float, dict[str, float], float, float]:
    """Scores, seconds and counts of a pathological completion (1 s timeout) and of two slow parses
    (2 s timeout), and the next completion's score."""
    inputs = RewardInput([PATHOLOGICAL], ["1"])
    t0 = time.monotonic()
    bad = MathVerify(timeout_s=1)(inputs)
    took = time.monotonic() - t0
    completion, gold = _slow_pair()
    slow = RewardInput([completion], [gold], metrics=inputs.metrics)
    t0 = time.monotonic()
    bad += MathVerify(timeout_s=2)(slow)
    took_slow = time.monotonic() - t0
    return bad, took, inputs.metrics.compute(), took_slow, _math_verify("\\boxed{7}", "7", timeout_s=1)


@pytest.mark.parametrize("where", ["main thread", "worker thread", "worker process"])
def test_math_verify_times_out_within_the_bound_anywhere_and_counts_it(where):
    """A completion scores 0.0 within its timeout wherever the reward runs, however many parses
    and comparisons it needs (math-verify's own timeouts apply to each: two slow parses took twice
    the bound), is counted as a timeout, and the next call still works (off the main thread a stuck
    judge process is replaced)."""
    import concurrent.futures

    if where == "main thread":
        bad, took, counts, took_slow, good = _timed_calls()
    else:
        import functools
        import multiprocessing

        # a worker process from the fork server, as the processes launcher's: forked from the test
        # run itself (ray's and torch's threads running), one died abruptly in a full-suite run
        pool_cls = {
            "worker thread": concurrent.futures.ThreadPoolExecutor,
            "worker process": functools.partial(
                concurrent.futures.ProcessPoolExecutor, mp_context=multiprocessing.get_context("forkserver")
            ),
        }[where]
        with pool_cls(1) as pool:
            pool.submit(_math_verify, "1", "1").result(timeout=120)  # start-up not timed
            bad, took, counts, took_slow, good = pool.submit(_timed_calls).result(timeout=scaled(60))
    assert (bad, good) == ([0.0, 0.0], 1.0)
    assert counts == {"timeouts": 2.0, "unparsed_gold": 0.0}
    assert took < scaled(1.9), f"{took:.1f} s"
    assert took_slow < scaled(2.9), f"{took_slow:.1f} s"


def test_a_deadline_lost_in_a_finalizer_is_raised_again(monkeypatch):
    """The timeout's exception is dropped when its signal lands in a ``__del__`` or a weakref
    callback (CI: one in torch's let a 1 s judgement run 38 s); the deadline raises again until
    it lands where it propagates."""
    from rlinf_lightning.judge import _Deadline, _deadline

    def busy(seconds):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass

    class SlowToFree:
        def __del__(self):
            busy(0.12)  # the first expiry lands in here and is printed as "ignored"

    lost = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: lost.append(u.exc_type))
    t0 = time.monotonic()
    with pytest.raises(_Deadline):
        with _deadline(0.05):
            while time.monotonic() - t0 < 10:
                SlowToFree()
                busy(0.12)
    assert time.monotonic() - t0 < 5 and _Deadline in lost


def _in_a_thread(fn, *args):
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args).result(timeout=120)


def test_math_verify_scores_a_micro_batch_off_the_main_thread():
    """Off the main thread a micro-batch goes to the judge process in one request; a completion that
    hangs it costs its own timeout, and the completions after it are judged by a new process."""
    completions = ["\\boxed{7}", "8", "The answer is 12", "\\boxed{3}"] * 25
    answers = ["7", "8", "12", "4"] * 25
    expected = [1.0, 1.0, 1.0, 0.0] * 25
    reward = load_reward("math_verify")
    assert score(reward, RewardInput(completions, answers)).tolist() == expected  # main thread
    assert _in_a_thread(score, reward, RewardInput(completions, answers)).tolist() == expected
    stuck = ["\\boxed{1}", PATHOLOGICAL, "\\boxed{2}"]
    verdicts = _in_a_thread(MathVerify(timeout_s=1).verdicts, stuck, ["1", "1", "2"])
    assert verdicts == [(1.0, ""), (0.0, "timeout"), (1.0, "")]


def test_a_gold_answer_whose_parse_timed_out_is_parsed_again(monkeypatch):
    """A gold answer whose parse ran out of time once (a busy machine) is not remembered as
    unreadable: the next completion with that answer is judged."""
    from math_verify import parser

    real, calls = parser.extract_target_from_pred, []

    def slow_once(pred, *args, **kwargs):
        if pred == "4242" and not calls:
            calls.append(pred)
            time.sleep(3)
        return real(pred, *args, **kwargs)

    monkeypatch.setattr(parser, "extract_target_from_pred", slow_once)
    first = RewardInput(["\\boxed{4242}"], ["4242"])
    assert MathVerify(timeout_s=1)(first) == [0.0] and first.metrics.compute()["timeouts"] == 1.0
    assert _math_verify("\\boxed{4242}", "4242", timeout_s=1) == 1.0


def test_unreadable_gold_answers_are_counted_and_reported_at_load(tmp_path):
    """A gold answer math-verify reads nothing in scores 0.0 and is counted (``unparsed_gold``);
    the task reads its gold answers when it loads: a warning with their count when some are
    unreadable, a problem naming the key when none is."""
    import json

    from rlinf_lightning.tasks import MathTask

    batch = RewardInput(["\\boxed{3}", "\\boxed{3}"], ["3", "\\text{three}"])
    assert MathVerify()(batch) == [1.0, 0.0] and batch.metrics.compute()["unparsed_gold"] == 1.0

    def task(answers: list[str]) -> MathTask:
        path = tmp_path / f"{len(answers)}.jsonl"
        path.write_text("".join(json.dumps({"prompt": "?", "answer": a}) + "\n" for a in answers))
        return MathTask(str(path), str(tmp_path / "1.jsonl"))

    task(["3"]).validate_config()  # the test set every task below uses: readable
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("rlinf_lightning.rewards").addHandler(handler)
    try:
        assert task(["3", "no idea", "no idea"]).validate_config() == []
    finally:
        logging.getLogger("rlinf_lightning.rewards").removeHandler(handler)
    warned = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert any("train_path: reward 'math_verify' cannot read 2 of 3 gold answers" in m for m in warned)
    problems = task(["A", "B", "C", "D"]).validate_config()
    assert problems == [
        ("train_path", "reward 'math_verify' reads none of its 4 gold answers (e.g. 'A', 'B', 'C'); "
                       "check the records' answer field, or choose another task.reward")
    ]  # fmt: skip


def test_the_reward_stage_logs_timeouts_and_unreadable_gold_answers():
    from tensordict import TensorDict

    from rlinf_lightning.flow.stage import StageContext
    from rlinf_lightning.workflows.reasoning.reward import RewardStage

    stage = RewardStage("math_verify", "boxed_format", 0.1)
    stage.setup(StageContext())
    stage.correct_fn.timeout_s = 1
    completions = ["\\boxed{7}", PATHOLOGICAL, "\\boxed{2}", "2"]
    batch = TensorDict(
        {
            "completion": completions,
            "answer": ["7", "1", "\\text{two}", "2"],
            "prompt": ["p"] * 4,
            "response_mask": torch.ones(4, 3),
        },
        batch_size=[4],
    )
    out = stage.process(batch)
    assert out["correct"].tolist() == [1.0, 0.0, 0.0, 1.0]
    metrics = stage.end_iteration().compute()
    assert (metrics["timeouts"], metrics["unparsed_gold"], metrics["accuracy"]) == (1.0, 1.0, 0.5)
    assert metrics["format"] == 0.75 and metrics["reward_max"] == pytest.approx(1.1)


SCORED = [  # completion, gold: numbers, fractions, LaTeX, powers, names sympy defines, text
    ("46", "46"), ("46.0", "46"), ("0.50", "1/2"), ("\\frac{1}{2}", "0.5"), ("\\boxed{3/4}", "0.75"),
    ("3^1", "39"), ("2^3", "8"), ("2**3", "8"), ("sqrt(4)", "2"), ("max(1,2)", "2"), ("1e3", "1000"),
    ("-5", "-5"), ("x+1", "2"), ("x", "x"), ("I", "1"), ("E", "e"), ("pi", "3.14159"),
    ("The answer is 42", "42"), ("7 = 7", "7"), ("12 apples and 3", "3"), ("", "1"), ("abc", "1"),
]  # fmt: skip


def _plain_math_verify(pairs):
    """math-verify as its documentation calls it, in a fresh interpreter (sympy unpatched)."""
    import json
    import subprocess
    import sys

    code = (
        "import json, sys\nfrom math_verify import parse, verify\n"
        "pairs = json.loads(sys.argv[1])\n"
        "print(json.dumps([1.0 if (g := parse(a)) and (p := parse(c)) and verify(g, p) else 0.0"
        " for c, a in pairs]))"
    )
    out = subprocess.run([sys.executable, "-c", code, json.dumps(pairs)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_math_verify_with_one_sympy_namespace_scores_as_plain_math_verify_and_builds_it_once(monkeypatch):
    """The reward builds sympy's parsing namespace once instead of per number (``parse_expr``
    without one runs ``from sympy import *`` at each call, most of math-verify's time): every
    score equals plain math-verify's, and reading numbers runs that import no more. Counted, not
    timed (the speed-up: docs/benchmarks.md), so a busy machine cannot fail it."""
    from sympy.parsing import sympy_parser

    from rlinf_lightning.judge import share_sympy_namespace

    scores = [s for s, _ in MathVerify().verdicts([c for c, _ in SCORED], [a for _, a in SCORED])]
    assert scores == _plain_math_verify(SCORED)
    share_sympy_namespace()
    shared = sympy_parser.parse_expr
    imports = []

    def counting_exec(source, *args):
        imports.append(source)
        return exec(source, *args)

    monkeypatch.setattr(sympy_parser, "exec", counting_exec, raising=False)  # parse_expr's global
    numbers = [str(n) for n in range(50)]
    for n in numbers:
        sympy_parser.parse_expr(n)
    assert imports.count("from sympy import *") == 0
    sympy_parser.parse_expr = shared.__wrapped__
    try:
        for n in numbers:
            sympy_parser.parse_expr(n)
    finally:
        sympy_parser.parse_expr = shared
    assert imports.count("from sympy import *") == len(numbers)  # the count sees the rebuilds


def test_a_judge_process_runs_by_path_without_importing_torch():
    """The judge process (math-verify off a main thread) is judge.py run by path: it loads
    math-verify, never this package and the torch it imports, which is what makes it quick to start."""
    import psutil

    from rlinf_lightning.rewards import _JudgeProcess

    judge = _JudgeProcess()
    try:
        assert judge([("\\boxed{7}", "7"), ("8", "9")], 5) == [(1.0, ""), (0.0, "")]
        libraries = {m.path for m in psutil.Process(judge.proc.pid).memory_maps()}
        assert not any("libtorch" in path for path in libraries), sorted(libraries)
        assert judge.proc.args[1].endswith("rlinf_lightning/judge.py")
    finally:
        judge.close()
    assert judge.proc is None
