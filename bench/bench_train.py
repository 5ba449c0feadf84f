"""End-to-end training benchmark: our Trainer vs Hugging Face `transformers.Trainer` (and with liger-kernel).

Three configurations train the same model from the same weights on the same data, in the same run, each in its
own subprocess (so peak memory is that configuration's alone and no allocator or compile cache is shared):
    ours       trainer.loop.trainer.Trainer + trainer.model.causal_lm.CausalLM (use_kernels=True, optim adamw_fused)
    hf         transformers.Trainer + transformers.LlamaForCausalLM (its default optim adamw_torch_fused)
    hf_liger   the same with use_liger_kernel=True; CUDA only (liger's Triton kernels have no CPU path; on a CPU
               the row is recorded as skipped, with the reason)
    ours_long  ours at its most memory-frugal: gradient checkpointing, activation offloading, the tiled MLP
    ours_ckpt  ours_long without activation offloading (ours_long / ours_ckpt is what offloading costs in time)
    ours_tf    our Trainer over the transformers path (--model_impl transformers: transformers' LlamaForCausalLM with
               our RMSNorm and fused linear cross-entropy inside, trainer/model/transformers_model.py): what the path
               for the model types ours does not cover gives, measured against ours, hf and hf_liger on one model
    hf_ckpt    hf with gradient checkpointing (non-reentrant), the stack long-context comparisons use
               (ours_long, ours_ckpt and hf_ckpt run only when --configs names them: for the memory ladders)
    ours_lora  ours with --use_peft: a LoRA adapter (trainer/model/lora.py) on every linear layer but lm_head
    hf_lora    transformers.Trainer over peft.get_peft_model(LlamaForCausalLM, the same LoraConfig)
               Both LoRA rows: r=16, lora_alpha=32, no dropout; their ratios are against hf_lora. Unavoidable: A's
               random init differs (ours drawn from --seed's generator, peft's from the global RNG).
    ours_qlora ours_lora over 4-bit base weights (--load_in_4bit: NF4, double quantization, trainer/model/quant.py)
    hf_qlora   hf_lora over LlamaForCausalLM loaded with BitsAndBytesConfig(load_in_4bit, nf4, double quantization):
               transformers + peft + bitsandbytes, QLoRA as TRL runs it. Both compute in the weights' dtype (fp32,
               under bf16 autocast on a GPU); ours_qlora's ratios are against hf_qlora. Named by --configs only.
    ours_dpo   DPO: trainer.methods.preference.PreferenceTrainer (what `python -m trainer.dpo` runs; use_kernels=True,
               the policy's loss inside kernels.fused_linear_preference_loss, the reference a frozen copy)
    trl_dpo    trl.DPOTrainer over LlamaForCausalLM (its reference a copy loaded from the same directory; its own
               chunked log-prob LM head)
    trl_dpo_liger  the same with use_liger_kernel=True (TRL 1.x then applies liger's layer kernels, RMSNorm, RoPE
               and SwiGLU, keeping its own LM head); CUDA only like hf_liger
               The DPO rows: sigmoid loss, beta 0.1, the same preference pairs in the same order (sequential
               sampling in both: the same pairs in every step), tokenised alike (the byte-level tokenizer and its
               ChatML template saved with the model: tests/trainer/methods/test_golden_dpo.py shows TRL's ids and ours
               agree); their ratios are against trl_dpo.
The model is a Llama architecture with random init: `tiny` (the trainer preset) on a CPU, Qwen2.5-0.5B or
Llama-3.2-1B dimensions on a GPU. The parent builds it once (CausalLM.init_weights(seed)), writes it with
`save_pretrained`, and every worker loads that directory: ours with `load_pretrained`, HF with
`LlamaForCausalLM.from_pretrained`.

Same work in every configuration:
- data: the embedded tasks (trainer/data/demo_data/tasks_train.jsonl, chat-templated with the byte-level tokenizer) or
  seeded random ids (--data synthetic), concatenated and cut into blocks of exactly seq_len tokens, every token a
  target: no padding, so each micro batch is one dense (micro_batch, seq_len) tensor in both trainers. The
  dataset holds exactly global_batch * steps blocks: one epoch, every block seen once by every configuration;
- micro batch, gradient accumulation, steps, seed; AdamW with the same lr, betas, eps and weight decay (decay
  on the same parameters: both exclude norm weights and 1-D tensors), constant lr, no warmup, max_grad_norm 1.0;
- precision: fp32 on a CPU; bf16 autocast over fp32 parameters on a GPU (both trainers' --bf16);
- torch threads: one per worker on a CPU (--threads), the default on a GPU;
- no evaluation, no checkpoint saving, logging off (logging_strategy="no", report_to none, no progress bar),
  dataloader in the main process, no torch.compile, no gradient checkpointing, sdpa attention.
Unavoidable differences (documented, not hidden):
- sample order: each trainer shuffles with its own sampler (ours: trainer.data.batching.BatchLoader; HF: a seeded
  RandomSampler), so the steps see the same blocks in a different order and the final loss differs by that;
- each trainer's own AdamW implementation (ours: kernels.FusedAdamW, Triton on CUDA, the PyTorch reference on a
  CPU; HF: torch.optim.AdamW(fused=True)): the same update rule, which is part of what is compared. Override with
  --our-optim / --hf-optim (e.g. both adamw_torch) to separate it out.

Measured per configuration: tokens/s = tokens per step / the median step time over the steps after
--warmup-steps (the clock is read at each step end, after a CUDA synchronize; the median, because a shared CPU's
bursts of contention would otherwise decide the comparison; the mean is kept as tokens_per_s_mean), repeated
--repeats times in alternating order with the median repeat reported; MFU (achieved model FLOP/s over the
device's dense bf16 peak, trainer.loop.metrics.device_peak_flops; FLOPs per token from CausalLM.flops_per_token: 6N +
attention; None on a CPU or unknown device), peak memory (torch.cuda.max_memory_allocated on a GPU; on a CPU the
worker process's max RSS, imports included), and the loss after the last step (mean next-token cross-entropy of a
fixed held-out batch, fp32, computed by the same code for every configuration). Rows carry ratios against their
`baseline` (hf, hf_lora or trl_dpo) from the same run.

DPO rows: a micro batch is --micro-batch pairs (2 x that many sequences); the pairs are the embedded tasks' (the
right answer chosen, a plausible wrong one rejected: trainer.data.tasks.preference_pair; about 40-80 tokens a
sequence, --seq-len not used) or, with --data synthetic, random letters: a prompt and two answers of seq_len / 2
tokens each (chat markup included), so each sequence is --seq-len tokens. tokens/s counts both sequences of every
pair (prompt twice) over the timed steps' median step time (pairs_per_s beside it); MFU takes the policy's
forward + backward and the reference's forward (4/3 of the SFT figure per token); the loss is a held-out DPO loss
(EVAL_PAIRS pairs, sigmoid, beta 0.1, the starting model as reference, fp32, the same code for both).

--memory-ladder micro_batch,seq_len: for each configuration, the largest micro batch that fits at --seq-len (from
--micro-batch up) and the longest sequence that fits at micro batch 1 (from --seq-len up), found by doubling until
out-of-memory, then
bisecting (--ladder-bisect probes at most); every probe is a fresh subprocess running 2 optimizer steps on synthetic
ids (so the optimizer state is allocated, and an OOM ends the probe, not the ladder). On a CPU nothing runs out of
memory: the ladder climbs to its small --ladder-max-* rungs (a smoke run; peak memory is the worker's max RSS).

Committed CPU results (bench/results/train.md, perf_figure=False), one thread on 2 shared cores, seq 128 x micro
4, fp32. Latest (tiny at 0.77M parameters, `--quick --steps 30 --warmup-steps 5 --repeats 5`): ours 3899 tok/s
vs HF 3787 (1.03x by medians of 5 alternating runs whose ranges overlap: 3449-4369 vs 3134-4005), peak RSS
0.93x. Before FusedAdamW took torch's fused CPU AdamW on a CPU (its reference path cost ~8% of a step at this
size) the same command measured 0.98x. The earlier 3.0M tiny: 1279 vs 1208 tok/s (1.06x, 10 steps, 3 runs).
With 2 threads per worker on the same loaded cores both ran 4-5x slower and the order of the two flipped
between repeats, hence --threads 1 on a CPU.

Usage:
    python bench/bench_train.py --quick                  # CPU: tiny model, a couple of minutes
    python bench/bench_train.py --model llama-3.2-1b     # GPU: rows to bench/results/train.jsonl (+ .md)
    python bench/bench_train.py --memory-ladder micro_batch,seq_len --model llama-3.2-1b --seq-len 2048
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench import common, step_profile  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIGS = ("ours", "hf", "hf_liger", "ours_lora", "hf_lora", "ours_dpo", "trl_dpo", "trl_dpo_liger")
# named by --configs only: ours_long, ours_ckpt and hf_ckpt for the memory ladders and offloading's cost, the
# QLoRA pair (bitsandbytes needed)
CONFIGS = (*DEFAULT_CONFIGS, "ours_long", "ours_ckpt", "hf_ckpt", "ours_qlora", "hf_qlora", "ours_tf")
DPO_CONFIGS = ("ours_dpo", "trl_dpo", "trl_dpo_liger")
QLORA = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)  # ours_qlora, hf_qlora
# what each row's ratios are against: LoRA against LoRA, QLoRA against QLoRA, DPO against TRL's DPO, the rest hf
BASELINES = {
    **{impl: "hf_lora" for impl in ("ours_lora", "hf_lora")},
    **{impl: "hf_qlora" for impl in ("ours_qlora", "hf_qlora")},
    **dict.fromkeys(DPO_CONFIGS, "trl_dpo"),
}
LONG_CONTEXT = dict(gradient_checkpointing=True, activation_offloading=True, tiled_mlp=True)  # ours_long
DPO_BETA = 0.1
EVAL_PAIRS = 8  # held-out pairs for the DPO rows' final loss
# tokens the byte-level tokenizer's ChatML template adds: around a user prompt with the generation prompt, after an
# answer (synthetic pairs: prompt and answer each seq_len / 2 tokens)
SYNTHETIC_PROMPT_MARKUP, SYNTHETIC_ANSWER_MARKUP = 19, 2
LORA = dict(
    r=16,
    lora_alpha=32,
    lora_dropout=0.0,
    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
)
# Architecture dims only (random init); Hugging Face config keys. tiny = trainer.build.PRESETS["tiny"].
MODELS = {
    "tiny": None,
    "qwen2.5-0.5b": {  # Qwen2.5-0.5B's dims in a Llama architecture (no qkv bias)
        "model_type": "llama",
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "eos_token_id": 258,
        "pad_token_id": 256,
    },
    "llama-3.2-1b": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "eos_token_id": 258,
        "pad_token_id": 256,
    },
}
EVAL_BLOCKS = 8  # held-out blocks for the final loss


# ---------------------------------------------------------------------------------------------------------
# Data and model (built identically in every process from the spec)
# ---------------------------------------------------------------------------------------------------------


def token_stream(data: str, n_tokens: int, vocab: int, seed: int) -> torch.Tensor:
    """At least n_tokens int64 ids: the chat-templated embedded tasks (cycled), or seeded random ids."""
    if data == "synthetic":
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(0, vocab, (n_tokens,), generator=gen)
    from trainer.data.sft_data import load_sft_dataset
    from trainer.data.tasks import TRAIN_FILE
    from trainer.data.tokenizer import byte_level_tokenizer

    ds = load_sft_dataset([TRAIN_FILE], byte_level_tokenizer(), cutoff_len=None, show_progress=False)
    ids = torch.from_numpy(ds.input_ids.astype("int64"))  # (all tokens,) of the 4000 conversations
    reps = -(-n_tokens // ids.numel())
    return ids.repeat(reps)[:n_tokens]


def blocks(spec: dict) -> tuple[list[dict], torch.Tensor]:
    """(train blocks as {"input_ids", "labels"} of seq_len tokens, held-out (EVAL_BLOCKS, seq_len) batch)."""
    t, n_train = spec["seq_len"], spec["micro_batch"] * spec["grad_accum"] * spec["steps"]
    ids = token_stream(spec["data"], (n_train + EVAL_BLOCKS) * t, spec["vocab_size"], spec["seed"])
    ids = ids.view(n_train + EVAL_BLOCKS, t)  # (N, T)
    train = [{"input_ids": row, "labels": row} for row in ids[:n_train]]
    return train, ids[n_train:]


def collate(examples: list[dict]) -> dict:
    """Dense (B, T) batches: every block has seq_len tokens, no padding, every token a target."""
    ids = torch.stack([ex["input_ids"] for ex in examples])  # (B, T)
    return {"input_ids": ids, "labels": torch.stack([ex["labels"] for ex in examples])}


def preference_pairs(spec: dict) -> tuple[list[dict], list[dict]]:
    """(train pairs, EVAL_PAIRS held-out pairs) in TRL's conversational format: micro_batch x grad_accum x steps
    training pairs, one epoch. The embedded tasks' pairs, or (data synthetic) random letters: seq_len tokens a
    sequence with the byte-level tokenizer, half prompt, half answer."""
    n_train = spec["micro_batch"] * spec["grad_accum"] * spec["steps"]
    n = n_train + EVAL_PAIRS
    if spec["data"] == "synthetic":
        import random

        rng = random.Random(spec["seed"])
        half = spec["seq_len"] // 2

        def text(k):
            return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(max(k, 1)))

        def turn(role, k):
            return [{"role": role, "content": text(k)}]

        prompt, answer = half - SYNTHETIC_PROMPT_MARKUP, spec["seq_len"] - half - SYNTHETIC_ANSWER_MARKUP
        pairs = [
            {"prompt": turn("user", prompt), "chosen": turn("assistant", answer), "rejected": turn("assistant", answer)}
            for _ in range(n)
        ]
    else:
        from trainer.data.tasks import generate_tasks, preference_pair

        pairs = [preference_pair(ex) for ex in generate_tasks(n, seed=spec["seed"])]
    return pairs[:n_train], pairs[n_train:]


def model_config(name: str) -> dict:
    from trainer.build import PRESETS

    return dict(PRESETS["tiny"]) if name == "tiny" else dict(MODELS[name])


def flops_per_token(config: dict, seq_len: int) -> int:
    from trainer.model.causal_lm import CausalLM, ModelConfig

    with torch.device("meta"):
        model = CausalLM(ModelConfig.from_hf(config))
    return model.flops_per_token(seq_len)


def write_model(config: dict, seed: int, path: Path) -> None:
    from trainer.build import save_pretrained
    from trainer.data.tokenizer import byte_level_tokenizer
    from trainer.model.causal_lm import CausalLM, ModelConfig

    model = CausalLM(ModelConfig.from_hf(config))
    model.init_weights(seed)
    save_pretrained(model, path, dtype=torch.float32)
    byte_level_tokenizer().save_pretrained(path)  # with its ChatML template: what TRL tokenises the DPO pairs with


@torch.no_grad()
def heldout_loss(model, ids: torch.Tensor, device: torch.device) -> float:
    """Mean next-token cross-entropy of ids (B, T) in fp32, from the logits: the same code for every model."""
    model.eval()
    total = 0.0
    for row in ids.to(device).split(2):
        logits = model(input_ids=row).logits.float()  # (b, T, V)
        total += torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), row[:, 1:].reshape(-1), reduction="sum"
        ).item()
    return total / (ids.shape[0] * (ids.shape[1] - 1))


@torch.no_grad()
def heldout_dpo_loss(model, reference, pairs, device: torch.device, beta: float = DPO_BETA) -> float:
    """Mean DPO (sigmoid) loss of `pairs` (a trainer.data.preference_data.PreferenceDataset) in fp32 from the logits,
    one sequence at a time (no padding): the same code for every model."""
    import numpy as np

    model.eval()

    def logp(m, prompt, answer) -> float:
        ids = torch.from_numpy(np.concatenate([prompt, answer]).astype(np.int64))[None].to(device)  # (1, P + A)
        logits = m(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # (A, V)
        return torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None]).sum().item()

    total = 0.0
    for i in range(len(pairs)):
        pair = pairs[i]
        margin = 0.0
        for side, sign in (("chosen", 1.0), ("rejected", -1.0)):
            answer = pair[f"{side}_ids"]
            margin += sign * (logp(model, pair["prompt_ids"], answer) - logp(reference, pair["prompt_ids"], answer))
        total += -torch.nn.functional.logsigmoid(torch.tensor(beta * margin, dtype=torch.float64)).item()
    return total / len(pairs)


# ---------------------------------------------------------------------------------------------------------
# Worker: one configuration in its own process
# ---------------------------------------------------------------------------------------------------------


def _timer(base):
    """A step-end clock as a callback of either trainer (both call on_step_end(args, state, control, **kw))."""

    class StepClock(base):
        def __init__(self):
            self.times: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())
            return control

    return StepClock()


def _common_args(spec: dict, device: torch.device) -> dict:
    """The TrainingArguments every configuration shares (both trainers take these names)."""
    return dict(
        output_dir=spec["output_dir"],
        per_device_train_batch_size=spec["micro_batch"],
        gradient_accumulation_steps=spec["grad_accum"],
        max_steps=spec["steps"],
        learning_rate=spec["lr"],
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_epsilon=1e-8,
        weight_decay=0.1,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        seed=spec["seed"],
        bf16=device.type == "cuda",
        eval_strategy="no",
        save_strategy="no",
        logging_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        gradient_checkpointing=False,
    )


def _train_and_time(spec: dict, trainer, clock, device: torch.device) -> dict:
    """Train, then {"status": "ok", the timed steps' median and summed step time, the peak memory (read before
    any held-out evaluation)}, or {"status": "oom", "reason"}. Raises unless every step ran."""
    try:
        t0 = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - t0
    except torch.OutOfMemoryError as exc:
        return {"status": "oom", "reason": str(exc).splitlines()[0][:200]}
    if len(clock.times) != spec["steps"]:
        raise RuntimeError(f"{spec['impl']}: {len(clock.times)} steps ran, {spec['steps']} expected")
    w = spec["warmup_steps"]
    times = clock.times[:-1] if spec.get("profile") else clock.times  # the profiled last step is not timed
    step_s = sorted(b - a for a, b in zip(times[w - 1 :], times[w:]))  # (timed,) per-step seconds
    median_s = step_s[len(step_s) // 2] if len(step_s) % 2 else sum(step_s[len(step_s) // 2 - 1 :][:2]) / 2
    if device.type == "cuda":
        peak, kind = torch.cuda.max_memory_allocated() / 1e9, "cuda_max_allocated"
    else:
        import resource

        peak, kind = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, "cpu_max_rss"
    return {
        "status": "ok",
        "median_s": median_s,
        "sum_s": sum(step_s),
        "timed_steps": len(step_s),
        "train_wall_s": wall,
        "step_ms": 1e3 * median_s,
        "peak_memory_gb": peak,
        "peak_memory_kind": kind,
    }


def worker(spec: dict) -> dict:
    impl = spec["impl"]
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    device = common.device()
    if device.type == "cuda":
        if spec.get("max_memory_gb"):
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, spec["max_memory_gb"] * 1e9 / total))
        torch.cuda.reset_peak_memory_stats()
    if impl in DPO_CONFIGS:
        return dpo_worker(spec, device)
    train, heldout = blocks(spec)
    common_args = _common_args(spec, device)
    if impl.startswith("ours"):
        from trainer.build import build_model, load_pretrained
        from trainer.config.args import TrainingArguments
        from trainer.loop.callbacks import TrainerCallback
        from trainer.loop.trainer import Trainer

        model = (
            load_pretrained(spec["model_dir"], dtype=torch.float32, device=device, use_kernels=True)
            if impl != "ours_tf"
            else build_model(spec["model_dir"], dtype=torch.float32, device=device, model_impl="transformers")[0]
        )
        lora = (
            dict(
                use_peft=True,
                lora_r=LORA["r"],
                lora_alpha=LORA["lora_alpha"],
                lora_dropout=LORA["lora_dropout"],
                lora_target_modules=LORA["target_modules"],
            )
            if impl in ("ours_lora", "ours_qlora")
            else {}
        )
        if impl == "ours_qlora":
            lora.update(QLORA)
        memory = {"ours_long": LONG_CONTEXT, "ours_ckpt": {**LONG_CONTEXT, "activation_offloading": False}}.get(
            impl, {}
        )
        args = TrainingArguments(**{**common_args, **memory}, optim=spec["our_optim"], use_kernels=True, **lora)
    else:
        import transformers
        from transformers import LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

        transformers.logging.set_verbosity_error()
        if impl == "hf_qlora":  # quantized as it loads, on the device (bitsandbytes' CUDA or CPU backend)
            quantized = transformers.BitsAndBytesConfig(**QLORA, bnb_4bit_compute_dtype=torch.float32)
            model = LlamaForCausalLM.from_pretrained(
                spec["model_dir"],
                dtype=torch.float32,
                attn_implementation="sdpa",
                quantization_config=quantized,
                device_map={"": device},
            )
        else:
            model = LlamaForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32, attn_implementation="sdpa")
            model.to(device)
        if impl in ("hf_lora", "hf_qlora"):
            import peft

            model = peft.get_peft_model(model, peft.LoraConfig(task_type="CAUSAL_LM", **LORA))
        checkpointing = (
            {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": False}}
            if impl == "hf_ckpt"
            else {}
        )
        args = TrainingArguments(
            **{**common_args, **checkpointing}, optim=spec["hf_optim"], use_liger_kernel=impl == "hf_liger"
        )
    clock = _timer(TrainerCallback)
    callbacks = [clock]
    if spec.get("profile"):  # the last step under torch.profiler (bench/step_profile.py)
        trace = Path(spec["profile"]) / f"profile_{impl}.json.gz"
        callbacks.append(step_profile.step_profiler(TrainerCallback, spec["steps"] - 1, trace))
    trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=collate, callbacks=callbacks)
    t = _train_and_time(spec, trainer, clock, device)
    if t["status"] != "ok":
        return t
    if spec.get("profile"):
        t["profile"] = callbacks[-1].summary
    step_tokens = spec["micro_batch"] * spec["grad_accum"] * spec["seq_len"]
    return {
        "status": "ok",
        "tokens_per_s": step_tokens / t["median_s"],
        "tokens_per_s_mean": step_tokens * t["timed_steps"] / t["sum_s"],
        **{k: v for k, v in t.items() if k not in ("median_s", "sum_s")},
        # The memory ladder's probes skip it: its (rows, T, vocab) fp32 logits at long T would be the peak.
        "final_loss": heldout_loss(trainer.model if impl.startswith("ours") else model, heldout, device)
        if spec.get("eval_loss", True)
        else None,
        "final_loss_kind": "heldout_cross_entropy",
    }


def dpo_worker(spec: dict, device: torch.device) -> dict:
    """One DPO configuration (ours_dpo, trl_dpo, trl_dpo_liger) on the preference pairs (module docstring)."""
    import numpy as np

    from trainer.data.preference_data import load_preference_dataset
    from trainer.data.tokenizer import Tokenizer

    impl = spec["impl"]
    train, held = preference_pairs(spec)
    out = Path(spec["output_dir"])
    out.mkdir(parents=True, exist_ok=True)
    for name, records in (("train", train), ("eval", held)):
        (out / f"{name}_pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    tokenizer = Tokenizer.from_pretrained(spec["model_dir"])

    def tokenized(name):
        return load_preference_dataset(
            [out / f"{name}_pairs.jsonl"], tokenizer, max_length=None, show_progress=False, write_cache=False
        )

    train_ds, eval_ds = tokenized("train"), tokenized("eval")
    common_args = _common_args(spec, device)
    if impl == "ours_dpo":
        from trainer.build import load_pretrained
        from trainer.config.args import TrainingArguments
        from trainer.loop.callbacks import TrainerCallback
        from trainer.methods.preference import PreferenceArguments, PreferenceTrainer

        model = load_pretrained(spec["model_dir"], dtype=torch.float32, device=device, use_kernels=True)
        args = TrainingArguments(**common_args, optim=spec["our_optim"], use_kernels=True, train_shuffle=False)
        clock = _timer(TrainerCallback)
        trainer = PreferenceTrainer(
            model=model,
            args=args,
            pref=PreferenceArguments(beta=DPO_BETA, loss_type="sigmoid"),
            train_dataset=train_ds,
            processing_class=tokenizer,
            callbacks=[clock],
        )
    else:
        import datasets
        import transformers
        import trl
        from transformers import AutoTokenizer, LlamaForCausalLM, TrainerCallback

        transformers.logging.set_verbosity_error()
        model = LlamaForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32, attn_implementation="sdpa")
        model.to(device)
        config = trl.DPOConfig(
            **common_args,
            optim=spec["hf_optim"],
            use_liger_kernel=impl == "trl_dpo_liger",
            use_cpu=device.type == "cpu",
            beta=DPO_BETA,
            loss_type=["sigmoid"],
            max_length=None,
            train_sampling_strategy="sequential",
        )
        clock = _timer(TrainerCallback)
        trainer = trl.DPOTrainer(
            model=model,
            args=config,
            train_dataset=datasets.Dataset.from_list(train),
            processing_class=AutoTokenizer.from_pretrained(spec["model_dir"]),
            callbacks=[clock],
        )
    t = _train_and_time(spec, trainer, clock, device)
    if t["status"] != "ok":
        return t
    pairs_per_step = spec["micro_batch"] * spec["grad_accum"]
    lengths = [
        2 * len(p["prompt_ids"]) + len(p["chosen_ids"]) + len(p["rejected_ids"])
        for p in (train_ds[i] for i in range(len(train_ds)))
    ]
    step_tokens = np.add.reduceat(lengths, np.arange(0, len(lengths), pairs_per_step))  # (steps,) sequential order
    timed_tokens = float(step_tokens[spec["warmup_steps"] :].sum())
    final_loss = None
    if spec.get("eval_loss", True):
        from trainer.build import load_pretrained

        reference = load_pretrained(spec["model_dir"], dtype=torch.float32, device=device, use_kernels=False).eval()
        policy = trainer.model if impl == "ours_dpo" else model
        final_loss = heldout_dpo_loss(policy, reference, eval_ds, device)
    return {
        "status": "ok",
        "tokens_per_s": timed_tokens / t["timed_steps"] / t["median_s"],
        "tokens_per_s_mean": timed_tokens / t["sum_s"],
        "pairs_per_s": pairs_per_step / t["median_s"],
        "tokens_per_step_mean": timed_tokens / t["timed_steps"],
        **{k: v for k, v in t.items() if k not in ("median_s", "sum_s")},
        "final_loss": final_loss,
        "final_loss_kind": "heldout_dpo_loss",
    }


def run_worker(spec: dict, timeout: float) -> dict:
    """Run one configuration in a fresh interpreter; its result comes back as JSON on the last stdout line."""
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env.pop("TRITON_INTERPRET", None)  # a CPU run takes the reference path, not the interpreter
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    try:
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": "error", "reason": f"timed out after {timeout:.0f} s"}
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        tail = (out.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        oom = "OutOfMemoryError" in out.stderr or "out of memory" in out.stderr
        return {"status": "oom" if oom else "error", "reason": tail[:300]}
    return json.loads(lines[-1][len("RESULT ") :])


# ---------------------------------------------------------------------------------------------------------
# Parent
# ---------------------------------------------------------------------------------------------------------


def skip_reason(impl: str) -> str | None:
    if impl in ("trl_dpo", "trl_dpo_liger"):
        import importlib.util

        if importlib.util.find_spec("trl") is None:
            return "trl is not installed (pip install trl)"
    if impl not in ("hf_liger", "trl_dpo_liger"):
        return None
    if not torch.cuda.is_available():
        return "liger-kernel's Triton kernels run on CUDA only (no CPU path); skipped on CPU"
    try:
        import liger_kernel  # noqa: F401
    except Exception:
        return "liger-kernel is not installed (pip install liger-kernel)"
    return None


def base_spec(args, model_dir: Path, out_dir: Path, config: dict) -> dict:
    return {
        "model_dir": str(model_dir),
        "output_dir": str(out_dir),
        "vocab_size": config["vocab_size"],
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "grad_accum": args.grad_accum,
        "steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "lr": args.lr,
        "seed": args.seed,
        "data": args.data,
        "our_optim": args.our_optim,
        "hf_optim": args.hf_optim,
        "threads": args.threads,
        "max_memory_gb": args.max_memory_gb,
        "profile": str(common.RESULTS) if args.profile else None,
        "eval_loss": not args.no_eval_loss,
    }


def compare(args, config: dict, model_dir: Path, tmp: Path) -> list[dict]:
    fpt = flops_per_token(config, args.seq_len)
    peak = None
    if torch.cuda.is_available():
        from trainer.loop.metrics import device_peak_flops

        peak = device_peak_flops(torch.device("cuda"))
    load_avg = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None  # how shared the machine was
    runs: dict[str, list[dict]] = {}
    results: dict[str, dict] = {}
    active = []
    for impl in args.configs:
        reason = skip_reason(impl)
        if reason:
            results[impl] = {"status": "skipped", "reason": reason}
            print(f"{impl:9s} skipped: {reason}", flush=True)
        else:
            active.append(impl)
    for rep in range(args.repeats):
        # Alternate the order between repeats so slow drifts of a shared machine fall on every configuration.
        for impl in active if rep % 2 == 0 else active[::-1]:
            spec = {**base_spec(args, model_dir, tmp / impl, config), "impl": impl}
            r = run_worker(spec, args.timeout)
            runs.setdefault(impl, []).append(r)
            if r["status"] == "ok":
                loss = "not computed" if r["final_loss"] is None else f"{r['final_loss']:.4f}"  # --no-eval-loss
                print(
                    f"{impl:9s} run {rep}: {r['tokens_per_s']:10.1f} tok/s  {r['step_ms']:8.1f} ms/step (median)  "
                    f"peak {r['peak_memory_gb']:.3f} GB ({r['peak_memory_kind']})  loss {loss}",
                    flush=True,
                )
            else:
                print(f"{impl:9s} run {rep}: {r['status']}: {r.get('reason')}", flush=True)
    for impl in active:
        ok = [r for r in runs[impl] if r["status"] == "ok"]
        if len(ok) < len(runs[impl]):
            results[impl] = next(r for r in runs[impl] if r["status"] != "ok")
            continue
        # The repeat with the median tokens/s stands for the configuration; all repeats' tokens/s are kept.
        ok.sort(key=lambda r: r["tokens_per_s"])
        results[impl] = {
            **ok[(len(ok) - 1) // 2],
            "repeats": len(ok),
            "tokens_per_s_all": [round(r["tokens_per_s"], 2) for r in ok],
        }
    env = common.env_info()
    rows = []
    for impl, r in results.items():
        row = {
            "bench": "train",
            "impl": impl,
            "model": args.model,
            "data": args.data,
            "n_params": config_params(config),
            "seq_len": args.seq_len,
            "micro_batch": args.micro_batch,
            "grad_accum": args.grad_accum,
            "global_batch_tokens": args.micro_batch * args.grad_accum * args.seq_len,
            "steps": args.steps,
            "precision": "bf16-autocast" if torch.cuda.is_available() else "fp32",
            "optim": args.our_optim if impl.startswith("ours") else args.hf_optim,
            "torch_threads": args.threads,
            "load_avg_1min_at_start": load_avg,
            **r,
        }
        if r["status"] == "ok":
            # DPO: the policy's forward + backward (6N) and the reference's forward (2N) per token
            row["mfu"] = fpt * (4 / 3 if impl in DPO_CONFIGS else 1) * r["tokens_per_s"] / peak if peak else None
            baseline = BASELINES.get(impl, "hf")
            row["baseline"] = baseline
            hf = results.get(baseline, {})
            if hf.get("status") == "ok" and impl != baseline:
                row["tokens_per_s_vs_hf"] = r["tokens_per_s"] / hf["tokens_per_s"]
                row["peak_memory_vs_hf"] = r["peak_memory_gb"] / hf["peak_memory_gb"]
                row["final_loss_minus_hf"] = r["final_loss"] - hf["final_loss"]
        rows.append({**row, **env})
    return rows


def config_params(config: dict) -> int:
    from trainer.model.causal_lm import CausalLM, ModelConfig

    with torch.device("meta"):
        return CausalLM(ModelConfig.from_hf(config)).num_parameters()


LADDERS = ("micro_batch", "seq_len")


def memory_ladder(
    args, config: dict, model_dir: Path, tmp: Path, ladder: str, deadline: float | None = None
) -> list[dict]:
    """Per configuration, the largest `ladder` value (micro batch at --seq-len, or sequence length at micro batch 1)
    that trains 2 optimizer steps without running out of memory.

    Each rung is a fresh subprocess (run_worker), so an out-of-memory there ends that process, not the ladder:
    its status is recorded and the ladder goes on by doubling from the first rung until the first OOM (or
    --ladder-max-*), then bisects between the last fit and the first OOM for at most --ladder-bisect probes. A
    rung that fails otherwise (an error, a timeout) ends that configuration's ladder with its reason and the next
    configuration starts. `deadline` (time.monotonic()) stops the ladders cleanly, before a probe that might not
    finish by it, leaving the bracket found so far. Rows: one "train_memory_rung" per probe (status, peak memory)
    and one "train_memory" per configuration (max_fit, first_oom)."""
    env = common.env_info()
    first, top = (
        (args.micro_batch, args.ladder_max_micro_batch)
        if ladder == "micro_batch"
        else (args.seq_len, args.ladder_max_seq_len)
    )
    fixed = {"seq_len": args.seq_len} if ladder == "micro_batch" else {"micro_batch": 1}
    rows: list[dict] = []
    longest_probe = 0.0
    for impl in args.configs:
        reason = skip_reason(impl)
        if reason:
            rows.append(
                {"bench": "train_memory", "impl": impl, "ladder": ladder, "status": "skipped", "reason": reason, **env}
            )
            continue
        stopped: str | None = None

        def probe(value: int, impl: str = impl) -> bool | None:
            """True: fits; False: out of memory; None: stopped (error, timeout or the deadline)."""
            nonlocal stopped, longest_probe
            budget = args.timeout
            if deadline is not None:
                budget = min(budget, deadline - time.monotonic())
                if budget < 1.5 * longest_probe:
                    stopped = "time budget spent"
                    return None
            shape = {**fixed, ladder: value}
            spec = {
                **base_spec(args, model_dir, tmp / f"{impl}_{ladder}_{value}", config),
                "impl": impl,
                **shape,
                "grad_accum": 1,
                "steps": 2,
                "warmup_steps": 1,
                "data": "synthetic",
                "eval_loss": False,
            }
            t0 = time.monotonic()
            r = run_worker(spec, budget)
            longest_probe = max(longest_probe, time.monotonic() - t0)
            rows.append(
                {
                    "bench": "train_memory_rung",
                    "impl": impl,
                    "model": args.model,
                    "ladder": ladder,
                    **shape,
                    "status": r["status"],
                    "peak_memory_gb": r.get("peak_memory_gb"),
                    "peak_memory_kind": r.get("peak_memory_kind"),
                    "reason": r.get("reason"),
                    "probe_s": round(time.monotonic() - t0, 1),
                    **env,
                }
            )
            print(
                f"{impl:9s} {ladder}={value:6d} ({', '.join(f'{k}={v}' for k, v in fixed.items())}): {r['status']}"
                + (f" peak {r['peak_memory_gb']:.2f} GB" if r.get("peak_memory_gb") is not None else "")
                + (f" ({r['reason']})" if r["status"] not in ("ok", "oom") else ""),
                flush=True,
            )
            if r["status"] in ("ok", "oom"):
                return r["status"] == "ok"
            stopped = f"{r['status']} at {ladder}={value}: {r.get('reason')}"
            return None

        good, bad, n_probes = 0, None, 0
        value = first
        while value <= top and stopped is None:  # doubling
            fit = probe(value)
            n_probes += fit is not None
            if fit is None:
                break
            if not fit:
                bad = value
                break
            good, value = value, value * 2
        bisections = 0
        while bad is not None and good and bad - good > 1 and bisections < args.ladder_bisect and stopped is None:
            mid = (good + bad) // 2
            fit = probe(mid)
            if fit is None:
                break
            n_probes += 1
            bisections += 1
            good, bad = (mid, bad) if fit else (good, mid)
        rows.append(
            {
                "bench": "train_memory",
                "impl": impl,
                "model": args.model,
                "ladder": ladder,
                **fixed,
                "max_fit": good or None,
                "first_oom": bad,
                "capped_at": top if bad is None and stopped is None else None,
                "probes": n_probes,
                "stopped": stopped,
                "status": "ok" if stopped is None else "incomplete",
                "precision": "bf16-autocast" if torch.cuda.is_available() else "fp32",
                **env,
            }
        )
    summaries = {r["impl"]: r for r in rows if r["bench"] == "train_memory" and r.get("max_fit")}
    hf = summaries.get("hf")
    for impl, r in summaries.items():
        if hf and impl != "hf":
            r["max_fit_vs_hf"] = r["max_fit"] / hf["max_fit"]
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--quick", action="store_true", help="tiny model, short run (the CPU comparison, a couple of minutes)"
    )
    p.add_argument("--model", choices=sorted(MODELS), default=None, help="default: llama-3.2-1b on GPU, tiny on CPU")
    p.add_argument("--data", choices=("tasks", "synthetic"), default="tasks")
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--micro-batch", type=int, default=None)
    p.add_argument("--grad-accum", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup-steps", type=int, default=None, help="steps left out of tokens/s (compile, caches)")
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="runs per configuration, alternating order; the "
        "median run is reported (default 3 on a CPU, whose cores are shared; 1 on a GPU)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads per worker (default 1 on a "
        "CPU: on shared cores a 2-thread op waits for its slower thread; the torch default on a GPU)",
    )
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--configs", default=",".join(DEFAULT_CONFIGS), help=f"comma-separated subset of {', '.join(CONFIGS)}"
    )
    p.add_argument("--our-optim", default="adamw_fused", help="our Trainer's optim (default: its default)")
    p.add_argument("--hf-optim", default="adamw_torch_fused", help="HF Trainer's optim (default: its default)")
    p.add_argument(
        "--memory-ladder",
        default=None,
        help=f"comma-separated ladders of {', '.join(LADDERS)}: the "
        "largest micro batch (at --seq-len) / sequence length (at micro batch 1, from --seq-len) per "
        "configuration, instead of the comparison",
    )
    p.add_argument(
        "--ladder-max-micro-batch",
        type=int,
        default=None,
        help="highest micro batch rung (default 256 on a GPU, 2 x --micro-batch on a CPU)",
    )
    p.add_argument(
        "--ladder-max-seq-len",
        type=int,
        default=None,
        help="highest sequence length rung (default 131072 on a GPU, 2 x --seq-len on a CPU)",
    )
    p.add_argument(
        "--ladder-bisect",
        type=int,
        default=1 << 30,
        help="most bisection probes between the last fit and the first OOM (default: until they are adjacent)",
    )
    p.add_argument(
        "--max-memory-gb",
        type=float,
        default=None,
        help="cap each worker's CUDA memory "
        "(torch.cuda.set_per_process_memory_fraction) in GB of 1e9 bytes, e.g. 85 to ladder an H100 80GB "
        "(79.6 GiB = 85.5e9 bytes, less the CUDA context) on an H200",
    )
    p.add_argument("--timeout", type=float, default=1800, help="seconds per worker process")
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="memory ladder: start no probe that might not end "
        "within this many seconds of the start (the bracket found so far is reported)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="run each configuration's last step under torch.profiler (bench/step_profile.py): device time by "
        "category, busy and idle, in the rows and train_profile.md; a gzipped Chrome trace per configuration",
    )
    p.add_argument(
        "--no-eval-loss",
        action="store_true",
        help="skip the held-out loss (its fp32 forward materialises attention at long --seq-len: 256 GiB at 32768)",
    )
    p.add_argument("--out", default=None, help="results directory (default bench/results)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    gpu = torch.cuda.is_available()
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if not args.configs or set(args.configs) - set(CONFIGS):
        p.error(f"--configs: choose from {', '.join(CONFIGS)}")
    if args.model is None:
        args.model = "llama-3.2-1b" if gpu and not args.quick else "tiny"
    # (seq_len, micro_batch, grad_accum, steps, warmup): GPU 16K tokens per step; CPU ~1K.
    defaults = (1024, 4, 4, 30, 5) if gpu else ((128, 4, 1, 10, 2) if args.quick else (256, 4, 2, 30, 5))
    for name, value in zip(("seq_len", "micro_batch", "grad_accum", "steps", "warmup_steps"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.threads is None and not gpu:
        args.threads = 1
    if args.repeats is None:
        args.repeats = 1 if gpu else 3
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if not 1 <= args.warmup_steps < args.steps:
        p.error("--warmup-steps must be at least 1 and below --steps")
    if args.profile and (set(args.configs) & set(DPO_CONFIGS) or args.memory_ladder):
        p.error("--profile: SFT configurations only (not " + ", ".join(DPO_CONFIGS) + "), not with --memory-ladder")
    if args.profile and args.warmup_steps > args.steps - 2:
        p.error("--profile: --steps must leave one timed step after --warmup-steps besides the profiled last step")
    if args.memory_ladder is not None:
        args.memory_ladder = [x.strip() for x in args.memory_ladder.split(",") if x.strip()]
        if not args.memory_ladder or set(args.memory_ladder) - set(LADDERS):
            p.error(f"--memory-ladder: choose from {', '.join(LADDERS)}")
    if args.ladder_max_micro_batch is None:
        args.ladder_max_micro_batch = 256 if gpu else 2 * args.micro_batch
    if args.ladder_max_seq_len is None:
        args.ladder_max_seq_len = 131072 if gpu else 2 * args.seq_len
    if args.max_memory_gb is not None and not (gpu and args.max_memory_gb > 0):
        p.error("--max-memory-gb needs a CUDA device and a positive number of GB")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.worker is not None:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return []
    if args.out:
        common.RESULTS = Path(args.out)
    config = model_config(args.model)
    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        tmp = Path(tmp)
        write_model(config, args.seed, tmp / "model")
        if args.memory_ladder:
            deadline = None if args.budget_s is None else time.monotonic() + args.budget_s
            rows = [
                r
                for ladder in args.memory_ladder
                for r in memory_ladder(args, config, tmp / "model", tmp, ladder, deadline)
            ]
            path = common.write_rows("train_memory", rows)
        else:
            rows = compare(args, config, tmp / "model", tmp)
            path = common.write_rows("train", rows)
            if args.profile:  # the header: device, versions, git, date, command
                step_profile.write_markdown(
                    common.RESULTS / "train_profile.md", rows, common.env_header(common.env_info())
                )
    print(f"wrote {len(rows)} rows to {path}")
    return rows


if __name__ == "__main__":
    main()
