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
