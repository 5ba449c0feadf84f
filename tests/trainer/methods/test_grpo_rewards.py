"""GRPO's rewards (trainer/methods/grpo_rewards.py): specs load or fail in one line (TRL's dotted import paths from
the working directory among them), the built-in task rewards, TRL's registry rewards against TRL's own (skipped
without trl; the math ones without math_verify), `score`'s checks naming the function and the row, and a golden test
against TRL 1.16's
`GRPOTrainer._calculate_rewards` (custom functions with a dataset column and None, the built-ins, and a reward
model: a tiny random LlamaForSequenceClassification with the project's byte-level tokenizer saved to tmp_path)."""

from __future__ import annotations

import inspect
import math
import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from trainer.coerce import ConfigError
from trainer.data.tasks import generate_tasks, solve, wrong_answer
from trainer.data.tokenizer import byte_level_tokenizer
from trainer.methods.grpo_rewards import (
    BUILTINS,
    RewardError,
    RewardModel,
    accuracy_reward,
    exact_match,
    format_reward,
    get_soft_overlong_punishment,
    load_reward_function,
    load_reward_functions,
    reasoning_accuracy_reward,
    reward_name,
    score,
    think_format_reward,
)

REWARDS_PY = """
CALLS = []

def length_reward(prompts, completions, completion_ids, trainer_state, **kwargs):
    CALLS.append(sorted(kwargs))
    return [float(len(ids)) if kwargs["difficulty"][i] != "skip" else None for i, ids in enumerate(completion_ids)]

NOT_A_FUNCTION = 3
"""


def _one_line_error(spec, match, **kw):
    with pytest.raises(ConfigError, match=match) as info:
        load_reward_function(spec, **kw)
    assert "\n" not in str(info.value)


def test_specs_load_builtins_modules_and_files(tmp_path):
    assert load_reward_function("exact_match") is exact_match and load_reward_function("format") is format_reward
    assert load_reward_function("math:sqrt") is math.sqrt
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARDS_PY)
    func = load_reward_function(f"{path}:length_reward")
    assert reward_name(func) == "length_reward" and func.__module__.startswith("_reward_")
    assert load_reward_function(f"{path}:length_reward") is func  # the file is imported once
    funcs, weights = load_reward_functions(["exact_match", f"{path}:length_reward"], [1.0, 0.5])
    assert funcs == [exact_match, func] and torch.equal(weights, torch.tensor([1.0, 0.5]))
    assert torch.equal(load_reward_functions(["format"])[1], torch.tensor([1.0]))


def test_bad_specs_are_one_line_config_errors(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARDS_PY)
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_module_zz\n")
    _one_line_error(
        "accuracy",
        "'accuracy': not a built-in, a function or a directory; expected path.py:function, module:function, a "
        "dotted module.function \\(TRL's\\), a reward model directory or one of exact_match, format, accuracy_reward",
    )
    _one_line_error("no_such_module_zz:f", "module no_such_module_zz does not import: ModuleNotFoundError")
    _one_line_error(f"{tmp_path}/absent.py:f", "no file")
    _one_line_error(
        f"{broken}:f", "broken.py does not import: ModuleNotFoundError: No module named 'no_such_module_zz'"
    )
    _one_line_error(f"{path}:missing", "has no 'missing'")
    _one_line_error(f"{path}:NOT_A_FUNCTION", "NOT_A_FUNCTION is a int, not callable")
    _one_line_error(f"{tmp_path}", "reward model .* does not load")  # a directory without a checkpoint
    with pytest.raises(ConfigError, match="2 weights for 1 reward functions"):
        load_reward_functions(["format"], [1.0, 2.0])


# ------------------------------------------------------------------------------------------------------------
# TRL's dotted import paths, from the working directory
# ------------------------------------------------------------------------------------------------------------
@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """tmp_path as the working directory, not on sys.path (as for the Python API run from elsewhere): sys.path and
    the modules imported from it are put back afterwards."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p and Path(p).resolve() != tmp_path.resolve()])
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        if name.startswith("kw_"):
            del sys.modules[name]


def test_dotted_paths_import_from_the_working_directory(workdir):
    (workdir / "kw_pkg").mkdir()
    (workdir / "kw_pkg" / "__init__.py").write_text("")
    (workdir / "kw_pkg" / "rewards.py").write_text(REWARDS_PY)
    (workdir / "kw_flat.py").write_text(REWARDS_PY)
    cwd = str(workdir.resolve())
    stdlib = load_reward_function("os.path.join")  # any importable module: the working directory not left on sys.path
    assert stdlib is os.path.join and cwd not in sys.path
    func = load_reward_function("kw_pkg.rewards.length_reward")
    assert func.__module__ == "kw_pkg.rewards" and reward_name(func) == "length_reward"
    assert sys.path[0] == cwd  # kept, first (as TRL's script puts it): the module came from it
    assert load_reward_function("kw_flat.length_reward") is load_reward_function("kw_flat:length_reward")
    assert sys.path.count(cwd) == 1


def test_dotted_path_errors_name_what_was_tried(workdir):
    (workdir / "kw_rewards.py").write_text(REWARDS_PY)
    (workdir / "kw_broken.py").write_text("import kw_absent_inner\n")
    _one_line_error(
        "kw_absent.sub.f",
        "^reward function 'kw_absent.sub.f': tried module kw_absent.sub, function 'f' \\(module kw_absent.sub does "
        "not import: ModuleNotFoundError: No module named 'kw_absent'; looked in the working directory, then "
        "sys.path\\) and a reward model directory kw_absent.sub.f \\(there is none\\)$",
    )
    assert str(workdir.resolve()) not in sys.path  # put back after a failed import
    _one_line_error(
        "kw_broken.f",
        "module kw_broken does not import: ModuleNotFoundError: No module named 'kw_absent_inner'\\) and a reward",
    )
    _one_line_error("kw_rewards.missing", "tried module kw_rewards, function 'missing' \\(kw_rewards has no 'missing'")
    _one_line_error("kw_rewards.NOT_A_FUNCTION", "\\(NOT_A_FUNCTION is a int, not callable\\)")
    _one_line_error(
        "kw_rewards.py", "\\(there is none\\); kw_rewards.py is a file: name a function of it, kw_rewards.py:function$"
    )
    (workdir / "kw_rewards.length_reward").mkdir()  # a directory that is also a function: ambiguous
    _one_line_error(
        "kw_rewards.length_reward",
        "^reward function 'kw_rewards.length_reward' is ambiguous: both the directory kw_rewards.length_reward \\(a "
        "reward model\\) and function 'length_reward' of kw_rewards; name the directory ./kw_rewards.length_reward or "
        "the function kw_rewards:length_reward$",
    )
    (workdir / "kw_rewards.v2").mkdir()  # the function form does not resolve: the directory is the reward model
    _one_line_error(
        "kw_rewards.v2",
        "^reward model 'kw_rewards.v2' does not load: .*; tried module kw_rewards, function 'v2' \\(kw_rewards has "
        "no 'v2'\\) too$",
    )
    _one_line_error("./kw_rewards.length_reward", "^reward model './kw_rewards.length_reward' does not load")


def test_builtin_task_rewards():
    examples = generate_tasks(10)
    prompts = [[ex["messages"][0]] for ex in examples] + ["hello: world"]
    right = [[{"role": "assistant", "content": f" {solve(p[0]['content'])}\n"}] for p in prompts[:10]]
    wrong = [[{"role": "assistant", "content": wrong_answer(p[0]["content"])}] for p in prompts[:10]]
    assert exact_match(prompts, right + ["x"]) == [1.0] * 10 + [None]
    assert exact_match(prompts, wrong + ["x"]) == [0.0] * 10 + [None]
    assert exact_match(["add: 1+2", "add: 1+2"], ["3", "3"], solution=["3", "4"]) == [1.0, 0.0]  # the column wins
    assert format_reward(prompts, right + ["x"]) == [1.0] * 10 + [None]
    shapes = {
        "reverse: plant": ("tnalq", "TNALP"),
        "upper: cat": ("DOG", "CA"),
        "sort: 5203": ("9999", "023"),
        "add: 47+8": ("54", "5 5"),
        "convert: 42 km to m": ("420", "42 000"),
    }
    for prompt, (shaped, unshaped) in shapes.items():
        assert format_reward([prompt] * 2, [shaped, unshaped]) == [1.0, 0.0]


# ------------------------------------------------------------------------------------------------------------
# TRL 1.16's registry (trl/scripts/grpo.py), against TRL's own rewards
# ------------------------------------------------------------------------------------------------------------
TRL_NAMES = ["accuracy_reward", "reasoning_accuracy_reward", "think_format_reward", "get_soft_overlong_punishment"]
THINK = [
    "<think>\nThis is my reasoning.\n</think>\nThis is my answer.",
    "<think>\nThis is my reasoning.\nThis is my answer.",
    "<think></think>",
    "no reasoning",
    " <think>a</think>b",
    "x\n<think>a</think>b",
    "<think>a<think>b</think>c",
    "<think>a</think>b<think>c</think>",
    "",
]
MATH = [  # (completion, solution)
    (r"My answer is \boxed{\frac{1}{3}}", r"\frac{1}{3}"),
    (r"My answer is \boxed{\frac{1}{2}}", r"\frac{1}{3}"),
    (r"<think>maybe \boxed{7}</think> so \boxed{42}", "42"),
    (r"<think>\boxed{42}</think> no answer", "42"),
    (r"<think>\boxed{42} and no end", "42"),
    (r"\boxed{3}", "no solution here"),
    (r"<think>x</think> \boxed{3}", "no solution here"),
    (r"the answer: $x^2+1$", "$x^2+1$"),
]


def _conversation(texts):
    return [[{"role": "assistant", "content": t}] for t in texts]


def test_trls_registry_names_load_with_trls_values():
    assert list(BUILTINS)[2:] == TRL_NAMES
    assert load_reward_function("think_format_reward") is think_format_reward
    expected = [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]  # one <think> only, opening the completion
    assert think_format_reward(_conversation(THINK)) == expected and think_format_reward(THINK) == expected
    overlong = load_reward_function("get_soft_overlong_punishment")  # TRL's script's values: 1280 and 256
    assert reward_name(overlong) == "soft_overlong_punishment_reward"
    lengths = [0, 1024, 1025, 1100, 1279, 1280, 1281, 5000]
    assert overlong([[7] * n for n in lengths]) == [0.0, 0.0, -1 / 256, -76 / 256, -255 / 256, -1.0, -1.0, -1.0]
    assert get_soft_overlong_punishment(10, 4)(completion_ids=[[1] * 6, [1] * 8, [1] * 11]) == [0.0, -0.5, -1.0]


def test_trls_registry_equals_trls_rewards():
    trl_rewards = pytest.importorskip("trl.rewards")
    import trl.scripts.grpo
    from trl.trainer.utils import get_callable_name

    registry = inspect.getsource(trl.scripts.grpo.main).split("reward_funcs_registry = {")[1].split("}")[0]
    assert re.findall(r'"(\w+)":', registry) == TRL_NAMES
    assert "get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256)" in registry
    conversations = _conversation(THINK)
    assert think_format_reward(conversations) == trl_rewards.think_format_reward(conversations)
    ours, theirs = BUILTINS["get_soft_overlong_punishment"], trl_rewards.get_soft_overlong_punishment(1280, 256)
    ids = [[3] * n for n in range(0, 1400, 7)]
    assert ours(ids) == theirs(ids) and reward_name(ours) == get_callable_name(theirs)
    for name in TRL_NAMES[:3]:  # the logged names (rewards/<name>/mean)
        assert reward_name(BUILTINS[name]) == get_callable_name(getattr(trl_rewards, name))


def test_trls_math_rewards_equal_trls():
    pytest.importorskip("math_verify")
    trl_rewards = pytest.importorskip("trl.rewards")
    completions, solution = _conversation([c for c, _ in MATH]), [s for _, s in MATH]
    for ours, theirs, kw in [
        (accuracy_reward, trl_rewards.accuracy_reward, {}),
        (reasoning_accuracy_reward, trl_rewards.reasoning_accuracy_reward, {}),
        (
            reasoning_accuracy_reward,
            trl_rewards.reasoning_accuracy_reward,
            {"reasoning_delimiters": ["so", "</think>"]},
        ),
    ]:
        logged = [[], []]
        got = ours(completions, solution, log_extra=lambda *a: logged[0].append(a), **kw)
        want = theirs(completions, solution, log_extra=lambda *a: logged[1].append(a), **kw)
        assert got == want and logged[0] == logged[1], (ours.__name__, kw)
    assert accuracy_reward(completions, solution)[:2] == [1.0, 0.0] and None in accuracy_reward(completions, solution)
    assert load_reward_function("accuracy_reward") is accuracy_reward


def test_trls_math_rewards_without_math_verify_are_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # not importable
    for name in ("accuracy_reward", "reasoning_accuracy_reward"):
        _one_line_error(name, f"^reward function '{name}' needs the math_verify package, as TRL's does")
        with pytest.raises(ImportError, match=f"Please install the `math_verify` package to use {name}"):
            BUILTINS[name](_conversation(["\\boxed{1}"]), ["1"])


def test_score_checks_name_the_function_and_the_row():
    prompts, completions, ids = ["a", "b", "c"], ["x", "yy", "zzz"], [[1], [2, 3], [4, 5, 6]]

    def mixed(completions, **kwargs):
        return [None, True, np.float32(0.5)]

    def scalar_tensors(completions, **kwargs):
        return [torch.tensor(2.0), 1, float("nan")]

    def raises_on_row_1(completions, **kwargs):
        return [1.0 / (len(c) - 2) for c in completions]

    def batch_only(completions, **kwargs):
        if len(completions) > 1:
            raise RuntimeError("needs\na single row")
        return [0.0]

    out = score([mixed, scalar_tensors], prompts, completions, ids)
    assert out.dtype == torch.float32 and out.shape == (3, 2)
    torch.testing.assert_close(out, torch.tensor([[math.nan, 2.0], [1.0, 1.0], [0.5, math.nan]]), equal_nan=True)
    cases = [
        (
            raises_on_row_1,
            "reward function 'raises_on_row_1' raised on row 1: ZeroDivisionError: float division by zero",
        ),
        (batch_only, "'batch_only' raised on the batch of 3 \\(on no row alone\\): RuntimeError: needs a single row"),
        (lambda completions, **kw: [1.0, 2.0], "'<lambda>' returned 2 rewards for 3 completions"),
        (lambda completions, **kw: [1.0, "2", 3.0], "'<lambda>' returned '2' for row 1: not a number or None"),
        (lambda completions, **kw: [1.0, 2.0, [3.0]], "returned \\[3.0\\] for row 2: not a number or None"),
        (lambda completions, **kw: 7, "returned a int, not a list of 3 rewards"),
    ]
    for func, match in cases:
        with pytest.raises(RewardError, match=match) as info:
            score([func], prompts, completions, ids)
        assert "\n" not in str(info.value) and isinstance(info.value, ConfigError)


def test_score_passes_trls_keyword_arguments(tmp_path):
    path = tmp_path / "kw_rewards.py"
    path.write_text(REWARDS_PY)
    func = load_reward_function(f"{path}:length_reward")
    module = sys.modules[func.__module__]
    columns = {"prompt": ["p"] * 2, "difficulty": ["easy", "skip"], "completion": ["c"] * 2}
    out = score([func], ["p", "p"], ["c", "dd"], [[1, 2], [3]], columns, SimpleNamespace(global_step=3))
    torch.testing.assert_close(out, torch.tensor([[2.0], [math.nan]]), equal_nan=True)
    assert module.CALLS == [["difficulty", "log_extra", "log_metric"]]  # prompt/completion columns not passed


# ------------------------------------------------------------------------------------------------------------
# Golden: TRL's _calculate_rewards
# ------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("reward_model")
    tok = byte_level_tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=320,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_labels=1,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    transformers.LlamaForSequenceClassification(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _trl_rewards(funcs, processing_classes, names, prompts, completions, completion_ids, columns, state):
    trl = pytest.importorskip("trl")
    from accelerate import PartialState

    PartialState()  # one process: gather returns its input
    trainer = object.__new__(trl.GRPOTrainer)
    trainer.accelerator = SimpleNamespace(device=torch.device("cpu"), is_main_process=True)
    trainer.args = SimpleNamespace(report_to=[], device=torch.device("cpu"))
    trainer.is_deepspeed_enabled = False
    trainer.state = state
    trainer.reward_funcs, trainer.reward_processing_classes, trainer.reward_func_names = (
        funcs,
        processing_classes,
        names,
    )
    trainer.environments, trainer.chat_template_kwargs = None, {}
    trainer._log_completion_extra = trainer._log_metric = lambda *a, **k: None
    keys = list(columns)
    inputs = [{"prompt": prompts[i], **{k: columns[k][i] for k in keys}} for i in range(len(prompts))]
    return trainer._calculate_rewards(inputs, prompts, completions, completion_ids)


@pytest.mark.parametrize("conversational", [True, False])
def test_score_equals_trl_calculate_rewards(reward_model_dir, conversational):
    examples = generate_tasks(4)
    G = 2
    texts = [ex["messages"][0]["content"] for ex in examples for _ in range(G)]
    answers = [solve(t) if i % 2 == 0 else wrong_answer(t) for i, t in enumerate(texts)]
    if conversational:
        prompts = [[{"role": "user", "content": t}] for t in texts]
        completions = [[{"role": "assistant", "content": a}] for a in answers]
    else:
        prompts, completions = texts, [" " + a for a in answers]
    completion_ids = [list(a.encode()) for a in answers]
    columns = {"level": [i % 3 for i in range(len(texts))]}

    def level_reward(prompts, completions, completion_ids, level, trainer_state, **kwargs):
        return [
            None if lv == 0 else lv * len(ids) + trainer_state.global_step for lv, ids in zip(level, completion_ids)
        ]

    model = load_reward_function(str(reward_model_dir))
    assert isinstance(model, RewardModel) and reward_name(model) == reward_model_dir.name
    funcs = [level_reward, exact_match, format_reward, model]
    state = SimpleNamespace(global_step=5)
    ours = score(funcs, prompts, completions, completion_ids, columns, state)
    ref = _trl_rewards(
        [level_reward, exact_match, format_reward, model.model],
        [None, None, None, model.tokenizer],
        [reward_name(f) for f in funcs],
        prompts,
        completions,
        completion_ids,
        columns,
        state,
    )
    assert ours.shape == (8, 4) and ours[:, 3].abs().sum() > 0 and ours[:, 1].tolist() == [1.0, 0.0] * 4
    torch.testing.assert_close(ours, ref, rtol=0, atol=0, equal_nan=True)
