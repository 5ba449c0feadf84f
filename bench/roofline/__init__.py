"""A modelled roofline of one whole training step, for four stacks, at full model size, without a GPU.

    python -m bench.roofline --model llama-3.2-1b --seq_len 2048 --micro_batch 4 --ignored 0.5 [--device h100|h200]

One step = forward (under bf16 autocast over fp32 parameters, as bench/bench_train.py runs both trainers), backward,
gradient clipping (max_grad_norm 1.0: both trainers clip) and the optimizer step, for
    ours        trainer.model.causal_lm.CausalLM(use_kernels=True) + kernels.FusedAdamW (our Trainer's default optim)
    ours_liger  the same model after trainer.model.causal_lm.apply_liger_kernel (liger's RMSNorm, SwiGLU, fused
                linear CE)
    hf          transformers.LlamaForCausalLM (sdpa) + torch.optim.AdamW(fused=True) (transformers 5.23's default
                optim, `TrainingArguments().optim == "adamw_torch_fused"`), loss with num_items_in_batch as the HF
                Trainer passes it
    hf_liger    the same after liger_kernel's apply_liger_kernel_to_llama(model=...) (what use_liger_kernel=True
                calls: liger RoPE, RMSNorm, SwiGLU MLP, fused linear cross-entropy)
each at 0% and at --ignored (default 50%) of the targets ignored (-100 at seeded random positions; only our fused
loss skips those rows: it gets the labels on the host, as our collator builds them).

How it is modelled. The model is built on the meta device and run under bench.sm90's `fake_cuda()` (meta tensors
that say they are on cuda:0, so every dispatch takes its CUDA path). Every aten op is recorded by a
TorchDispatchMode: FLOPs by FlopCounterMode's own formulas (`torch.utils.flop_counter.flop_registry`), bytes = the
tensor inputs read + the outputs written (in-place and out= arguments count as written, not read; a view, an
allocation or a host-only op moves nothing; embedding, index_select, gather and nll_loss read only the rows they
index), one launch per op (torch's multi-tensor `_foreach_*`/`_fused_*` ops: one per 320 chunks of 65536 elements or
per its tensor-list limit). What cannot run on meta tensors enters by its cost model (op_models.MODELS), as one modelled
op whose forward and backward produce outputs and gradients of the right shapes and record their own bytes, FLOPs
and launches (the aten ops they run internally are not recorded: they are not what the GPU runs):
- our Triton ops and liger-kernel's, by the autograd Function class each calls (`RMSNormFunction`,
  `FusedAddRMSNormFunction`, `RoPEFunction`, `SwiGLUFunction`, `SwiGLULinearFunction` (its matmuls as
  matmuls), `FusedLinearCrossEntropyFunction`,
  `LigerRMSNormFunction`, `LigerSiLUMulFunction`, `LigerRopeFunction`, `LigerFusedLinearCrossEntropyFunction`; ours
  are picked up from any module of `kernels`) and our FusedAdamW's Triton launcher. Ours by the benches' exact byte
  models (`traffic_parts` of bench/bench_rms_norm.py (RMSNorm and the fused add + RMSNorm),
  bench_fused_linear_cross_entropy.py, bench_adamw.py; bench_rope.py's), one recorded op per launch they name,
  which tests/bench/test_byte_models.py checks against bench/traffic.py's meter; our fused loss's matmul FLOPs and
  launches from its own chunking (max(K / ceil(V / H), 2048) of the K kept rows, an fp32 grad_weight accumulated by
  the chunk matmuls). liger's by the models there, from its source: its cross-entropy and RoPE kernels checked
  against the meter by tests/bench/test_roofline.py, its RMSNorm and SwiGLU (libdevice: not meterable on a CPU)
  by ours' passes; its fused loss chunk by chunk (next_pow2(N / ceil(V / H)) rows over every row, an fp32
  grad_weight read and written by every chunk's addmm, and its backward's element_mul of both gradients by
  grad_output, which is not 1 after the callers' division by the token count). Any other Triton launch raises:
  a new kernel must bring its model.
- attention (SDPA in our model and in HF's) by flash-attention's formulas, the same for all four stacks: causal
  forward 4*B*H*T^2*D/2 FLOPs, backward 2.5x; forward reads q, k, v and writes o and the fp32 lse, backward reads
  q, k, v, o, do, lse and writes dq, dk, dv; 1 launch forward, 2 backward (preprocess + main). A sliding layer (the
  attention module running names a `sliding_window` W < T, as transformers' Gemma 3 does) as flash attention's local
  window: W^2/2 + (T - W) W query-key pairs in place of T^2/2.
Autocast: torch.autocast does not act on meta tensors (its CUDA dispatch key is not theirs), so it is emulated:
autocast("cuda") is switched on as a flag (our and liger's code read it, and our fused loss casts for itself), and a
TorchFunctionMode casts fp32 operands of linear/matmul/mm/addmm/bmm/SDPA to bf16 with `.to()` where the flag is on,
as autocast's lower-precision list does (the casts are recorded aten `_to_copy` ops, their backward the
gradients' casts back). The ops autocast runs in fp32 are already fp32 in both models (HF and we upcast explicitly).

Time per op = max(bytes / bandwidth, FLOPs / peak) + launches * launch overhead; the step is the sum (no overlap).
Constants (DEVICES): H100 SXM ~3.0 TB/s (a measured device-to-device copy), ~790 TFLOP/s (a measured bf16 dense
matmul; every recorded FLOP is costed at it: the step's fp32 FLOPs are elementwise and count 0 in FlopCounterMode);
H200: ~4.3 TB/s, the same compute. Launch overhead: 4 us per launch on both (an eager PyTorch launch without CUDA
graphs costs a few microseconds of CPU time; when the GPU work is shorter the CPU is the bottleneck), the
per-launch cost that the launch count multiplies.
Peak memory: the largest sum of live tensor bytes through the step: parameters, optimizer state (created by one
unrecorded step before), then every storage allocated in forward, backward, clipping and the step (each freed when
its storage dies; modelled ops allocate their outputs, what they save for backward and their main workspaces).
Each storage is labelled with where it was allocated (`Trace.where`: the phase, then the modelled op, the module in
forward or the autograd node in backward); the labels' live bytes at the peak, and the peak of each phase, are in
the rows (peak_breakdown_gb, peak_by_phase_gb) and in the md's "Where the peak memory is".

Categories: matmuls (every mm/addmm/bmm, the LM head's included), attention (the flash model), norms, rope, MLP
activation, residual adds, loss, optimizer (clipping + step), other elementwise (embedding, autocast's weight casts,
layout copies). Forward aten ops are categorised by the innermost module running them (and matmul ops as matmuls),
backward ops by the autograd node they run for (tagged, when the forward call made it, with that call's category);
the gradient sums autograd makes where a tensor feeds several ops count with the node whose gradient is added.

Limits: a model, not a measurement: no overlap of launches, no cache effects, no kernel inefficiency (every op runs
at the roofline), cuBLAS/flash at their peak whatever the shape; CPU-side costs other than launches (host syncs such
as liger's `.item()`, Python overhead) are not modelled. Every figure printed or written here is labelled modelled;
where the results directory's train.jsonl holds GPU rows of the same model, sequence length and micro batch, the
measured step times and ratios stand beside the modelled ones (k accumulated micro batches: k modelled forward and
backward passes, one optimizer step). The H200 run of 2026-11-26 (bench/results/h200/):
    python -m bench.roofline --device h200 --out bench/results/h200

Results: bench/results/roofline.md (+ .jsonl, + roofline.png). Test: python -m pytest tests/bench/test_roofline.py -q

A model of the transformers path (`--model gemma-3-4b`, issue 44): Gemma-3-4B's text model, which our own model does
not cover, as three stacks (transformers_stacks.py): ours = trainer.model.transformers_model.TransformersModel over
transformers' Gemma3ForCausalLM with our kernels where its probes prove them (probed on a small CPU twin of the same
architecture, `TransformersModel(hf, twin=...)`, since the probes cannot run on the meta device) + FusedAdamW; hf;
hf_liger (apply_liger_kernel_to_gemma3_text); no ours_liger (the transformers path refuses liger-kernel). Results:
bench/results/roofline_gemma-3-4b.md (+ .jsonl, + .png), beside the Llama runs' files.

The memory ladder (`python -m bench.roofline --ladder`): the largest context (micro batch 1, one sequence of T tokens)
whose modelled peak fits each GPU, per setting x GPU x stack. Results: bench/results/ladder.md (+ .jsonl, + .png;
`--ladder --render_only` writes the md and chart again from the jsonl); tests: tests/bench/test_ladder.py.
- Settings (SETTINGS): Llama-3.2-1B full fine-tune (fp32 master weights, AdamW state, bf16 autocast); Llama-3.1-8B
  LoRA r=16 (alpha 32, no dropout) on every linear layer of the blocks through peft's inject_adapter_in_model (bf16
  frozen base, bf16 adapters as it leaves them, AdamW on the adapters); QLoRA: the same with each base linear weight
  stored as NF4Linear, 0.516 bytes a parameter (`nf4_bytes`: bitsandbytes' 4-bit codes + double-quantised scales, the
  bytes of a real quantized layer), dequantised to a transient bf16 weight for the matmul in forward and again in
  backward (one layer at a time, as bitsandbytes' MatMul4Bit);
  embeddings, norms and the LM head stay bf16. 8B full fine-tune with FSDP2's CPU offload on one process
  (HostParameters): parameters, gradients and AdamW state live on the host (16 bytes a parameter, fp32); the device
  holds one block's bf16 weights while it runs (again from its recompute in backward until its last gradient is
  made), that block's bf16 gradients until they are all made, and the root's weights (embeddings, final norm, LM head)
  through the step; the optimizer steps on the host (no device optimizer phase; its CPU time is not modelled).
- Stacks (LADDER_STACKS): hf = transformers (attention modelled as flash, as SDPA/FA2 run it) with gradient
  checkpointing; hf_liger = the same after liger's patches; ours = our kernels + gradient checkpointing + activation
  offloading + tiled MLP. Checkpointing runs torch.utils.checkpoint (non-reentrant) on the meta tensors
  (`checkpoint_on_meta`: its recompute sees the emulated autocast; its saved-versus-recomputed check compares element
  counts and dtypes); backward is run by the engine directly so that the recompute sees every mode of the recording.
- Offloading (MeteredOffloader): trainer/model/offload.py's ActivationOffloader itself (what it keeps: < 1 MiB,
  parameters and parameter-shaped tensors, the last group; its groups from CausalLM.block_hooks, its deduplication
  and its prefetch one block ahead), with its copies replaced by accounting: a group sent to the host drops its
  device reference (the storage dies there unless something else holds it) and adds its bytes to the host count; a
  tensor brought back is a new device allocation of the same layout. Host memory per rung = the offloaded bytes' peak
  (+ the 16 B/param of the CPU-offload setting). PCIe (`pcie_ms`): PCIE_BYTES_S = 50 GB/s per direction (Gen5 x16's
  64 GB/s derated); forward's copies (activations out; for CPU offload, weights in) against forward's modelled
  compute, backward's (activations back, weights again, gradients out) against backward's; what a direction's copies
  outlast their phase's compute by is added to the step. Offloading's cost = that addition with the activations'
  bytes less the same without them.
- The search: the peak grows linearly with T for every stack here (flash attention: nothing is T^2 in memory), so
  peak(T) = a + b*T is fitted through traces at 32,768 and 65,536 tokens and checked by a third at 131,072 (its
  deviation from the line is in the md); the answer is the bisection (`largest_fitting`, rungs of 256 tokens) on the
  line for each GPU's budget = its memory (GPUS, GiB) less RESERVE_BYTES (1.5 GiB: CUDA context + allocator
  fragmentation), then confirmed by traces at the answer and at the next rung; where they disagree the bracket is
  widened from the answer and bisected on traces (`context_for_budget`). One exception, said in each row: ours' tiled
  MLP records every tile of every block three times, so a trace grows with T (minutes past ~131k tokens on a CPU);
  past LADDER_TRACE_MAX_TILED its answer is the fit's alone, and its host bytes and step time are extrapolated
  from the traces (bytes on the line through the two longest, ms on the parabola through the three,
  `extrapolated_step`).
- Optimizer state (the md's table, not a rung): AdamW's bytes per parameter by --optim, measured
  (ADAMW_STATE_BYTES_PER_PARAM: fp32 moments 8, bf16 moments 4, bitsandbytes' 8-bit blockwise 2.03125), and what each
  holds for a full fine-tune of the 1B and 8B models (`adamw_state_bytes`).
- Calibration: the 1B full fine-tune without checkpointing, stacks ours / hf / hf_liger, at every rung measured on
  an H200 (bench/results/h200/train_memory_seq_len.jsonl, torch.cuda.max_memory_allocated), modelled/measured per
  rung; Unsloth's published QLoRA contexts and Snowflake ALST's full fine-tune baselines stand beside the modelled
  ones.

The LoRA stacks (`python -m bench.roofline --lora_stacks`, issue 34): one step of Llama-3.1-8B at micro batch 1 and
--seq_len tokens (2048) with LoRA r=16 on every linear layer of the blocks, bf16 base, bf16 or fp32 adapters, dropout 0
or 0.05, no checkpointing (what a step keeps is all in its peak), for ours with the fused LoRA path (kernels.lora),
ours with peft's layers, transformers + peft, and transformers + peft + liger (`lora_stack_rows`: ladder_step with
LORA_SETTINGS x LORA_STACKS). Dropout is modelled as it runs on CUDA (`cuda_dropout_on_meta`: a bool mask kept).
Results: bench/results/lora_stacks.md (+ .jsonl); test: tests/bench/test_ladder.py. With `--model qwen3-30b-a3b`
(issue 46): Qwen3-30B-A3B with r 16 on q/k/v/o and on both expert tensors (peft's target_parameters), bf16 adapters,
dropout 0: ours with the adapter as rank GEMMs inside the grouped GEMMs (MoEExpertsLoRAFunction's model), ours with
peft's layers (each expert tensor's whole delta formed and kept), transformers' grouped_mm experts + peft
(MOE_LORA_SETTINGS x MOE_LORA_STACKS); results bench/results/lora_stacks_qwen3-30b-a3b.md (+ .jsonl).

The package, in the order its parts build on each other: tracing.py (the trace, the aten recorder, ModelledOp),
op_models.py (the cost models, MODELS), recording.py (`recording`: fake CUDA, the modelled ops, emulated autocast),
stacks.py (the four stacks, `model_step`), transformers_stacks.py (a transformers-path model's three), report.py
(the step roofline's tables and chart), ladder_parts.py (what a ladder step adds on meta tensors: offloading metered,
NF4, LoRA, CPU offload, checkpointing and dropout),
ladder.py (`ladder_step`, the fit, the search, the calibration), ladder_report.py (the ladder's md and chart),
lora_stacks.py, cli.py (the command; __main__.py runs it). The names below are the ones the tests and other code
take from `bench.roofline`.
"""

from __future__ import annotations

from bench.roofline.cli import main, parse_args
from bench.roofline.ladder import (
    ADAMW_STATE_BYTES_PER_PARAM,
    LADDER_RUNG,
    MODEL_LADDER_STACKS,
    MODEL_LADDERS,
    SETTINGS,
    LadderStack,
    Setting,
    adamw_state_bytes,
    context_for_budget,
    ladder_config,
    ladder_step,
    largest_fitting,
    linear_fit,
    measured_calibration,
    model_ladder_settings,
    model_ladder_stacks,
)
from bench.roofline.ladder_parts import MeteredOffloader, NF4Linear, cuda_dropout_on_meta, nf4_bytes
from bench.roofline.lora_stacks import LORA_SETTINGS, LORA_STACKS, MOE_LORA_SETTINGS, MOE_LORA_STACKS, lora_stack_rows
from bench.roofline.op_models import (
    _FLCE_HOST,
    MODELS,
    _modelled_apply,
    liger_cross_entropy_bytes,
    liger_rope_bytes,
)
from bench.roofline.recording import modelled_ops, recording
from bench.roofline.report import _measured, modelled_step_ms, render, summarise
from bench.roofline.stacks import STACKS, model_step
from bench.roofline.tracing import CATEGORIES, DEVICES, Trace, _Recorder
from bench.sm90 import H100_SMS

__all__ = [
    "ADAMW_STATE_BYTES_PER_PARAM",
    "CATEGORIES",
    "DEVICES",
    "H100_SMS",
    "LADDER_RUNG",
    "LORA_SETTINGS",
    "LORA_STACKS",
    "MODELS",
    "MODEL_LADDERS",
    "MODEL_LADDER_STACKS",
    "SETTINGS",
    "STACKS",
    "Setting",
    "LadderStack",
    "MeteredOffloader",
    "NF4Linear",
    "Trace",
    "_FLCE_HOST",
    "_Recorder",
    "_measured",
    "_modelled_apply",
    "adamw_state_bytes",
    "context_for_budget",
    "cuda_dropout_on_meta",
    "ladder_config",
    "ladder_step",
    "largest_fitting",
    "liger_cross_entropy_bytes",
    "liger_rope_bytes",
    "linear_fit",
    "lora_stack_rows",
    "MOE_LORA_SETTINGS",
    "MOE_LORA_STACKS",
    "main",
    "measured_calibration",
    "model_ladder_settings",
    "model_ladder_stacks",
    "model_step",
    "modelled_ops",
    "modelled_step_ms",
    "nf4_bytes",
    "parse_args",
    "recording",
    "render",
    "summarise",
]
