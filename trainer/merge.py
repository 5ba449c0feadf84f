"""`python -m trainer.merge`: merge a LoRA adapter into its base model and write a plain Hugging Face model.

    python -m trainer.merge --model BASE --adapter outputs/lora --output_dir outputs/merged

BASE is what the adapter was trained on (a Hugging Face directory, a preset, or a hub id: the `--model` of the
training run, also recorded as `base_model_name_or_path` in adapter_config.json). Every adapted weight becomes
W + s B A (peft's `merge_and_unload`, computed in the weights' dtype), modules to save replace their originals,
and the result is written as config.json + model.safetensors + the tokenizer files, which
`transformers.AutoModelForCausalLM.from_pretrained(OUT)` loads with no peft installed; its logits equal the
adapter's to the rounding of the merged weights. An adapter trained over 4-bit weights (QLoRA: the training_args.json
beside it says load_in_4bit) is merged into the base quantized and dequantized as in training, dequantize(Q(W)) +
s B A, in the base's dtype: the function the adapter learned (merging into the original W would add the quantization
error back). Exit codes: 0 done, 2 bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainer.build import build_model, save_pretrained
from trainer.coerce import ConfigError
from trainer.data.tokenizer import TokenizerError
from trainer.model.causal_lm import ModelError
from trainer.model.lora import merged, trained_over_quantized


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer.merge", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the base model: a Hugging Face directory, a preset or a hub id")
    p.add_argument("--adapter", required=True, help="a LoRA adapter directory (adapter_config.json + weights)")
    p.add_argument("--output_dir", required=True, help="where the merged model is written")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.output_dir)
    if out.resolve() == Path(args.adapter).resolve():
        print(
            "error: --output_dir must not be the adapter directory (the merged model would mix with the adapter)",
            file=sys.stderr,
        )
        return 2
    try:
        model, tokenizer = build_model(args.model, device="cpu")
        run = trained_over_quantized(Path(args.adapter))
        if run is not None:
            width = f"4-bit weights ({run.bnb_4bit_quant_type}" if run.load_in_4bit else "8-bit weights (LLM.int8"
            print(
                f"the adapter was trained over {width}, its training_args.json): merging it into the dequantized base",
                file=sys.stderr,
            )
        model = merged(model, Path(args.adapter))
        out.mkdir(parents=True, exist_ok=True)
        save_pretrained(model, out, tokenizer=tokenizer)
    except (ConfigError, ModelError, TokenizerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"merged model saved to {out.resolve()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
