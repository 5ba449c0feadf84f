"""GRPO's rewards: reward functions loaded from specs, called as TRL calls them, checked (issue 31 item 2).

A spec (`load_reward_function`) is one of
  exact_match, format        a built-in reward for the embedded tasks (trainer/data/tasks.py), below
  package.module:function    a function of an importable module
  path/to/file.py:function   a function of a Python file (imported under a private module name)
  path/to/checkpoint_dir     a reward model: a sequence-classification checkpoint (`RewardModel`)
and a wrong one (no such module or file, a module that raises on import, no such function, not callable) is a
`ConfigError` in one line naming the spec. `load_reward_functions(specs, weights)` loads several, with TRL's check
that the weights (default 1 each) match them in number.

Calling convention, TRL 1.16's `GRPOTrainer._calculate_rewards`: every reward function gets the keyword arguments
prompts, completions, completion_ids (lists of N, one per completion, prompts repeated per completion), each of the
dataset's other columns (but prompt, completion, completion_ids) as a list of N, trainer_state, log_extra and
log_metric (TRL's logging hooks; no-ops unless given), and returns N rewards, None meaning "not applicable"
(NaN in the matrix, skipped by nansum in `grpo_advantages`). A reward model gets the texts prompt + completion
(through the tokenizer's chat template for conversational data), tokenised with padding on the right and no special
tokens, and its logits[:, 0] is the reward.

`score(...)` returns the (N, F) float32 matrix, one column per function, which `grpo_advantages` weights and sums.
Its checks are stricter than TRL's and name the row: a function that raises, returns other than N values or a
value that is neither a number (bool, int, float, numpy scalar, one-element tensor) nor None raises `RewardError`
(a `ConfigError`: one line naming the function and the row, exit code 2 in a command). For a raising function the
row is found by calling it again on each row alone, in order (a function that fails only on the whole batch is
reported for the batch). As in TRL (which converts with torch.tensor), a bool counts as 0/1 and a string is an
error. Async reward functions (TRL runs them concurrently) are awaited one by one.

Built-in rewards for the embedded tasks (prompts "reverse: plant", ... as a string or TRL's conversational
[{"role": "user", "content": ...}]; completions likewise; None for a prompt that is no task):
  exact_match   1.0 when the completion, stripped, equals the answer, else 0.0; the answer is the dataset's
                `solution` column where present (as TRL's accuracy_reward), else `tasks.solve(prompt)`
  format        1.0 when the stripped completion has the shape of an answer of its kind, else 0.0: lowercase
                letters as many as the word (reverse), capitals as many (upper), digits as many (sort), digits
                (add, convert); a partial credit that needs no right answer

Test: `python -m pytest tests/trainer/methods/test_grpo_rewards.py -q` (a golden test against TRL's
`_calculate_rewards` included).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import importlib
import importlib.util
import inspect
import math
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from trainer.coerce import ConfigError
from trainer.data import tasks


class RewardError(ConfigError):
    """A reward function that failed on a batch, in one line naming it and the row."""


# ------------------------------------------------------------------------------------------------------------
# Built-in rewards for the embedded tasks
# ------------------------------------------------------------------------------------------------------------
def _text(value) -> str:
    """A prompt's or completion's text: the string, or the last message's content of a conversation."""
    if isinstance(value, str):
        return value
    return value[-1]["content"] if value else ""


def exact_match(prompts, completions, solution=None, **kwargs) -> list[float | None]:
    """1.0 for the right answer to a task prompt (whitespace stripped), 0.0 otherwise, None for no task."""
    out = []
    for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        text = _text(prompt)
        if tasks.kind_of(text) is None:
            out.append(None)
            continue
        answer = solution[row] if solution is not None else tasks.solve(text)
        out.append(float(tasks.exact_match(_text(completion), answer)))
    return out


def _answer_shape(prompt: str) -> str:
    kind, _, arg = prompt.partition(": ")
    n = len(arg)
    return {"reverse": f"[a-z]{{{n}}}", "upper": f"[A-Z]{{{n}}}", "sort": f"[0-9]{{{n}}}"}.get(kind, "[0-9]+")


def format_reward(prompts, completions, **kwargs) -> list[float | None]:
    """1.0 when the completion has its task's answer shape (see the module docstring), 0.0 otherwise, None for no
    task."""
    out = []
    for prompt, completion in zip(prompts, completions, strict=True):
        text = _text(prompt)
        if tasks.kind_of(text) is None:
            out.append(None)
            continue
        out.append(float(re.fullmatch(_answer_shape(text), _text(completion).strip()) is not None))
    return out


BUILTINS: dict[str, Callable] = {"exact_match": exact_match, "format": format_reward}


# ------------------------------------------------------------------------------------------------------------
# Reward models
# ------------------------------------------------------------------------------------------------------------
class RewardModel:
    """A sequence-classification checkpoint as TRL uses it: loaded with num_labels=1, its tokenizer's pad token set
    to eos when missing (and written into the model's config, which finds the last real token by it), called in
    inference mode on prompt + completion texts padded on the right; the reward is logits[:, 0]."""

    def __init__(self, path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None):
        import transformers  # seconds to import: only when a reward model is asked for

        try:
            self.model = transformers.AutoModelForSequenceClassification.from_pretrained(
                path, num_labels=1, dtype=dtype
            )
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        except Exception as e:
            raise ConfigError(f"reward model {str(path)!r} does not load: {_one_line(e)}") from None
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model.config.get_text_config().pad_token_id = self.tokenizer.pad_token_id
        self.model.to(device).eval()
        self.__name__ = str(getattr(self.model.config, "_name_or_path", "") or path).rstrip("/").split("/")[-1]

    def __call__(self, prompts, completions, **kwargs) -> torch.Tensor:
        if prompts and not isinstance(prompts[0], str):  # conversational: the chat template over prompt + completion
            texts = [self.tokenizer.apply_chat_template(p + c, tokenize=False) for p, c in zip(prompts, completions)]
        else:
            texts = [p + c for p, c in zip(prompts, completions, strict=True)]
        inputs = self.tokenizer(
            text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False
        ).to(self.model.device)
        with torch.inference_mode():
            return self.model(**inputs).logits[:, 0].float().cpu()  # (N,)


# ------------------------------------------------------------------------------------------------------------
# Loading
# ------------------------------------------------------------------------------------------------------------
def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def load_reward_function(spec: str, device: torch.device | str = "cpu") -> Callable:
    """The reward function a spec names (see the module docstring), or a one-line ConfigError."""
    if spec in BUILTINS:
        return BUILTINS[spec]
    if Path(spec).is_dir():
        return RewardModel(spec, device=device)
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise ConfigError(
            f"reward function {spec!r}: expected module:function, path.py:function, a reward model directory or one "
            f"of {', '.join(BUILTINS)}"
        )
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ConfigError(f"reward function {spec!r}: no file {where}")
        module_name = "_reward_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
        module = sys.modules.get(module_name)  # a file named by several specs is imported once
        try:
            if module is None:
                loader_spec = importlib.util.spec_from_file_location(module_name, path)
                module = importlib.util.module_from_spec(loader_spec)
                sys.modules[module_name] = module  # dataclasses and pickling look the module up by name
                loader_spec.loader.exec_module(module)
        except Exception as e:
            sys.modules.pop(module_name, None)
            raise ConfigError(f"reward function {spec!r}: {where} does not import: {_one_line(e)}") from None
    else:
        try:
            module = importlib.import_module(where)
        except Exception as e:
            raise ConfigError(f"reward function {spec!r}: module {where} does not import: {_one_line(e)}") from None
    if not hasattr(module, name):
        raise ConfigError(f"reward function {spec!r}: {where} has no {name!r}")
    func = getattr(module, name)
    if not callable(func):
        raise ConfigError(f"reward function {spec!r}: {name} is a {type(func).__name__}, not callable")
    return func


def load_reward_functions(
    specs: Sequence[str], weights: Sequence[float] | None = None, device: torch.device | str = "cpu"
) -> tuple[list[Callable], torch.Tensor]:
    """(functions, float32 weights) for several specs; weights default to 1 each and must match them in number."""
    if not specs:
        raise ConfigError("reward_funcs: at least one reward function is needed")
    if weights is not None and len(weights) != len(specs):
        raise ConfigError(
            f"reward_weights: {len(weights)} weights for {len(specs)} reward functions (one weight per function)"
        )
    funcs = [load_reward_function(spec, device) for spec in specs]
    return funcs, torch.tensor([1.0] * len(funcs) if weights is None else list(weights), dtype=torch.float32)


def reward_name(func: Callable) -> str:
    """TRL's display name (get_callable_name): a partial's function, a function's __name__, else the class name."""
    while isinstance(func, functools.partial):
        func = func.func
    return getattr(func, "__name__", type(func).__name__)


# ------------------------------------------------------------------------------------------------------------
# Scoring
# ------------------------------------------------------------------------------------------------------------
def _noop(*args, **kwargs) -> None:
    return None


def _call(func: Callable, kwargs: dict):
    out = func(**kwargs)
    return asyncio.run(out) if inspect.isawaitable(out) else out


def _rows(kwargs: dict, row: int, n: int) -> dict:
    """The keyword arguments of row `row` alone: every list of n sliced, the rest (trainer_state, hooks) kept."""
    return {k: (v[row : row + 1] if isinstance(v, list) and len(v) == n else v) for k, v in kwargs.items()}


def _value(name: str, row: int, value) -> float:
    if value is None:
        return math.nan
    if isinstance(value, (str, bytes)):
        raise RewardError(f"reward function {name!r} returned {value!r} for row {row}: not a number or None")
    try:
        if torch.is_tensor(value) and value.numel() != 1:
            raise TypeError
        return float(value)
    except (TypeError, ValueError):
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise RewardError(f"reward function {name!r} returned {shown} for row {row}: not a number or None") from None


def score(
    reward_funcs: Sequence[Callable],
    prompts: list,
    completions: list,
    completion_ids: list[list[int]],
    columns: dict[str, list] | None = None,
    trainer_state=None,
    *,
    log_extra: Callable | None = None,
    log_metric: Callable | None = None,
) -> torch.Tensor:
    """(N, F) float32 rewards of N completions under F reward functions, NaN where a function returned None;
    `RewardError` (one line naming the function and the row) for a function that raises or returns a bad value."""
    n = len(prompts)
    if len(completions) != n or len(completion_ids) != n:
        raise ValueError(f"score: {n} prompts, {len(completions)} completions, {len(completion_ids)} completion_ids")
    columns = {k: v for k, v in (columns or {}).items() if k not in ("prompt", "completion", "completion_ids")}
    for key, values in columns.items():
        if len(values) != n:
            raise ValueError(f"score: column {key!r} holds {len(values)} values for {n} completions")
    kwargs = {
        **columns,
        "trainer_state": trainer_state,
        "log_extra": log_extra or _noop,
        "log_metric": log_metric or _noop,
    }
    rewards = torch.zeros(n, len(reward_funcs), dtype=torch.float32)
    for i, func in enumerate(reward_funcs):
        name = reward_name(func)
        if isinstance(func, RewardModel):
            rewards[:, i] = func(prompts, completions)
            continue
        call = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **kwargs}
        try:
            out = _call(func, call)
        except Exception as e:
            raise RewardError(_raised(func, name, call, n, e)) from None
        try:
            out = list(out)
        except TypeError:
            raise RewardError(
                f"reward function {name!r} returned a {type(out).__name__}, not a list of {n} rewards"
            ) from None
        if len(out) != n:
            raise RewardError(
                f"reward function {name!r} returned {len(out)} rewards for {n} completions (one per completion)"
            )
        rewards[:, i] = torch.tensor([_value(name, row, v) for row, v in enumerate(out)], dtype=torch.float32)
    return rewards


def _raised(func: Callable, name: str, call: dict, n: int, error: Exception) -> str:
    """The message for a function that raised on the batch: the first row it raises on alone, if any."""
    for row in range(n):
        try:
            _call(func, _rows(call, row, n))
        except Exception as e:
            return f"reward function {name!r} raised on row {row}: {_one_line(e)}"
    return f"reward function {name!r} raised on the batch of {n} (on no row alone): {_one_line(error)}"
