"""`python -m trainer.generate`: try a model with our model code.

    python -m trainer.generate --model outputs/demo --prompt "reverse: hello"
    python -m trainer.generate --model outputs/demo --prompt "add: 12+30" --temperature 0.8 --top_p 0.9
    python -m trainer.generate --model outputs/demo --chat          # an interactive chat (empty line ends it)
    python -m trainer.generate --model BASE --adapter outputs/lora --prompt "..."   # a LoRA adapter, unmerged

The prompt is wrapped as a user message and rendered with the model's chat template (`--raw` feeds the text
as is); decoding is greedy unless `--temperature` > 0. In `--chat` each turn is read after a `> ` prompt
(shown when stdin is a terminal; piped input reads line by line silently); an empty line, end of input
(Ctrl-D) or Ctrl-C ends the chat without a traceback (Ctrl-C exits with 130, as shells expect).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from trainer.build import build_model
from trainer.coerce import ConfigError
from trainer.data.tokenizer import TokenizerError
from trainer.model.causal_lm import ModelError, generate
from trainer.model.lora import load_adapter, trained_over_quantized


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer.generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a Hugging Face model directory or a preset name")
    p.add_argument("--adapter", help="a LoRA adapter directory trained on --model (peft's layout), applied unmerged")
    p.add_argument("--prompt", help="the user message (or raw text with --raw)")
    p.add_argument("--chat", action="store_true", help="interactive multi-turn chat on stdin")
    p.add_argument("--system", help="an optional system message")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p


def reply(model, tokenizer, messages_or_text, args, generator) -> str:
    if isinstance(messages_or_text, str):
        ids = tokenizer.encode(messages_or_text)
    else:
        ids = tokenizer.apply_chat_template(messages_or_text, add_generation_prompt=True, tokenize=True)
    prompt = torch.tensor([ids], device=args.device)
    out = generate(
        model,
        prompt,
        args.max_new_tokens,
        eos_token_id=tokenizer.eos_token_id,
        temperature=args.temperature,
        top_p=args.top_p,
        generator=generator,
    )
    return tokenizer.decode(out[0, len(ids) :].tolist())


def main(argv=None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print(file=sys.stderr)  # end the line the interrupted prompt or answer left open
        return 130


def _main(argv) -> int:
    args = build_parser().parse_args(argv)
    if not args.chat and args.prompt is None:
        print("error: give --prompt TEXT or --chat", file=sys.stderr)
        return 2
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        print("error: --temperature must be >= 0 and --top_p in (0, 1]", file=sys.stderr)
        return 2
    try:
        model, tokenizer = build_model(args.model, device=args.device, seed=args.seed)
        if args.adapter:
            run = trained_over_quantized(Path(args.adapter))
            if run is not None:
                bits = 4 if run.load_in_4bit else 8
                print(
                    f"the adapter was trained over {bits}-bit weights: the base runs in {bits} bits too",
                    file=sys.stderr,
                )
            load_adapter(model, Path(args.adapter))
    except (ConfigError, ModelError, TokenizerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    model.eval()
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    system = [{"role": "system", "content": args.system}] if args.system else []
    if not args.chat:
        print(
            reply(
                model,
                tokenizer,
                args.prompt if args.raw else system + [{"role": "user", "content": args.prompt}],
                args,
                generator,
            )
        )
        return 0
    history = list(system)
    prompt = "> " if sys.stdin.isatty() else ""
    if prompt:
        print(f"chatting with {args.model}; an empty line or Ctrl-D ends the chat", file=sys.stderr)
    while True:
        try:
            line = input(prompt)
        except EOFError:
            break
        if not line:
            break
        history.append({"role": "user", "content": line})
        answer = reply(model, tokenizer, history, args, generator)
        history.append({"role": "assistant", "content": answer})
        print(answer, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
