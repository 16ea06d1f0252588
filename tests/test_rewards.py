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
