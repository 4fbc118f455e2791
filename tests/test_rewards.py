"""Reward functions for GRPO (slipstream/rewards): the built-ins on hand-made completions, user
functions with TRL's signature (TRL's own reward functions driven unchanged), every bad-input
error, and the NaN-ignoring weighted total."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import pytest
import torch

from slipstream.rewards import RewardError, build_rewards

pytest.importorskip("math_verify")


def msg(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def score(specs, completions, columns=None, rows=None, **kw) -> torch.Tensor:
    n = len(completions)
    rewards = build_rewards(specs)
    return rewards(["q"] * n, completions, columns or {}, rows or list(range(n)), **kw)


def col(t: torch.Tensor) -> list:
    return [None if math.isnan(v) else v for v in t[:, 0].tolist()]


# --- accuracy ----------------------------------------------------------------------------------


def test_accuracy_right_wrong_and_unparseable():
    completions = [
        "17 + 25 = \\boxed{42}",  # boxed, right
        "17 + 25 = 42",  # plain final number, right
        "I first thought 42, but it is 43.",  # the last answer counts: wrong
        "\\boxed{42} is it. Check: 40 + 3",  # a boxed answer wins over later numbers
        "The final answer is $\\frac{84}{2}$",  # equal as maths, not as text
        "I do not know.",  # no answer: 0
        "\\boxed{42}",  # gold does not parse: None (not judged)
    ]
    answers = ["42"] * 6 + ["\\frac{"]
    out = score([{"function": "accuracy"}], completions, {"answer": answers})
    assert out.shape == (7, 1) and out.dtype == torch.float32
    assert col(out) == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0, None]


def test_accuracy_boxed_only_column_and_messages():
    completions = [
        msg("so \\boxed{7}"),
        msg("7"),
        msg("\\boxed{6} no, \\boxed{7}"),
        msg("\\boxed{6}"),
    ]
    spec = {"function": "accuracy", "boxed": True, "column": "solution"}
    out = score([spec], completions, {"solution": [7, "7", "7", "7"]})  # an int answer too
    assert col(out) == [1.0, 0.0, 1.0, 0.0]


def test_accuracy_equals_trl_accuracy_reward():
    # TRL's own function, named as a module path and driven unchanged (it reads `solution`);
    # on boxed answers and an unparseable gold both follow math-verify the same way.
    completions = [
        msg("\\boxed{\\frac{1}{3}}"),
        msg("\\boxed{0.5}"),
        msg("\\boxed{2}"),
        msg("$x = \\boxed{3}$"),
        msg("\\boxed{3}"),
    ]
    solutions = ["\\frac{1}{3}", "\\frac{1}{2}", "3", "3", "\\frac{"]
    specs = [
        {"function": "accuracy", "column": "solution"},
        {"function": "trl.rewards:accuracy_reward"},
    ]
    out = score(specs, completions, {"solution": solutions})
    assert col(out) == [1.0, 1.0, 0.0, 1.0, None]
    assert torch.equal(out[:, 0].nan_to_num(-7), out[:, 1].nan_to_num(-7))


# --- format and length -------------------------------------------------------------------------


def test_format_regex():
    spec = {"function": "format", "pattern": r"^<answer>\d+</answer>$"}
    completions = [
        "<answer>12</answer>",
        " <answer>12</answer>\n",
        "x <answer>12</answer>",
        msg("<answer>1</answer>"),
        "<answer>1.5</answer>",
    ]
    assert col(score([spec], completions)) == [1.0, 1.0, 0.0, 1.0, 0.0]
    unanchored = {"function": "format", "pattern": r"\\boxed\{.+?\}"}
    assert col(score([unanchored], ["a \\boxed{1} b", "a boxed{1}"])) == [1.0, 0.0]


def test_length_equals_trl_soft_overlong_punishment():
    from trl.rewards import get_soft_overlong_punishment

    ids = [[1] * n for n in (0, 10, 12, 13, 16, 17, 40)]
    out = score([{"function": "length", "budget": 12, "ramp": 4}], ["x"] * 7, completion_ids=ids)
    assert col(out) == [0.0, 0.0, 0.0, -0.25, -1.0, -1.0, -1.0]
    trl_fn = get_soft_overlong_punishment(max_completion_len=16, soft_punish_cache=4)
    assert col(out) == pytest.approx(trl_fn(completion_ids=ids))
    chars = score(
        [{"function": "length", "budget": 4, "unit": "chars"}], ["abcd", "abcde", msg("")]
    )
    assert col(chars) == [0.0, -1.0, 0.0]  # ramp defaults to budget // 4 = 1


# --- user functions ----------------------------------------------------------------------------

USER_FILE = """
calls = []

def brevity(prompts, completions, completion_ids, answer, trainer_state=None, **kwargs):
    calls.append(dict(prompts=prompts, completion_ids=completion_ids, answer=answer,
                      trainer_state=trainer_state, keys=sorted(kwargs)))
    kwargs["log_metric"]("seen", 1.0)  # TRL hands these in; a function may call them
    return [None if a == "skip" else -len(c[0]["content"]) / 10
            for c, a in zip(completions, answer)]

def only_completions(completions):
    return [float(len(completions))] * len(completions)

def raises_on_row(completions, **kwargs):
    if any("bad" in c for c in completions):
        raise ZeroDivisionError("division by zero")
    return [0.0] * len(completions)

def wrong_count(completions, **kwargs):
    return [0.0]

def gives_nan(completions, **kwargs):
    return [float("nan") if c == "n" else 1.0 for c in completions]

def gives_text(completions, **kwargs):
    return ["1.0"] * len(completions)

def gives_scalar(completions, **kwargs):
    return 1.0

async def later(completions, **kwargs):
    return [2.0] * len(completions)

def needs_solution(completions, solution, **kwargs):
    return [0.0] * len(completions)

def myreward(x):
    return [0.0] * len(x)

def reads_prompts_only(prompts, answer):
    return [0.0] * len(prompts)

def positional(completions, /, **kwargs):
    return [0.0] * len(completions)

not_a_function = 3
"""


@pytest.fixture
def user_file(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(USER_FILE)
    monkeypatch.chdir(tmp_path)  # user paths are relative to the working directory
    return "my_rewards.py"


def test_user_function_gets_trl_arguments(user_file):
    rewards = build_rewards(
        [
            {"function": f"{user_file}:brevity", "weight": 0.5},
            {"function": f"{user_file}:only_completions"},
            {"function": f"{user_file}:later"},
        ]
    )
    assert rewards.names == ["brevity", "only_completions", "later"]
    assert rewards.weights == [0.5, 1.0, 1.0]
    assert rewards.columns_needed == {"answer"}
    prompts = [[{"role": "user", "content": "hi"}]] * 3
    completions = [msg("abcd"), msg("ab"), msg("a")]
    state = object()
    out = rewards(
        prompts,
        completions,
        {"answer": ["x", "x", "skip"], "level": [1, 1, 2]},
        [5, 5, 6],
        completion_ids=[[1], [2], [3]],
        trainer_state=state,
    )
    assert torch.allclose(out[:2, 0], torch.tensor([-0.4, -0.2]))
    assert (
        math.isnan(out[2, 0])
        and out[:, 1].tolist() == [3.0] * 3
        and out[:, 2].tolist() == [2.0] * 3
    )
    module = sys.modules[rewards.rewards[0].fn.__module__]
    (call,) = module.calls
    assert call["prompts"] == prompts and call["completion_ids"] == [[1], [2], [3]]
    assert call["trainer_state"] is state and call["keys"] == ["level", "log_extra", "log_metric"]
    assert build_rewards([f"{user_file}:brevity"]).rewards[0].fn is module.brevity  # imported once


def test_trl_think_format_reward_unchanged():
    out = score(
        [{"function": "trl.rewards:think_format_reward"}],
        [msg("<think>\nhmm\n</think>\n42"), msg("42")],
    )
    assert col(out) == [1.0, 0.0]


def test_total_ignores_nan_like_trl():
    r_NF = torch.tensor([[1.0, float("nan"), -0.5], [float("nan")] * 3, [0.0, 2.0, 1.0]])
    rewards = build_rewards(
        [
            {"function": "accuracy"},
            {"function": "format", "pattern": "x", "weight": 0.25},
            {"function": "length", "budget": 3, "weight": -2},
        ]
    )
    # Row 1: every function None -> unscorable, NaN (TRL 1.16's GRPOTrainer), not nansum's 0.
    direct = [1.0 * 1.0 + (-0.5) * -2, math.nan, 0.0 * 1.0 + 2.0 * 0.25 + 1.0 * -2]
    assert rewards.total(r_NF).tolist() == pytest.approx(direct, nan_ok=True)
    assert rewards.names == ["accuracy", "format", "length"]
    assert build_rewards(["accuracy", "accuracy"]).names == ["accuracy", "accuracy_2"]


# --- errors: one line, naming the function (and the row) ------------------------------------


@pytest.mark.parametrize(
    "specs, match",
    [
        ([], r"grpo.rewards is \[\]; give a list"),
        ([{"weight": 1}], r"grpo.rewards\[0\] is .*give \{function"),
        (["brevity"], r"'brevity' is no built-in \(accuracy, format, length\)"),
        ([{"function": "format"}], r"grpo.rewards\[0\] \(format\): needs 'pattern'"),
        ([{"function": "format", "pattern": "("}], r"pattern '\(' is not a valid regular"),
        ([{"function": "length", "budget": 10, "bugdet": 1}], r"unknown key 'bugdet'; allowed"),
        ([{"function": "length", "budget": -1}], r"budget is -1"),
        (
            ["accuracy", {"function": "accuracy", "weight": "x"}],
            r"rewards\[1\] \(accuracy\): weight",
        ),
        ([{"function": "nowhere/r.py:f"}], r"'nowhere/r.py:f': file nowhere/r.py does not exist"),
        ([{"function": "no_such_module_xyz:f"}], r"cannot import module 'no_such_module_xyz'"),
        ([{"function": "math:no_such"}], r"'math:no_such': math has no 'no_such'"),
        ([{"function": "math:pi"}], r"pi is a float, not callable"),
        ([{"function": "math:floor", "scale": 2}], r"unknown key 'scale'"),
    ],
)
def test_bad_specs(specs, match):
    with pytest.raises(ValueError, match=match) as e:
        build_rewards(specs)
    assert "\n" not in str(e.value)


def test_user_file_errors(user_file, tmp_path):
    (tmp_path / "broken.py").write_text("import no_such_module_xyz\n")
    with pytest.raises(ValueError, match=r"'broken.py:f': importing broken.py raised "
                       "ModuleNotFoundError: No module named 'no_such_module_xyz'"):  # fmt: skip
        build_rewards(["broken.py:f"])
    with pytest.raises(ValueError, match=r"my_rewards.py has no 'nope' \(its functions: brevity"):
        build_rewards(["my_rewards.py:nope"])
    with pytest.raises(ValueError, match=r"not_a_function is a int, not callable"):
        build_rewards(["my_rewards.py:not_a_function"])


@pytest.mark.parametrize(
    "name, completions, match",
    [
        (
            "raises_on_row",
            ["ok", "ok", "bad"],
            r"'my_rewards.py:raises_on_row' raised "
            r"ZeroDivisionError: division by zero on dataset row 12 \(completion 2\)$",
        ),
        (
            "wrong_count",
            ["a", "b"],
            r"'my_rewards.py:wrong_count' returned 1 values for 2 "
            r"completions \(dataset rows 10, 11\)",
        ),
        (
            "gives_nan",
            ["1", "n"],
            r"'my_rewards.py:gives_nan' returned nan for completion 1 "
            r"\(dataset row 11\)",
        ),
        ("gives_text", ["1"], r"returned '1.0' \(str\) for completion 0 \(dataset row 10\)"),
        ("gives_scalar", ["1"], r"'my_rewards.py:gives_scalar' returned a float on dataset row 10"),
        (
            "needs_solution",
            ["1"],
            r"'my_rewards.py:needs_solution' reads the dataset column "
            r"'solution', which the data lacks \(its other columns: answer\)",
        ),
    ],
)
def test_reward_errors_name_function_and_row(user_file, name, completions, match):
    rewards = build_rewards([f"{user_file}:{name}"])
    n = len(completions)
    with pytest.raises(RewardError, match=match) as e:
        rewards(["q"] * n, completions, {"answer": ["1"] * n}, [10, 11, 12][:n])
    assert isinstance(e.value, ValueError) and "\n" not in str(e.value)


def test_builtin_errors_at_call():
    with pytest.raises(RewardError, match=r"'accuracy' reads the dataset column 'answer', which "
                       r"the data lacks \(its other columns: solution\)"):  # fmt: skip
        score(["accuracy"], ["1"], {"solution": ["1"]})
    with pytest.raises(RewardError, match=r"'length' raised ValueError: it counts tokens and "
                       r"got no completion_ids; set unit: chars on dataset row 0"):  # fmt: skip
        score([{"function": "length", "budget": 4}], ["abc"])


@pytest.mark.parametrize(
    "name, match",
    [
        ("myreward", r"myreward\(x\) takes no completions"),
        ("reads_prompts_only", r"reads_prompts_only\(prompts, answer\) takes no completions"),
        ("positional", r"positional\(completions, /, \*\*kwargs\) takes 'completions' "
         r"by position only"),
    ],
)  # fmt: skip
def test_wrong_signature_names_the_expected_one(user_file, name, match):
    # Not "the data lacks column x": the function is called with keyword arguments.
    with pytest.raises(ValueError, match=rf"grpo.rewards\[0\] \(my_rewards.py:{name}\): {match}"):
        build_rewards([f"{user_file}:{name}"])
    with pytest.raises(ValueError, match=r"\(completions, \*\*kwargs\)") as e:
        build_rewards([f"{user_file}:{name}"])
    assert "\n" not in str(e.value)


def test_building_does_not_import_torch(tmp_path):
    # Config validation builds the rewards before the CLI imports torch.
    (tmp_path / "module_rewards.py").write_text("def short(completions, **kw):\n    return []\n")
    code = textwrap.dedent("""
        import sys
        from slipstream.rewards import build_rewards
        build_rewards(["accuracy", {"function": "format", "pattern": "x"}, "module_rewards:short"])
        assert "torch" not in sys.modules, "torch imported"
    """)
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
