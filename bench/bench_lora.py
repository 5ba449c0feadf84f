"""Benchmark the fused LoRA path (kernels.lora_projections / lora_mlp) against peft's layers (their plain-autograd form,
`lora_projections_ref` / `lora_mlp_ref`, the same operations peft's Linear runs): time of forward + backward, the
bytes autograd keeps for backward (measured: the distinct storages its saved tensors hold, weights excluded), and that
the two agree bit for bit (`bit_exact`: outputs, input and adapter gradients).

Cases: one decoder layer's LoRA parts at Llama-3.1-8B's widths (hidden 4096, 8 query / 1 key-value head groups:
q 4096, k and v 1024, intermediate 14336), r = 16, alpha 32, every linear layer adapted (the ladder's 8B LoRA setting;
bf16 on a GPU, fp32 on a CPU, whose bf16 matmuls take seconds a call at these widths): "qkv" (q/k/v of the attention's
input), "o" (o_proj alone) and "mlp" (gate/up/down around SwiGLU; peft's row keeps the SwiGLU output for down_proj,
as peft over transformers' MLP does, where our unfused path recomputes it), with lora_dropout 0 and 0.1.
`kept_bytes_per_token` is the saved bytes over the tokens: exact for any token count (everything kept is per token),
so the CPU rows give the GPU's figure too (at the CPU's dtype), except that PyTorch's dropout keeps its mask as a bool
on CUDA and as a tensor of x's dtype on the CPU (peft's rows with dropout keep less on CUDA).

    python bench/bench_lora.py             # GPU: 8192 tokens, bf16, appends to bench/results/lora.jsonl
    python bench/bench_lora.py --quick     # CPU: 16 tokens, fp32 (rows say perf_figure=False: not performance)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make `bench` and `kernels` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common  # noqa: E402
from kernels.lora import LoRAProjection, lora_mlp, lora_mlp_ref, lora_projections, lora_projections_ref  # noqa: E402

HIDDEN, KV, INTERMEDIATE, RANK, ALPHA = 4096, 1024, 14336, 16, 32  # Llama-3.1-8B, LoRA r=16


def _projection(d_in: int, d_out: int, dtype, device, gen) -> LoRAProjection:
    weight = (torch.randn(d_out, d_in, generator=gen, device=device) / d_in**0.5).to(dtype)
    A = (torch.randn(RANK, d_in, generator=gen, device=device) / d_in**0.5).to(dtype).requires_grad_()
    B = (torch.randn(d_out, RANK, generator=gen, device=device) * 0.01).to(dtype).requires_grad_()
    return LoRAProjection(weight, A, B, scaling=ALPHA / RANK)


def cases(dtype, device):
    """{name: (fused fn, peft fn, projections, input width, output widths)}."""
    gen = torch.Generator(device=device).manual_seed(0)
    qkv = [_projection(HIDDEN, n, dtype, device, gen) for n in (HIDDEN, KV, KV)]
    o = [_projection(HIDDEN, HIDDEN, dtype, device, gen)]
    mlp = [_projection(*shape, dtype, device, gen) for shape in ((HIDDEN, INTERMEDIATE),) * 2]
    mlp.append(_projection(INTERMEDIATE, HIDDEN, dtype, device, gen))
    return {
        "qkv": (lora_projections, lora_projections_ref, qkv, (HIDDEN, KV, KV)),
        "o": (lora_projections, lora_projections_ref, o, (HIDDEN,)),
        "mlp": (lambda x, p, d: (lora_mlp(x, *p, d),), lambda x, p, d: (lora_mlp_ref(x, *p, d),), mlp, (HIDDEN,)),
    }


def kept_bytes(fn, x, projs, dropout) -> int:
    """Bytes of the distinct storages autograd keeps for backward after fn's forward, weights excluded."""
    weights = {t.untyped_storage().data_ptr() for p in projs for t in (p.weight, p.lora_A, p.lora_B)}
    storages = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weights:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x, projs, dropout)
    return sum(storages.values())


def fwd_bwd(fn, x, projs, dropout, douts, seed=0):
    torch.manual_seed(seed)
    outs = fn(x, projs, dropout)
    adapters = [t for p in projs for t in (p.lora_A, p.lora_B)]
    return [o.detach() for o in outs], torch.autograd.grad(outs, [x, *adapters], douts)


def run(tokens: int, dtype, dropouts, cpu_reps: int):
    device = common.device()
    env = common.env_info()
    rows = []
    for name, (fused, peft_like, projs, outs) in cases(dtype, device).items():
        width = projs[0].lora_A.shape[1]
        x = torch.randn(1, tokens, width, device=device).to(dtype).requires_grad_()
        douts = [torch.randn(1, tokens, n, device=device).to(dtype) for n in outs]
        for dropout in dropouts:
            results = {p: fwd_bwd(fn, x, projs, dropout, douts) for p, fn in (("ours", fused), ("peft", peft_like))}
            exact = all(
                torch.equal(a, b)
                for a, b in zip(
                    results["ours"][0] + list(results["ours"][1]), results["peft"][0] + list(results["peft"][1])
                )
            )
            timings, case_rows = {}, []
            for provider, fn in (("ours", fused), ("peft", peft_like)):
                t = common.measure(lambda: fwd_bwd(fn, x, projs, dropout, douts), cpu_reps=cpu_reps)
                kept = kept_bytes(fn, x, projs, dropout)
                case_rows.append(
                    {
                        "op": "lora",
                        "provider": provider,
                        "mode": f"{name} dropout {dropout}",
                        "model": "llama-3.1-8b r16",
                        "tokens": tokens,
                        "dtype": str(dtype).replace("torch.", ""),
                        "bit_exact": exact,
                        **t,
                        "kept_bytes": kept,
                        "kept_bytes_per_token": kept / tokens,
                        **env,
                    }
                )
                timings[provider] = t["ms"]
            ours, theirs = case_rows
            ours["kept_vs_peft"] = ours["kept_bytes"] / theirs["kept_bytes"]
            common.finish_case(case_rows, timings, f"{name} dropout {dropout}")
            print(
                f"    kept for backward: ours {ours['kept_bytes_per_token']:.0f} B/token, peft "
                f"{theirs['kept_bytes_per_token']:.0f} B/token ({ours['kept_vs_peft']:.2f}x); bit exact: {exact}"
            )
            rows += case_rows
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="16 tokens, one repetition (CPU smoke run)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per case (default 8192 on a GPU, 16 on a CPU)")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default bf16 on a GPU, fp32 on a CPU")
    args = ap.parse_args(argv)
    gpu = common.on_gpu() and not args.quick
    tokens = args.tokens or (8192 if gpu else 16)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if gpu else "fp32")]
    rows = run(tokens, dtype, (0.0, 0.1), cpu_reps=1 if args.quick else 3)
    path = common.write_rows("lora", rows)
    print(f"wrote {len(rows)} rows to {path}")
    return rows


if __name__ == "__main__":
    main()
