"""GRPO's rewards: reward functions loaded from specs, called as TRL calls them, checked (issue 31 item 2).

A spec (`load_reward_function`, the `--reward_funcs` values) is resolved in this order:
  1. a built-in name: exact_match, format (the embedded tasks', below) or a name of TRL 1.16's `trl grpo` registry,
     accuracy_reward, reasoning_accuracy_reward, think_format_reward, get_soft_overlong_punishment (TRL's
     semantics, reimplemented here: below); first, as TRL's script looks in its registry first
  2. path/to/file.py:function   a function of a Python file (imported under a private module name)
     package.module:function    a function of an importable module
     package.module.function    TRL's dotted import path: the module before the last dot, its attribute after it
  3. path/to/checkpoint_dir     a reward model: a sequence-classification checkpoint (`RewardModel`)
A module of either module form is imported from the working directory, then sys.path: as under `trl grpo`, which
puts the working directory first on sys.path. `python -m trainer.grpo` has it first already; where it is not on
sys.path (the Python API from elsewhere, a console script) it is put first for the import, and kept there only when
the module came from it (TRL's script leaves it first whatever the module). A dotted spec that is both a directory
and a function that resolves is ambiguous; a directory whose dotted form does not resolve is the reward model, and
a directory named like path.py:function or module:function is the directory, unimported (as before). Any other
failure (no such module, file or directory, a module that raises on import, no such function, not callable) is a
`ConfigError` in one line naming the spec and what was tried. `load_reward_functions(specs, weights)` loads
several, with TRL's check that the weights (default 1 each) match them in number.

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

TRL's registry (trl/scripts/grpo.py, the functions of trl/rewards), same names, values and display names; as in
TRL a completion is its first message's content (a text completion, which TRL's fail on, is taken as it is):
  think_format_reward           1.0 when the completion matches ^<think>(?!.*<think>)(.*?)</think>.*$ (DOTALL,
                                MULTILINE), else 0.0
  get_soft_overlong_punishment  DAPO's soft overlong punishment of the completion's token count with TRL's script's
                                values, max_completion_len=1280, soft_punish_cache=256 (whatever the run's
                                max_completion_length): 0 up to 1024 tokens, then falling linearly to -1 at 1280,
                                -1 beyond; logged as soft_overlong_punishment_reward. Other values:
                                `get_soft_overlong_punishment(max_completion_len, soft_punish_cache)` in a module of
                                one's own, named by the module forms
  accuracy_reward               math_verify's verdict (1.0/0.0) of the completion against the `solution` column, None
                                where the solution does not parse
  reasoning_accuracy_reward     the same on the text after </think>; 0.0 without </think>
The last two need the math_verify package, as TRL's do (a spec naming one without it is a ConfigError).

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
import logging
import math
import os
import re
import sys
import threading
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


# ------------------------------------------------------------------------------------------------------------
# TRL 1.16's registry (trl/scripts/grpo.py; the rewards of trl/rewards, reimplemented: trl is no dependency)
# ------------------------------------------------------------------------------------------------------------
def _content(completion) -> str:
    """TRL's `completion[0]["content"]` (the first message's), or a text completion as it is."""
    return completion if isinstance(completion, str) else completion[0]["content"]


_THINK = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL | re.MULTILINE)


def think_format_reward(completions, **kwargs) -> list[float]:
    """TRL's think_format_reward: 1.0 when the completion opens with one <think>...</think> block, else 0.0."""
    return [1.0 if _THINK.match(_content(c)) else 0.0 for c in completions]


class _SoftOverlongPunishment:
    """TRL's soft overlong punishment (DAPO, Eq. 13) of the completion's token count: 0 up to max - cache tokens,
    (max - cache - length) / cache up to max, -1 beyond. A class, as in TRL, under TRL's display name."""

    __name__ = "soft_overlong_punishment_reward"

    def __init__(self, max_completion_len: int, soft_punish_cache: int):
        self.max_completion_len, self.soft_punish_cache = max_completion_len, soft_punish_cache

    def __call__(self, completion_ids, **kwargs) -> list[float]:
        top, cache = self.max_completion_len, self.soft_punish_cache
        out = []
        for ids in completion_ids:
            n = len(ids)
            out.append(0.0 if n <= top - cache else (top - cache - n) / cache if n <= top else -1.0)
        return out


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> Callable:
    """TRL's factory of the soft overlong punishment (`_SoftOverlongPunishment`)."""
    return _SoftOverlongPunishment(max_completion_len, soft_punish_cache)


def _math_verify(name: str):
    """math_verify's parse, verify and configurations, or TRL's ImportError naming the reward `name`."""
    try:
        from latex2sympy2_extended import NormalizationConfig
        from math_verify import LatexExtractionConfig, parse, verify
    except ImportError:
        raise ImportError(f"Please install the `math_verify` package to use {name}") from None
    return NormalizationConfig, LatexExtractionConfig, parse, verify


def _verified(name: str, contents: Sequence[str | None], solution: Sequence[str], log_extra) -> list[float | None]:
    """TRL's accuracy check of each content against its solution: math_verify's verdict, None where the solution
    does not parse, 0.0 where the content is None (reasoning left incomplete); the parses through log_extra."""
    NormalizationConfig, LatexExtractionConfig, parse, verify = _math_verify(name)
    main = threading.current_thread() is threading.main_thread()  # math_verify's timeouts are signal.alarm's
    parsing_timeout, verify_timeout = (10, 5) if main else (None, None)
    if not main:
        logging.getLogger("math_verify.parser").setLevel(logging.ERROR)
        logging.getLogger("math_verify.grader").setLevel(logging.ERROR)
    extraction = [
        LatexExtractionConfig(
            normalization_config=NormalizationConfig(units=True),
            boxed_match_priority=0,
            try_extract_without_anchor=False,
        )
    ]
    rewards, golds, answers = [], [], []
    for content, sol in zip(contents, solution, strict=True):
        if content is None:
            rewards.append(0.0)
            golds.append("[incomplete reasoning]")
            answers.append("[incomplete reasoning]")
            continue
        gold = parse(sol, parsing_timeout=parsing_timeout)
        if len(gold) == 0:
            rewards.append(None)
            golds.append("[unparseable]")
            answers.append("[skipped]")
            continue
        answer = parse(
            content, extraction_config=extraction, extraction_mode="first_match", parsing_timeout=parsing_timeout
        )
        rewards.append(float(verify(gold, answer, timeout_seconds=verify_timeout)))
        golds.append(str(gold))
        answers.append(str(answer) if answer else "[unparseable]")
    if log_extra is not None:
        log_extra("solution", list(solution))
        log_extra("gold_parsed", golds)
        log_extra("answer_parsed", answers)
    return rewards


def accuracy_reward(completions, solution, log_extra=None, **kwargs) -> list[float | None]:
    """TRL's accuracy_reward: 1.0 when math_verify finds the completion's answer equal to the solution, else 0.0;
    None where the solution does not parse."""
    return _verified("accuracy_reward", [_content(c) for c in completions], solution, log_extra)


def reasoning_accuracy_reward(
    completions, solution, reasoning_delimiters=None, log_extra=None, **kwargs
) -> list[float | None]:
    """TRL's reasoning_accuracy_reward: accuracy_reward on the text after the last occurrence of the first of the
    delimiters (default ["</think>"]) the completion holds; 0.0 when it holds none."""
    delimiters = ["</think>"] if reasoning_delimiters is None else reasoning_delimiters
    contents = []
    for completion in completions:
        content = _content(completion)
        delimiter = next((d for d in delimiters if d in content), None)
        contents.append(None if delimiter is None else content.split(delimiter)[-1])
    return _verified("reasoning_accuracy_reward", contents, solution, log_extra)


TRL_REGISTRY: dict[str, Callable] = {
    "accuracy_reward": accuracy_reward,
    "reasoning_accuracy_reward": reasoning_accuracy_reward,
    "think_format_reward": think_format_reward,
    "get_soft_overlong_punishment": get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256),
}
BUILTINS: dict[str, Callable] = {"exact_match": exact_match, "format": format_reward, **TRL_REGISTRY}
NEEDS_MATH_VERIFY = ("accuracy_reward", "reasoning_accuracy_reward")


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


_EXPECTED = (
    "expected path.py:function, module:function, a dotted module.function (TRL's), a reward model directory or "
    f"one of {', '.join(BUILTINS)}"
)


def _function_form(spec: str) -> tuple[str, str, str] | None:
    """(kind, where, name) of a spec of a function form, kind one of file, module (module:function) and dotted
    (TRL's module.function), or None."""
    where, sep, name = spec.rpartition(":")
    if sep:
        return ("file" if where.endswith(".py") else "module", where, name) if where and name.isidentifier() else None
    where, _, name = spec.rpartition(".")
    if where and all(part.isidentifier() for part in where.split(".")) and name.isidentifier():
        return "dotted", where, name
    return None


def _on_sys_path(directory: str) -> bool:
    return any(os.path.realpath(entry or os.curdir) == directory for entry in sys.path)  # "": the working dir


def _import_module(name: str):
    """`importlib.import_module(name)` from the working directory, then sys.path (see the module docstring): the
    working directory, when not on sys.path, is put first for the import and kept only when the module came from
    it."""
    importlib.invalidate_caches()  # a module written since the last import is found
    cwd = os.path.realpath(os.getcwd())
    if _on_sys_path(cwd):
        return importlib.import_module(name)
    sys.path.insert(0, cwd)
    keep = False
    try:
        module = importlib.import_module(name)
        top = sys.modules[name.partition(".")[0]]
        files = [getattr(top, "__file__", None) or "", *getattr(top, "__path__", [])]
        keep = any(f and os.path.realpath(f).startswith(cwd + os.sep) for f in files)
        return module
    finally:
        if not keep:
            sys.path.remove(cwd)


def _module_error(where: str, e: Exception) -> str:
    """Why module `where` did not import: not found (it or a package above it), or its error."""
    if isinstance(e, ModuleNotFoundError) and e.name and (where == e.name or where.startswith(e.name + ".")):
        return f"module {where} does not import: {_one_line(e)}; looked in the working directory, then sys.path"
    return f"module {where} does not import: {_one_line(e)}"


def _load_function(kind: str, where: str, name: str) -> Callable:
    """The function of a function form, or a ConfigError saying why not (the caller prefixes the spec)."""
    if kind == "file":
        path = Path(where)
        if not path.is_file():
            raise ConfigError(f"no file {where}")
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
            raise ConfigError(f"{where} does not import: {_one_line(e)}") from None
    else:
        try:
            module = _import_module(where)
        except Exception as e:
            raise ConfigError(_module_error(where, e)) from None
    if not hasattr(module, name):
        raise ConfigError(f"{where} has no {name!r}")
    func = getattr(module, name)
    if not callable(func):
        raise ConfigError(f"{name} is a {type(func).__name__}, not callable")
    return func


def load_reward_function(spec: str, device: torch.device | str = "cpu") -> Callable:
    """The reward function a spec names (see the module docstring for the forms and their order), or a one-line
    ConfigError naming what was tried."""
    if spec in BUILTINS:
        if spec in NEEDS_MATH_VERIFY and importlib.util.find_spec("math_verify") is None:
            raise ConfigError(
                f"reward function {spec!r} needs the math_verify package, as TRL's does: pip install math-verify"
            )
        return BUILTINS[spec]
    directory = Path(spec).is_dir()
    form = _function_form(spec)
    if form is None or (directory and form[0] != "dotted"):  # a directory named like x:f is the directory, as before
        if directory:
            return RewardModel(spec, device=device)
        raise ConfigError(f"reward function {spec!r}: not a built-in, a function or a directory; {_EXPECTED}")
    kind, where, name = form
    try:
        func = _load_function(kind, where, name)
    except ConfigError as e:
        if kind != "dotted":
            raise ConfigError(f"reward function {spec!r}: {e}") from None
        tried = f"module {where}, function {name!r} ({e})"
        if directory:  # the function form does not resolve: the directory is the reward model
            try:
                return RewardModel(spec, device=device)
            except ConfigError as model_error:
                raise ConfigError(f"{model_error}; tried {tried} too") from None
        hint = f"; {spec} is a file: name a function of it, {spec}:function" if Path(spec).is_file() else ""
        raise ConfigError(
            f"reward function {spec!r}: tried {tried} and a reward model directory {spec} (there is none){hint}"
        ) from None
    if directory:
        raise ConfigError(
            f"reward function {spec!r} is ambiguous: both the directory {spec} (a reward model) and function "
            f"{name!r} of {where}; name the directory ./{spec} or the function {where}:{name}"
        )
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
