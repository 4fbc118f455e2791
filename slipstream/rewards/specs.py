"""`build_rewards(specs)`: the config's `grpo.rewards` entries to a `RewardFunctions`.

An entry is `{function: NAME_OR_PATH, weight: 1.0, ...options}`. NAME is a built-in
(`accuracy`, `format`, `length`; their options are their constructors' arguments); a user
function is `path/to/file.py:function` (relative to the working directory) or
`package.module:function`; `model:DIR` is a reward model (rewards/model.py). Every mistake is
a one-line ValueError naming the entry.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slipstream.rewards.accuracy import Accuracy
from slipstream.rewards.functions import TRL_ARGUMENTS, Reward, RewardFunctions
from slipstream.rewards.model import PREFIX as MODEL_PREFIX
from slipstream.rewards.model import ModelReward
from slipstream.rewards.text import Format, Length

BUILTINS: dict[str, type] = {"accuracy": Accuracy, "format": Format, "length": Length}
COMMON_KEYS = ("function", "weight")


def build_rewards(specs: list[dict]) -> RewardFunctions:
    """The reward functions of `specs` (see the module docstring), names made unique."""
    if not isinstance(specs, (list, tuple)) or not specs:
        raise ValueError(
            f"grpo.rewards is {specs!r}; give a list of at least one {{function: ..., weight: "
            f"...}} (built-ins: {', '.join(BUILTINS)}; or FILE.py:FUNCTION)"
        )
    rewards, seen = [], {}
    for i, spec in enumerate(specs):
        reward = _build_one(spec, f"grpo.rewards[{i}]")
        seen[reward.name] = seen.get(reward.name, 0) + 1
        if seen[reward.name] > 1:  # two `format` rewards: format, format_2
            reward = dataclasses.replace(reward, name=f"{reward.name}_{seen[reward.name]}")
        rewards.append(reward)
    return RewardFunctions(rewards)


def _build_one(spec: Any, where: str) -> Reward:
    if isinstance(spec, str):
        spec = {"function": spec}
    if not isinstance(spec, dict) or not isinstance(spec.get("function"), str):
        raise ValueError(
            f"{where} is {spec!r}; give {{function: NAME_OR_PATH, weight: 1.0}} "
            f"(built-ins: {', '.join(BUILTINS)}; or FILE.py:FUNCTION / MODULE:FUNCTION)"
        )
    text = spec["function"]
    where = f"{where} ({text})"
    weight = spec.get("weight", 1.0)
    if (
        isinstance(weight, bool)
        or not isinstance(weight, (int, float))
        or not math.isfinite(weight)
    ):
        raise ValueError(f"{where}: weight is {weight!r}; give a finite number")
    options = {k: v for k, v in spec.items() if k not in COMMON_KEYS}
    if text.startswith(MODEL_PREFIX):  # a reward model folder (rewards/model.py)
        if options:
            raise ValueError(f"{where}: unknown key {next(iter(options))!r}; a reward model's "
                             "entry has only function and weight")  # fmt: skip
        fn = ModelReward(text.removeprefix(MODEL_PREFIX), where)
        return Reward(fn.__name__, text, fn, float(weight), None, ())
    if text in BUILTINS:
        fn, name = _builtin(BUILTINS[text], options, where), text
    else:
        if options:
            raise ValueError(
                f"{where}: unknown key {next(iter(options))!r}; a user function's entry has "
                "only function and weight"
            )
        fn, name = load_function(text), text.rpartition(":")[2].rpartition(".")[2]
    accepts, required = _parameters(fn, where)
    columns = tuple(getattr(fn, "columns", ())) + required
    return Reward(name, text, fn, float(weight), accepts, columns)


def _builtin(cls: type, options: dict, where: str) -> Callable[..., Any]:
    params = inspect.signature(cls).parameters
    for key in options:
        if key not in params:
            allowed = ", ".join([*COMMON_KEYS, *params])
            raise ValueError(f"{where}: unknown key {key!r}; allowed: {allowed}")
    for key, p in params.items():
        if p.default is inspect.Parameter.empty and key not in options:
            raise ValueError(f"{where}: needs {key!r} (allowed keys: {', '.join(params)})")
    try:
        return cls(**options)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


SIGNATURE = (
    "a reward function is called as f(completions, **kwargs): keyword arguments prompts, "
    "completions, completion_ids and the dataset's columns, as TRL's GRPOTrainer calls it"
)


def _parameters(
    fn: Callable[..., Any], where: str
) -> tuple[frozenset[str] | None, tuple[str, ...]]:
    """(keyword names `fn` takes, None when it has **kwargs; required names that are no TRL
    argument: dataset columns it needs). A signature that cannot take the completions by
    keyword is a ValueError naming the expected one (not "the data lacks column x")."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins and C callables have no signature
        return None, ()
    params = signature.parameters.values()
    name = getattr(fn, "__name__", type(fn).__name__)
    for p in params:
        if p.kind is inspect.Parameter.POSITIONAL_ONLY and p.default is inspect.Parameter.empty:
            raise ValueError(
                f"{where}: {name}{signature} takes {p.name!r} by position only; {SIGNATURE}"
            )
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    named = [p for p in params if p.kind in kinds]
    has_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    if not has_kwargs and not {"completions", "completion_ids"} & {p.name for p in named}:
        raise ValueError(f"{where}: {name}{signature} takes no completions; {SIGNATURE}")
    required = tuple(
        p.name
        for p in named
        if p.default is inspect.Parameter.empty and p.name not in TRL_ARGUMENTS
    )
    if has_kwargs:
        return None, required
    return frozenset(p.name for p in named), required


def load_function(text: str) -> Callable[..., Any]:
    """The callable `path/to/file.py:name` or `package.module:name` (name may be dotted)."""
    source, sep, attr = text.rpartition(":")
    if not sep or not source or not attr:
        raise ValueError(
            f"reward function {text!r} is no built-in ({', '.join(BUILTINS)}); give "
            "FILE.py:FUNCTION or MODULE:FUNCTION"
        )
    is_file = source.endswith(".py") or "/" in source or "\\" in source
    module = _import_file(text, source) if is_file else _import_module(text, source)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
            raise ValueError(
                f"reward function {text!r}: {source} has no {attr!r} "
                f"(its functions: {', '.join(names[:8]) or 'none'})"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(
            f"reward function {text!r}: {attr} is a {type(obj).__name__}, not callable"
        )
    return obj


def _import_module(text: str, source: str) -> Any:
    try:
        return importlib.import_module(source)
    except Exception as e:
        raise ValueError(
            f"reward function {text!r}: cannot import module {source!r} "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None


def _import_file(text: str, source: str) -> Any:
    path = Path(source).expanduser().resolve()
    if not path.is_file():
        raise ValueError(
            f"reward function {text!r}: file {source} does not exist (paths are relative "
            f"to the working directory, {Path.cwd()})"
        )
    # One module per file, under a name no package uses; built once (config validation and
    # the trainer both build the rewards). In sys.modules so pickling and dataclasses work.
    name = f"_slipstream_reward_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        line = str(e).splitlines()[0] if str(e) else ""
        raise ValueError(
            f"reward function {text!r}: importing {source} raised {type(e).__name__}: {line}"
        ) from None
    return module
