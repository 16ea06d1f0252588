import pytest

from rlinf_lightning.rewards import REWARDS


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
    assert REWARDS.get("math_verify")(completion, gold) == expected


def test_format_rewards():
    assert REWARDS.get("number_format")("12", "") == 1.0
    assert REWARDS.get("number_format")("12 apples", "") == 0.0
    assert REWARDS.get("boxed_format")("so \\boxed{3}", "") == 1.0


def test_plugins_extend_the_same_registry():
    @REWARDS.register("test_len_reward")
    def length(completion: str, answer: str) -> float:
        return float(len(completion))

    assert REWARDS.get("test_len_reward")("abc", "") == 3.0
    assert ("test_len_reward", "built-in", "") in REWARDS.describe()


PATHOLOGICAL = "\\boxed{9^{9^{9^{9}}}}"  # sympy evaluates 9^387420489 for minutes without a timeout


def _two_calls() -> tuple[float, float, float]:
    import time

    from rlinf_lightning.rewards import math_verify_reward

    t0 = time.monotonic()
    bad = math_verify_reward(PATHOLOGICAL, "1", timeout_s=1)
    return bad, time.monotonic() - t0, math_verify_reward("\\boxed{7}", "7", timeout_s=1)


@pytest.mark.parametrize("where", ["main thread", "worker thread", "worker process"])
def test_math_verify_times_out_anywhere(where):
    """One pathological completion scores 0.0 within about the timeout, wherever the reward runs,
    and the next call still works (off the main thread a stuck judge process is replaced)."""
    import concurrent.futures

    from rlinf_lightning.rewards import math_verify_reward

    if where == "main thread":
        bad, took, good = _two_calls()
    else:
        pool_cls = {
            "worker thread": concurrent.futures.ThreadPoolExecutor,
            "worker process": concurrent.futures.ProcessPoolExecutor,
        }[where]
        with pool_cls(1) as pool:
            pool.submit(math_verify_reward, "1", "1").result(timeout=120)  # start-up not timed
            bad, took, good = pool.submit(_two_calls).result(timeout=60)
    assert (bad, good) == (0.0, 1.0)
    assert took < 10, f"{took:.1f} s"


def _in_a_thread(fn, *args):
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args).result(timeout=120)


def test_math_verify_scores_a_micro_batch_off_the_main_thread():
    """Off the main thread a micro-batch goes to the judge process in one request; a completion that
    hangs it costs its own timeout, and the completions after it are judged by a new process."""
    from rlinf_lightning.rewards import REWARDS, _math_verify_batch, score

    completions = ["\\boxed{7}", "8", "The answer is 12", "\\boxed{3}"] * 25
    answers = ["7", "8", "12", "4"] * 25
    expected = [1.0, 1.0, 1.0, 0.0] * 25
    fn = REWARDS.get("math_verify")
    assert score(fn, completions, answers) == expected  # main thread, in process
    assert _in_a_thread(score, fn, completions, answers) == expected
    stuck = ["\\boxed{1}", PATHOLOGICAL, "\\boxed{2}"]
    assert _in_a_thread(_math_verify_batch, stuck, ["1", "1", "2"], 1) == [1.0, 0.0, 1.0]


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


def test_math_verify_with_one_sympy_namespace_scores_as_plain_math_verify_and_faster():
    """The reward builds sympy's parsing namespace once instead of per number; every score equals
    plain math-verify's, and scoring is at least twice as fast as rebuilding it (measured ~3x)."""
    import time

    from sympy.parsing import sympy_parser

    from rlinf_lightning.judge import share_sympy_namespace
    from rlinf_lightning.rewards import REWARDS

    fn = REWARDS.get("math_verify")
    assert [fn(c, a) for c, a in SCORED] == _plain_math_verify(SCORED)
    share_sympy_namespace()
    shared = sympy_parser.parse_expr
    numbers = [str(n) for n in range(200)]

    def seconds() -> float:
        t0 = time.perf_counter()
        for n in numbers:
            sympy_parser.parse_expr(n)
        return time.perf_counter() - t0

    fast = min(seconds() for _ in range(3))
    sympy_parser.parse_expr = shared.__wrapped__
    try:
        slow = min(seconds() for _ in range(3))
    finally:
        sympy_parser.parse_expr = shared
    assert slow > 2 * fast, (slow, fast)


def test_a_judge_process_runs_by_path_without_importing_torch():
    """The judge process (math-verify off a main thread) is judge.py run by path: it loads
    math-verify, never this package and the torch it imports, which is what makes it quick to start."""
    import psutil

    from rlinf_lightning.rewards import _JudgeProcess

    judge = _JudgeProcess()
    try:
        assert judge([("\\boxed{7}", "7"), ("8", "9")], 5) == [1.0, 0.0]
        libraries = {m.path for m in psutil.Process(judge.proc.pid).memory_maps()}
        assert not any("libtorch" in path for path in libraries), sorted(libraries)
        assert judge.proc.args[1].endswith("rlinf_lightning/judge.py")
    finally:
        judge.close()
    assert judge.proc is None
