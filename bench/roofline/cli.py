"""`python -m bench.roofline` and its flags: the step roofline of the four stacks (default; a transformers-path model:
its three), --ladder, --lora_stacks."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from bench import common, roofline
from bench.roofline.ladder import MODEL_LADDERS, ladder_of
from bench.roofline.ladder_report import main_ladder
from bench.roofline.lora_stacks import main_lora_stacks
from bench.roofline.report import _measured, chart, render, results_stem, summarise
from bench.roofline.stacks import OUR_MODELS, STACKS, model_step, stacks_for
from bench.roofline.tracing import DEVICES
from bench.roofline.transformers_stacks import TRANSFORMERS_MODELS


def parse_args(argv=None):
    from bench.bench_train import MODELS

    p = argparse.ArgumentParser(prog="python -m bench.roofline", description=roofline.__doc__.splitlines()[0])
    p.add_argument(
        "--model",
        default="llama-3.2-1b",
        choices=sorted(MODELS) + sorted(OUR_MODELS) + sorted(TRANSFORMERS_MODELS),
        help="our model's architectures (qwen3.5-9b: ours and hf), or a model of the transformers path (gemma-3-4b: "
        "its three stacks)",
    )
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--micro_batch", type=int, default=4)
    p.add_argument("--ignored", type=float, default=0.5, help="the second ignored fraction (0 is always run)")
    p.add_argument("--device", default="h100", choices=sorted(DEVICES))
    p.add_argument("--stacks", default=",".join(STACKS), help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="results directory (default bench/results)")
    p.add_argument(
        "--ladder",
        action="store_true",
        help="the modelled memory ladder of maximum context instead (Llama's; with --model "
        + "/".join(MODEL_LADDERS)
        + ": that model's)",
    )
    p.add_argument("--lora_stacks", action="store_true", help="the LoRA stacks at Llama-3.1-8B instead (--seq_len)")
    p.add_argument("--settings", default=None, help="--ladder's settings (comma-separated; default all the ladder's)")
    p.add_argument(
        "--ladder_stacks", default=None, help="--ladder's stacks (comma-separated; default all the ladder's)"
    )
    p.add_argument("--jobs", type=int, default=os.cpu_count(), help="--ladder's worker processes")
    p.add_argument("--render_only", action="store_true", help="--ladder's md and chart from its ladder.jsonl")
    p.add_argument("--no_calibration", dest="calibration", action="store_false", help="--ladder without calibration")
    args = p.parse_args(argv)
    if not 0 <= args.ignored < 1:
        p.error("--ignored must be in [0, 1)")
    if args.ladder:  # Llama's ladder (bench_train's models: --model is not read) or one of our models'
        if args.model not in MODELS and args.model not in MODEL_LADDERS:
            p.error(f"--ladder --model: one of {', '.join(sorted(MODELS) + list(MODEL_LADDERS))}")
        settings, stacks = ladder_of(args.model if args.model in MODEL_LADDERS else None)
        for flag, chosen, known in (
            ("settings", args.settings, settings),
            ("ladder_stacks", args.ladder_stacks, stacks),
        ):
            unknown = sorted(set(chosen.split(",")) - set(known)) if chosen else []
            if unknown:
                p.error(f"--{flag}: {', '.join(unknown)} not in this ladder's {', '.join(known)}")
    return args


def _full_config(config: dict) -> dict:
    """`config` with transformers' defaults for its model_type filled in (a config.json as transformers writes it)."""
    import transformers

    settings = {k: v for k, v in config.items() if k != "model_type"}
    full = transformers.AutoConfig.for_model(config["model_type"], **settings)
    return {**full.to_dict(), "model_type": config["model_type"]}


def main(argv=None) -> list[dict]:
    from bench.bench_train import model_config

    args = parse_args(argv)
    if args.out:
        common.RESULTS = Path(args.out)
    if args.ladder:
        return main_ladder(args)
    if args.lora_stacks:
        return main_lora_stacks(args)
    dev = DEVICES[args.device]
    if args.model in TRANSFORMERS_MODELS:
        config = dict(TRANSFORMERS_MODELS[args.model])
    elif args.model in OUR_MODELS:
        config = _full_config(OUR_MODELS[args.model])
    else:
        config = model_config(args.model)
    env = common.env_info()
    rows = []
    for ignored in sorted({0.0, args.ignored}):
        for stack in stacks_for(config):
            trace = model_step(stack, config, args.micro_batch, args.seq_len, ignored)
            rows.append(
                {
                    "bench": "roofline",
                    "modelled": True,
                    "stack": stack,
                    "ignored": ignored,
                    "model": args.model,
                    "seq_len": args.seq_len,
                    "micro_batch": args.micro_batch,
                    "modelled_device": dev.name,
                    "bandwidth_bytes_s": dev.bandwidth,
                    "peak_flops": dev.peak_flops,
                    "launch_s": dev.launch_s,
                    **summarise(trace, dev),
                    **env,
                }
            )
    common.RESULTS.mkdir(parents=True, exist_ok=True)
    stem = results_stem(args.model)  # roofline (+ .jsonl, .md, .png); a transformers-path model's own files
    jsonl = common.RESULTS / f"{stem}.jsonl"
    with jsonl.open("a") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")
    text = render(rows, dev, _measured(args.model, args.seq_len, args.micro_batch), args)
    (common.RESULTS / f"{stem}.md").write_text(text)
    chart(rows, common.RESULTS / f"{stem}.png")
    print(text)
    return rows
