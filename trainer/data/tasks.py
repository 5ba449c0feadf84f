"""The embedded demo dataset: short instruction tasks whose answers can be checked exactly, and their preference pairs.

The `tiny` preset (0.77M parameters, byte-level tokenizer) must visibly learn something on a CPU in minutes, so
the tasks are short string manipulations a small transformer picks up fast, and whose answers are either right
or wrong (exact match after stripping whitespace):

    reverse: plant      -> tnalp      a 3-6 letter lowercase word, reversed
    sort: 5203          -> 0235       3-5 digits in ascending order
    add: 47+8           -> 55         two numbers of 0-99
    upper: cat          -> CAT        a 3-6 letter word in capitals
    convert: 42 km to m -> 42000      a length, mass or volume of 1-999 to a smaller unit (x10, x100, x1000)

Each example is a conversation, {"messages": [{"role": "user", ...}, {"role": "assistant", ...}]}; prompts are
at most 21 characters. `generate_tasks(n, seed)` is a pure function of (n, seed): the kinds take turns (so every
n divisible by 5 is balanced), prompts never repeat, and generate_tasks(n) is a prefix of generate_tasks(n + k).
The shipped files are its first 4000 examples (train) and the next 200 (eval), so their prompts are disjoint:

    # rewrites tasks_train.jsonl and tasks_eval.jsonl bit-identically:
    python -m trainer.data.tasks --out trainer/data/demo_data

The GRPO demo samples answers to new prompts, the continuation of the same sequence (`unseen_tasks`). The DPO demo
turns the same conversations into preference pairs (`preference_pair`): the right answer chosen, a plausible wrong
one rejected (`wrong_answer`: an off-by-one sum, a misordered sort, ...); no extra files ship.

Randomness comes from a hand-written SplitMix64 rather than `random`/numpy so the files never change with a
library version.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DATA_DIR = Path(__file__).parent / "demo_data"  # not "data/": a folder so named shadowed trainer/data/sft_data.py
TRAIN_FILE = DATA_DIR / "tasks_train.jsonl"
EVAL_FILE = DATA_DIR / "tasks_eval.jsonl"
NUM_TRAIN, NUM_EVAL, SEED = 4000, 200, 0
KINDS = ("reverse", "sort", "add", "upper", "convert")
_LETTERS = "abcdefghijklmnopqrstuvwxyz"
# (from, to, factor): metric conversions to a smaller unit, so every answer is an integer.
_CONVERSIONS = (
    ("km", "m", 1000),
    ("m", "cm", 100),
    ("cm", "mm", 10),
    ("m", "mm", 1000),
    ("kg", "g", 1000),
    ("g", "mg", 1000),
    ("l", "ml", 1000),
    ("t", "kg", 1000),
)
_MASK64 = (1 << 64) - 1


class _SplitMix64:
    """Steele, Lea and Flood's SplitMix64: tiny, fast, and defined bit for bit."""

    def __init__(self, seed: int):
        self.state = seed & _MASK64

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & _MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        """An int in [0, n); the modulo bias is below n / 2**64, nothing for n this small."""
        return self.next() % n

    def between(self, lo: int, hi: int) -> int:
        return lo + self.below(hi - lo + 1)

    def word(self, lo: int = 3, hi: int = 6) -> str:
        return "".join(_LETTERS[self.below(26)] for _ in range(self.between(lo, hi)))


def _make(kind: str, rng: _SplitMix64) -> tuple[str, str]:
    if kind == "reverse":
        w = rng.word()
        return f"reverse: {w}", w[::-1]
    if kind == "sort":
        digits = "".join(str(rng.below(10)) for _ in range(rng.between(3, 5)))
        return f"sort: {digits}", "".join(sorted(digits))
    if kind == "add":
        a, b = rng.below(100), rng.below(100)
        return f"add: {a}+{b}", str(a + b)
    if kind == "upper":
        w = rng.word()
        return f"upper: {w}", w.upper()
    if kind == "convert":
        src, dst, factor = _CONVERSIONS[rng.below(len(_CONVERSIONS))]
        value = rng.between(1, 999)
        return f"convert: {value} {src} to {dst}", str(value * factor)
    raise ValueError(f"unknown task kind {kind!r} (expected one of {', '.join(KINDS)})")


def generate_tasks(n: int, seed: int = SEED) -> list[dict]:
    """n conversations with distinct prompts, the kinds in turn; deterministic for (n, seed)."""
    rng = _SplitMix64(seed)
    seen: set[str] = set()
    out = []
    while len(out) < n:
        kind = KINDS[len(out) % len(KINDS)]
        prompt, answer = _make(kind, rng)
        if prompt in seen:
            continue
        seen.add(prompt)
        out.append({"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]})
    return out


def unseen_tasks(n: int) -> list[dict]:
    """n conversations whose prompts are in neither shipped file: generate_tasks' continuation after the train and eval
    examples (the GRPO demo samples answers to them; the reward checks each answer, no label is needed)."""
    return generate_tasks(NUM_TRAIN + NUM_EVAL + n)[NUM_TRAIN + NUM_EVAL :]


def kind_of(prompt: str) -> str | None:
    """The task kind a prompt belongs to ("reverse", ...), None for anything else."""
    head = prompt.partition(":")[0]
    return head if head in KINDS else None


def solve(prompt: str) -> str:
    """The correct answer to a task prompt, computed from the prompt alone (a check independent of the generator)."""
    head, _, arg = prompt.partition(": ")
    if head == "reverse":
        return arg[::-1]
    if head == "sort":
        return "".join(sorted(arg))
    if head == "add":
        a, b = arg.split("+")
        return str(int(a) + int(b))
    if head == "upper":
        return arg.upper()
    if head == "convert":
        value, src, _, dst = arg.split()
        factor = {(a, b): f for a, b, f in _CONVERSIONS}[(src, dst)]
        return str(int(value) * factor)
    raise ValueError(f"not a task prompt: {prompt!r} (expected one of {', '.join(KINDS)} followed by ': ')")


def wrong_answer(prompt: str) -> str:
    """A plausible wrong answer to a task prompt, the rejected side of the demo's preference pairs: a sum off by
    one, digits sorted but for one adjacent swap (or one missing when all are equal), a word left unreversed (two
    letters swapped for a palindrome), only the first letter in capitals, a conversion by a tenth of the factor."""
    right = solve(prompt)
    head, _, arg = prompt.partition(": ")
    if head == "add":
        return str(int(right) + (1 if int(right) % 2 == 0 else -1))
    if head == "sort":
        i = next((k for k in range(len(right) - 1) if right[k] != right[k + 1]), None)
        return right[:-1] if i is None else right[:i] + right[i + 1] + right[i] + right[i + 2 :]
    if head == "reverse":
        if arg != right:
            return arg
        return right[1] + right[0] + right[2:] if right[0] != right[1] else right[:-1]
    if head == "upper":
        return arg[0].upper() + arg[1:]
    return str(int(right) // 10)  # every factor is at least 10, so this is the right digits with one zero short


def preference_pair(example: dict) -> dict:
    """A task conversation as a preference pair in TRL's conversational format: the right answer chosen, a
    plausible wrong one (`wrong_answer`) rejected."""
    user, assistant = example["messages"]
    return {
        "prompt": [user],
        "chosen": [assistant],
        "rejected": [{"role": "assistant", "content": wrong_answer(user["content"])}],
    }


def exact_match(prediction: str, reference: str) -> bool:
    """Right or wrong, ignoring surrounding whitespace."""
    return prediction.strip() == reference.strip()


def _dumps(examples: list[dict]) -> str:
    return "".join(json.dumps(ex, ensure_ascii=False) + "\n" for ex in examples)


def write_task_files(
    out_dir: str | Path, num_train: int = NUM_TRAIN, num_eval: int = NUM_EVAL, seed: int = SEED
) -> tuple[Path, Path]:
    """Write tasks_train.jsonl and tasks_eval.jsonl under out_dir; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    examples = generate_tasks(num_train + num_eval, seed)
    train, evals = out_dir / TRAIN_FILE.name, out_dir / EVAL_FILE.name
    train.write_bytes(_dumps(examples[:num_train]).encode("utf-8"))
    evals.write_bytes(_dumps(examples[num_train:]).encode("utf-8"))
    return train, evals


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trainer.data.tasks", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(DATA_DIR), help="output directory (default: the package's demo_data/)")
    parser.add_argument("--train", type=int, default=NUM_TRAIN, help="training examples")
    parser.add_argument("--eval", type=int, default=NUM_EVAL, help="held-out examples, prompts disjoint from train")
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args(argv)
    for path in write_task_files(args.out, args.train, args.eval, args.seed):
        print(path)


if __name__ == "__main__":
    main()
