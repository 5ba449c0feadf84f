"""How well a model answers held-out conversations: the exact match of its greedy answers (per kind for the embedded
tasks of `trainer.data.tasks`) and a few sampled answers, which every command reports before and after training
(`--eval_exact_match`, on for the embedded tasks; trainer/cli.py).

    conversations = held_out_conversations([str(EVAL_FILE)], 200)
    flags = exact_match_flags(model, tokenizer, conversations)     # one forward pass a batch, no decoding
    exact_match_by_kind(conversations, flags)                      # {"exact_match_after_<kind>": share, ...}
"""

import torch

from trainer.data.sft_data import read_examples
from trainer.data.tasks import kind_of
from trainer.model.causal_lm import generate


def held_out_conversations(paths, limit: int) -> list[list[dict]]:
    """The first `limit` conversations of the eval files whose last message is the assistant's answer."""
    out = []
    for example in read_examples(paths):
        if len(out) >= limit:
            break
        messages = example.get("messages")
        if messages and messages[-1]["role"] == "assistant":
            out.append(messages)
    return out


def exact_match_accuracy(model, tokenizer, conversations, batch_size: int = 64) -> float:
    """Share of conversations whose greedy answer is exactly the reference answer followed by end-of-turn."""
    if not conversations:
        return float("nan")
    flags = exact_match_flags(model, tokenizer, conversations, batch_size)
    return sum(flags) / len(flags)


@torch.no_grad()
def exact_match_flags(model, tokenizer, conversations, batch_size: int = 64) -> list[bool]:
    """Per conversation: whether its greedy answer is exactly the reference answer followed by end-of-turn.

    Greedy decoding reproduces a reference token for token and then stops iff, with the reference fed back
    (teacher forcing), the argmax at every answer position is the next reference token and, after the last,
    the end-of-turn token. That is checked for a whole batch in one forward pass instead of decoding token by
    token; `sample_answers` shows real generations.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    right = []
    for start in range(0, len(conversations), batch_size):
        rows, spans = [], []
        for messages in conversations[start : start + batch_size]:
            prompt = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=True)
            answer = tokenizer.encode(messages[-1]["content"]) + [tokenizer.eos_token_id]
            rows.append(prompt + answer)
            spans.append((len(prompt), len(answer)))
        longest = max(len(r) for r in rows)
        ids = torch.full((len(rows), longest), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1
        predicted = model(ids.to(device), attention_mask=mask.to(device)).logits.argmax(-1).cpu()  # (B, T)
        for i, (p, n) in enumerate(spans):
            right.append(bool(torch.equal(predicted[i, p - 1 : p - 1 + n], ids[i, p : p + n])))
    model.train(was_training)
    return right


def exact_match_by_kind(conversations, flags: list[bool]) -> dict[str, float]:
    """{"exact_match_after_<kind>": accuracy} for the embedded tasks (trainer/data/tasks.py), one entry per kind, from
    `exact_match_flags` of the same conversations."""
    groups: dict[str, list[bool]] = {}
    for messages, right in zip(conversations, flags, strict=True):
        kind = kind_of(messages[-2]["content"])
        if kind is not None:
            groups.setdefault(kind, []).append(right)
    return {f"exact_match_after_{kind}": sum(group) / len(group) for kind, group in groups.items()}


@torch.no_grad()
def sample_answers(model, tokenizer, conversations, max_new_tokens: int) -> list[tuple[str, str, str]]:
    """(prompt, greedy answer, reference) for a few conversations, decoded token by token with the KV cache."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    out = []
    for messages in conversations:
        prompt = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=True)
        ids = generate(
            model, torch.tensor([prompt], device=device), max_new_tokens, eos_token_id=tokenizer.eos_token_id
        )
        out.append(
            (messages[-2]["content"], tokenizer.decode(ids[0, len(prompt) :].tolist()).strip(), messages[-1]["content"])
        )
    model.train(was_training)
    return out
