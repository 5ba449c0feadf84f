"""The transformers path: a causal LM of any type that `transformers.AutoModelForCausalLM` builds, trained by our
Trainer, with our kernels where they are shown, on the model itself, to compute what transformers' code computes.

Two paths, one trainer (`model_path`): a model type our own model covers (`trainer.model.causal_lm`, where the measured
speed comes from: `SUPPORTED_MODEL_TYPES`, the Llama family, Qwen3.5 and the MoE types) is built as ours; every other
type transformers knows as
a causal LM is built by transformers from its own modeling code and wrapped in `TransformersModel`, which the Trainer,
the checkpoints and the run summary treat as they treat ours. `model_impl` ("auto", "ours", "transformers") forces a
path where both apply, so that the two can be compared on one checkpoint.

What of ours runs inside (`TransformersModel.kernel_report()`, printed at the start of a run):
- the loss: our fused linear cross-entropy over the decoder's final hidden states and the LM head's weight, so the
  (tokens, vocabulary) logits never exist, when a probe shows the model's logits are `lm_head(hidden)` times a
  constant c, or softcapped: one forward of 8 random tokens, the model's own logits against the head applied to its
  decoder's output (bit for bit for c = 1; to fp32 rounding for Cohere's logit_scale and 1 / Granite's
  logits_scaling, where c is folded into the head's input, c h W^T, exact for a power of two; for the cap s its
  config names, Gemma 2's final_logit_softcapping, s tanh(lm_head(hidden) / s) with the head's output pushed to 3 s
  for the probe, so that tanh's curve shows: the cap then runs inside our kernels, `softcap`). A model that
  transforms its logits otherwise fails the probe and keeps transformers' logits, with our cross-entropy over them;
  a mixture-of-experts model asked for its router loss (`output_router_logits`) keeps its logits too, its auxiliary
  loss added as transformers adds it (`router_aux_loss_coef` times `aux_loss`, per micro batch);
- RMSNorm, SwiGLU and GeGLU, RoPE, the fused residual add + norm of pre-norm decoder layers: the swaps of
  trainer/model/kernel_swaps.py, each proven on the module itself (its math, not its name) before it is made; in
  bf16/fp16 ours rounds once where transformers rounds twice (at most about one unit in the last place apart), as in
  our own model. What fails a proof (a gated norm, a LayerNorm, an MLP of another activation, GLM-4's interleaved
  rotary, Gemma 2's sandwich norms) stays transformers' and is named;
- FusedAdamW (the optimizer, model-independent); NEFTune (`neftune_noise_alpha`) through a forward hook on the input
  embeddings, where Hugging Face's Trainer puts it, with our model's noise (`kernels.neftune_noise`: each sequence's own
  length from the batch's attention_mask and position_ids, no noise on padding);
- everything else stays transformers' (attention, mixtures of experts' expert layers), and is reported.
The step-0 loss with all of these inside equals an untouched transformers model's within 1e-5 in fp32 for the 20 types
of tests/trainer/model/tiny_hf.py (tests/trainer/model/test_transformers_path.py).

The transforms run as on our path (`trainer.parallel.transforms.apply_all`): 4-bit or 8-bit base weights
(`trainer.model.quant`: every nn.Linear but the head, after transformers has loaded the model in full precision, so the
load peaks at the full-precision model, where our path quantizes as it reads; a mixture of experts' fused expert
tensors are not nn.Linear and stay in full precision), LoRA through peft (`trainer.model.lora`: injected into the
transformers model, so the adapter files carry transformers' names and `peft.PeftModel.from_pretrained` over
`AutoModelForCausalLM` loads them), gradient checkpointing (transformers' own switch, `gradient_checkpointing_enable`),
per-block compile (each of transformers' decoder layers, `decoder_layers`, our swapped forwards inside), DDP, FSDP2
(each decoder layer one unit; every rank loads the whole model before it is sharded; saving gathers into
`empty_copy`) and DeepSpeed ZeRO-2/3 (ZeRO-3 fetches a partitioned parameter where our forwards read it, and, the
model's output being a dict whose tensors its hooks find, again for the backward), for every stage. `trainer.merge`
and `trainer.generate --adapter` take the same models.

Refused on this path, each in one line before anything is built (`check_transformers_path`): liger-kernel (its patches
are our model's) and activation offloading with per-block compile (the offloader's per-block calls are forward
pre-hooks on the decoder layers, inside what is compiled). Activation offloading (`block_hooks`) and the tiled MLP (our
swapped MLPs over token tiles, `tiled_mlp`) run here. SFT, DPO (under FSDP2 the reference is the policy's
`meta_copy`, sharded alike; under ZeRO-3 partitioned alike) and GRPO (its sampling inside the engine's whole
weights) train here; DPO and GRPO need a model whose logits are
`lm_head(hidden)` times a constant, or softcapped (their losses run from the hidden states and the head's weight:
`check_stage`, one line when the trainer gets the model). GRPO samples through our sampler (`decode_step` over
transformers' KV cache, `TransformersCache`), so its per-completion random stream is the one our model's runs draw.

transformers is imported only when this path is taken (it costs seconds).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from trainer.coerce import ConfigError
from trainer.model.causal_lm import (
    IGNORE_INDEX,
    SUPPORTED_MODEL_TYPES,
    TEXT_MODELS,
    CausalLMOutput,
    ModelError,
    head_forward,
)
from trainer.model.kernel_swaps import swap_kernels
from trainer.model.moe import no_router_message

MODEL_IMPLS = ("auto", "ours", "transformers")
# our attention backends (trainer/model/attention.py) -> transformers' attn_implementation; auto: transformers' choice
ATTN_FOR_TRANSFORMERS = {"auto": None, "sdpa": "sdpa", "flex": "flex_attention", "flash": "flash_attention_2"}
PROBE_TOKENS = 8
# transformers' layer_types whose FLOPs `flops_per_token` counts (softmax attention over a full or local window)
SOFTMAX_ATTENTION = {"full_attention", "sliding_attention", "chunked_attention"}


def causal_lm_types() -> dict[str, str]:
    """transformers' causal-LM model types and their classes (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def model_path(model_type: str | None, model_impl: str = "auto") -> str:
    """ "ours" or "transformers": which model a checkpoint of `model_type` is built as. A one-line ModelError when
    neither applies (ours forced on a type it does not cover; a type transformers has no causal LM for)."""
    if model_impl not in MODEL_IMPLS:
        raise ConfigError(f"model_impl: {model_impl!r} is not one of {', '.join(MODEL_IMPLS)}")
    if model_impl != "transformers" and (model_type in SUPPORTED_MODEL_TYPES or model_type in TEXT_MODELS):
        return "ours"
    if model_impl == "ours":
        raise ModelError(
            f"model_impl ours: model_type {model_type!r} is not one our model covers "
            f"({', '.join(SUPPORTED_MODEL_TYPES)}); --model_impl auto trains it through transformers"
        )
    import transformers

    if model_type not in causal_lm_types():
        raise ModelError(
            f"model_type {model_type!r} has no causal language model in transformers {transformers.__version__} "
            "(AutoModelForCausalLM does not build it): this trainer trains text generation models"
        )
    return "transformers"


def check_buildable(path: Path, model_type: str | None) -> None:
    """transformers can build the model at `path` here: its config read and the model constructed on the meta device
    (no memory, no weights read: a second or less), so that a missing package, a config its code refuses or a
    modeling bug stops the run in one line (ModelError) before anything is written."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # whatever transformers raises: one line naming the type and the reason
        reason = (str(exc).strip().splitlines() or [""])[0][:300]
        raise ModelError(
            f"{Path(path) / 'config.json'}: transformers cannot build this {model_type!r} model here "
            f"({type(exc).__name__}: {reason})"
        ) from None


def check_transformers_path(args) -> None:
    """The arguments the transformers path cannot honour yet, each a one-line ConfigError naming it (every stage
    trains here; a model whose head its losses cannot run is refused once built: `TransformersModel.check_stage`)."""
    unsupported = {"use_liger_kernel": "liger-kernel"}
    for name, what in unsupported.items():
        if getattr(args, name, None):
            raise ConfigError(
                f"{name}: {what} is not available on the transformers path yet (this model type is not one our model "
                f"covers: {', '.join(SUPPORTED_MODEL_TYPES)}); leave it unset"
            )
    if getattr(args, "activation_offloading", False) and getattr(args, "torch_compile", False):
        raise ConfigError(
            "activation_offloading with torch_compile: on the transformers path the offloader's per-block calls are "
            "forward pre-hooks of the decoder layers, inside what per-block compile compiles; use one of the two"
        )


class TransformersCache:
    """`trainer.model.attention.KVCache`'s interface for `TransformersModel.decode_step`: `length` (tokens fed so far),
    `pad` ((B,) leading padding per row, or None) and `repeat_rows(n)`, over transformers' own cache object."""

    def __init__(self):
        self.past = None  # transformers' cache (past_key_values), made by the model at the first step
        self.length = 0
        self.pad: torch.Tensor | None = None

    def repeat_rows(self, n: int) -> None:
        """Repeat every row n times in place (row r -> rows r n .. r n + n - 1), padding included: each layer of
        transformers' cache by its own `batch_repeat_interleave`, or, for a layer without one (transformers 5.24's
        linear-attention layers: Qwen3.5, Qwen3-Next, LFM2), its tensors (keys, values, conv and recurrent states)."""
        for layer in self.past.layers:
            own = getattr(layer, "batch_repeat_interleave", None)
            if own is not None:
                own(n)
                continue
            for name in ("keys", "values"):
                tensor = getattr(layer, name, None)
                if torch.is_tensor(tensor) and tensor.numel():
                    setattr(layer, name, tensor.repeat_interleave(n, dim=0))
            for name in ("conv_states", "recurrent_states"):
                states = getattr(layer, name, None) or {}
                for key, tensor in states.items():
                    if torch.is_tensor(tensor):
                        states[key] = tensor.repeat_interleave(n, dim=0)
        if self.pad is not None:
            self.pad = self.pad.repeat_interleave(n)


class TransformersModel(nn.Module):
    """A transformers causal LM (`self.hf`) with our Trainer's interface: `forward(input_ids, labels=...)` returns the
    loss as sum / num_items (our fused linear cross-entropy where the probe allows it), `flops_per_token`,
    `save_pretrained`, `kernel_report`. Parameter names are the transformers model's, under `hf.`."""

    takes_host_labels = False

    def __init__(
        self,
        hf: nn.Module,
        *,
        use_kernels: bool = True,
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        neftune_noise_alpha: float | None = None,
        tiled_mlp: bool = False,
        router_aux_loss_coef: float | None = None,
        twin: TransformersModel | None = None,
    ):
        """`twin`: a TransformersModel (use_kernels on) of the same architecture at sizes small enough to probe, whose
        probes decide for this model (one built on the meta device, where they cannot run: bench/roofline's
        full-size models): its head's logit scale and softcap, and the swaps proven on its modules
        (`kernel_swaps.swap_kernels`)."""
        super().__init__()
        self.hf = hf
        self.config = hf.config
        self.use_kernels = use_kernels
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.neftune_noise_alpha = neftune_noise_alpha
        self._layout = (None, None)  # the forward in progress's (attention_mask, position_ids), for `_neftune`
        hf.get_input_embeddings().register_forward_hook(self._neftune)
        self._router_loss_of_config = (
            bool(getattr(hf.config, "output_router_logits", False)),
            getattr(hf.config, "router_aux_loss_coef", None),
        )
        self._router_aux_loss_coef = None
        self.router_loss = self._router_loss_of_config[0]
        # logits = logit_scale * lm_head(hidden), softcapped when softcap is not None; None: something else
        if twin is not None and use_kernels and not twin.use_kernels:
            raise ValueError("TransformersModel: a twin must be built with use_kernels on (its probes ran)")
        probed = (twin.logit_scale, twin.softcap) if twin is not None else self._probe_head()
        self.logit_scale, self.softcap = probed or (None, None)
        self.router_aux_loss_coef = router_aux_loss_coef  # sets router_loss, plain_head and fused_head
        # what of ours runs inside ({"Kind: where": count}) and what was left (trainer/model/kernel_swaps.py)
        self.swapped, self.left = swap_kernels(hf, twin and twin.hf) if use_kernels else ({}, set())
        # activation offloading's per-block calls (`trainer.model.offload`; CausalLM.block_hooks): hook(i) before
        # transformers' decoder layer i runs (a forward pre-hook; backward's checkpoint recompute calls it too, when
        # the offloader is no longer active)
        self.block_hooks: list = []
        for index, layer in enumerate(self.decoder_layers or ()):
            layer.register_forward_pre_hook(functools.partial(self._on_block, index))
        self.tiled_mlp = tiled_mlp

    def _on_block(self, index: int, module, args) -> None:
        for hook in self.block_hooks:
            hook(index)

    @property
    def tiled_mlp(self) -> bool:
        """Whether our swapped MLPs run over the tokens in tiles (`--tiled_mlp`: Arctic's rule, tiles of hidden_size
        tokens; `causal_lm.over_token_tiles`). A model without an MLP of ours takes it as a one-line ConfigError."""
        return any(getattr(m, "tile_tokens", None) is not None for m in self._our_mlps())

    @tiled_mlp.setter
    def tiled_mlp(self, value: bool) -> None:
        mlps = self._our_mlps()
        if value and not mlps:
            raise ConfigError(
                f"tiled_mlp: {type(self.hf).__name__} has no MLP our kernels run (the tiled MLP tiles ours: "
                f"{', '.join(sorted(self.left)) or 'none swapped'}); leave it unset"
            )
        size = self.config.get_text_config().hidden_size
        for module in mlps:
            module.tile_tokens = size if value else None

    def _our_mlps(self) -> list[nn.Module]:
        return [m for m in self.hf.modules() if getattr(m, "kernel_act", None) is not None]

    @property
    def decoder_layers(self) -> nn.ModuleList | None:
        """The decoder's layers (`trainer.parallel.transforms.decoder_blocks`: FSDP2's units, per-block compile)."""
        layers = getattr(self.hf.get_decoder(), "layers", None)
        return layers if isinstance(layers, nn.ModuleList) else None

    def meta_copy(self) -> TransformersModel:
        """This model's architecture and settings on the meta device, its kernels and head as this model's probes
        proved them (`twin=self`): for a copy sharded before it is given storage (`trainer.build.frozen_copy`, a
        reference model under FSDP2). Its non-persistent buffers (rotary frequencies) are this model's to copy once it
        has storage."""
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(self.config, dtype=self.hf.dtype)
        return TransformersModel(
            hf, use_kernels=self.use_kernels, label_smoothing=self.label_smoothing, z_loss=self.z_loss, twin=self
        )

    def empty_copy(self) -> TransformersModel:
        """This model's architecture on the CPU, uninitialised and without kernels: a holder for full weights (saving a
        model sharded by FSDP2). Built on the meta device, so no probe runs, then given CPU storage."""
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(self.config, dtype=self.hf.dtype)
            copy = TransformersModel(hf, use_kernels=False)
        copy.to_empty(device="cpu")
        hf.tie_weights()  # to_empty gives each parameter its own storage: tied ones are tied again
        return copy

    @property
    def adapter_root(self) -> nn.Module:
        """Where a LoRA adapter goes (`trainer.model.lora.peft_root`): the transformers model, whose names peft's
        files carry."""
        return self.hf

    @property
    def name_or_path(self) -> str:
        return self.hf.name_or_path

    @name_or_path.setter
    def name_or_path(self, value: str) -> None:
        self.hf.name_or_path = value

    def _head(self) -> nn.Module | None:
        head = self.hf.get_output_embeddings()
        return head if isinstance(head, nn.Linear) and head.bias is None else None

    def _config_softcap(self) -> float | None:
        """The final logit softcapping the config names (Gemma 2's final_logit_softcapping), or None."""
        cap = getattr(self.config.get_text_config(), "final_logit_softcapping", None)
        return float(cap) if isinstance(cap, (int, float)) and not isinstance(cap, bool) and cap > 0 else None

    @torch.no_grad()
    def _probe_head(self) -> tuple[float, float | None] | None:
        """(c, softcap) where the model's logits are c times its LM head applied to its decoder's output (c = 1.0 for
        most; Cohere's logit_scale, 1 / Granite's logits_scaling), to fp32 rounding (rtol 1e-5; exactly for c = 1), or
        softcap tanh(that / softcap) for the cap its config names (Gemma 2's final_logit_softcapping; c = 1), proven on
        logits pushed into tanh's curved range: the head's output is multiplied by k during the probe (a forward hook)
        so that its largest entry is 3 softcap (a tiny random model's logits, far below the cap, would pass for
        uncapped ones). None when neither holds (module docstring). A model whose own forward fails on the probe's
        tokens is a one-line ModelError here, before any training."""
        device = self.hf.get_input_embeddings().weight.device
        if device.type == "meta":
            return None
        g = torch.Generator().manual_seed(0)
        vocab = self.hf.get_input_embeddings().weight.shape[0]  # config.vocab_size is a sub-config's in some models
        ids = torch.randint(0, vocab, (1, PROBE_TOKENS), generator=g).to(device)
        was_training = self.hf.training
        self.hf.eval()
        try:
            try:
                logits = self.hf(input_ids=ids, use_cache=False).logits
            except Exception as exc:  # transformers' own code fails on this model: one line, before training
                reason = (str(exc).strip().splitlines() or [""])[0][:200]
                raise ModelError(
                    f"{type(self.hf).__name__}: transformers' forward fails on {PROBE_TOKENS} tokens "
                    f"({type(exc).__name__}: {reason}); this model cannot train here"
                ) from None
            head = self._head()
            if head is None:
                return None
            try:
                hidden = self.hf.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
            except Exception:  # a decoder that cannot be called alone: the loss goes through the whole model
                return None
            plain = head(hidden)
            if logits.shape != (1, PROBE_TOKENS, head.out_features) or not torch.isfinite(plain).all():
                return None
            cap = self._config_softcap()
            if cap is not None:
                k = 3 * cap / float(plain.abs().max().clamp(min=1e-30))
                hook = head.register_forward_hook(lambda module, inputs, out: out * k)
                try:
                    pushed = self.hf(input_ids=ids, use_cache=False).logits
                finally:
                    hook.remove()
                if torch.allclose(pushed, kernels.softcapped(plain * k, cap), rtol=1e-5, atol=1e-6):
                    return 1.0, cap
            if torch.equal(logits, plain):  # (a cap the config names but the model does not apply: not taken)
                return 1.0, None
            scale = float((logits.double() * plain.double()).sum() / plain.double().square().sum().clamp(min=1e-30))
            same = scale != 0 and torch.allclose(logits, plain * scale, rtol=1e-5, atol=1e-6)
            return (scale, None) if same else None
        finally:
            self.hf.train(was_training)

    def _neftune(self, embedding, inputs, x):
        """NEFTune on the input embeddings' output while training (a forward hook, where Hugging Face's Trainer puts
        it): `kernels.neftune_noise` as our model adds it, L = each token's own sequence length from the batch's
        attention_mask and position_ids (trainer/model/causal_lm.py `_neftune`)."""
        if not (self.training and self.neftune_noise_alpha):
            return None
        fn = kernels.neftune_noise if self.use_kernels else kernels.neftune_noise_ref
        attention_mask, position_ids = self._layout
        return fn(x, self.neftune_noise_alpha, attention_mask=attention_mask, position_ids=position_ids, training=True)

    def _scaled(self, hidden: torch.Tensor) -> torch.Tensor:
        """The hidden states times the logit scale (c h W^T = c (h W^T): the scale folded into the head's input)."""
        return hidden if self.logit_scale == 1.0 else hidden * self.logit_scale

    @property
    def router_aux_loss_coef(self) -> float | None:
        """TRL's `router_aux_loss_coef` as given (CausalLM.router_aux_loss_coef's rule): set, it turns the model's
        router loss on (off at 0) with this weight in its config, as TRL sets them; None: the config decides."""
        return self._router_aux_loss_coef

    @router_aux_loss_coef.setter
    def router_aux_loss_coef(self, value: float | None) -> None:
        if value and not hasattr(self.config, "output_router_logits"):
            raise ModelError(no_router_message(value, self.config.model_type))
        self._router_aux_loss_coef = value
        enabled, coef = self._router_loss_of_config if value is None else (value != 0, value)
        if hasattr(self.config, "output_router_logits"):
            self.config.output_router_logits, self.config.router_aux_loss_coef = enabled, coef
        self.router_loss = enabled
        self.plain_head = self.logit_scale is not None and not self.router_loss
        self.fused_head = self.use_kernels and self.plain_head

    def not_plain_reason(self) -> str:
        """Why the loss runs over transformers' logits rather than from the hidden states and the head's weight."""
        if self.router_loss:
            return "its router loss (output_router_logits)"
        return "its logits are not lm_head(hidden) alone, scaled or softcapped"

    def check_stage(self, stage: str) -> None:
        """A one-line ConfigError when `stage`'s losses cannot run on this model: preference and GRPO losses are
        computed from the final hidden states and the LM head's weight (`head_forward`), which needs a plain head
        (scaled or softcapped)."""
        if stage != "sft" and not self.plain_head:
            raise ConfigError(
                f"stage {stage}: {type(self.hf).__name__} cannot train it on the transformers path yet: "
                f"{self.not_plain_reason()}, and its losses run from the hidden states and the head's weight"
            )

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        """transformers' per-layer activation checkpointing on the model inside (what
        `trainer.parallel.transforms.apply_activation_checkpointing` calls); one ConfigError line for a model class
        whose code has none."""
        if not self.hf.supports_gradient_checkpointing:
            raise ConfigError(f"gradient_checkpointing: {type(self.hf).__name__} does not support it in transformers")
        self.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gradient_checkpointing_kwargs)

    def kernel_report(self) -> str:
        """One line: the path, the class, what of ours runs inside and what stays transformers'."""
        ours = []
        for key, n in self.swapped.items():  # "SwiGLU: LlamaMLP" -> "SwiGLU x16 (LlamaMLP)"
            kind, where = key.split(": ", 1)
            ours.append(f"{kind} x{n} ({where})")
        if self.fused_head:
            scale = "" if self.logit_scale == 1.0 else f" (logit scale {self.logit_scale:g} folded in)"
            cap = "" if self.softcap is None else f" (final logit softcap {self.softcap:g} inside)"
            ours.append(f"fused linear cross-entropy{scale}{cap}")
        ours.append("FusedAdamW")
        why = ""
        if not self.fused_head:
            why = "kernels off (use_kernels false)" if self.plain_head else self.not_plain_reason()
            why = f"; the loss without our fused head: {why}"
        left = ["attention", *sorted(self.left)]
        return (
            f"transformers path: {type(self.hf).__name__}; our kernels: {', '.join(ours)}{why}; left as "
            f"transformers': {', '.join(left)}"
        )

    def forward(
        self,
        input_ids,
        labels=None,
        attention_mask=None,
        position_ids=None,
        num_items=None,
        sequence_logps: bool = False,
        preference_loss: dict | None = None,
        head=None,
    ):
        """`CausalLM.forward`'s outputs: without labels the logits; with labels (unshifted, -100 = no target) the loss
        sum / num_items (default: mean over the supervised tokens), the logits only when they were formed; with
        `sequence_logps`, `preference_loss` or `head` what `head_forward` computes (a plain head only:
        `check_stage`)."""
        self._layout = (attention_mask, position_ids)
        try:
            return self._forward(
                input_ids, labels, attention_mask, position_ids, num_items, sequence_logps, preference_loss, head
            )
        finally:
            self._layout = (None, None)

    def _forward(
        self, input_ids, labels, attention_mask, position_ids, num_items, sequence_logps, preference_loss, head
    ):
        # no KV cache while training (transformers would make one wherever config.use_cache is true)
        inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        if self.plain_head and (labels is not None or head is not None):
            return head_forward(  # the hidden states held there alone (freed early under autocast)
                self._head(),
                self._scaled(self.hf.get_decoder()(**inputs).last_hidden_state),  # (B, T, C)
                labels,
                impl="kernels" if self.use_kernels else "eager",
                label_smoothing=self.label_smoothing,
                z_loss=self.z_loss,
                num_items=num_items,
                sequence_logps=sequence_logps,
                preference_loss=preference_loss,
                head=head,
                softcap=self.softcap,
            )
        if sequence_logps or preference_loss is not None or head is not None:
            self.check_stage("dpo" if head is None else "grpo")
        if labels is None:
            return CausalLMOutput(None, self.hf(**inputs).logits)
        targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # (B, T): t predicts t+1
        if num_items is None:
            num_items = (targets != IGNORE_INDEX).sum().clamp(min=1)
        out = self.hf(**inputs)
        loss = kernels.cross_entropy(
            out.logits, targets, label_smoothing=self.label_smoothing, z_loss=self.z_loss, num_items=num_items
        )
        if self.router_loss and getattr(out, "aux_loss", None) is not None:
            loss = loss + self.config.router_aux_loss_coef * out.aux_loss.to(loss.device)
        return CausalLMOutput(loss, out.logits)

    def decode_cache(self, batch: int, length: int) -> TransformersCache:
        """An empty cache for `decode_step` (transformers' own, made at the first step; `length` is not needed)."""
        return TransformersCache()

    def decode_step(self, input_ids: torch.Tensor, cache: TransformersCache) -> torch.Tensor:
        """fp32 logits (B, V) of the last position after feeding `input_ids` (B, t) into `cache` (advanced by t), as
        `CausalLM.decode_step`: transformers' forward with its KV cache (`past_key_values`, whatever cache class the
        model makes: sliding windows, linear-attention states), so our decoding loops (`causal_lm.generate`, GRPO's
        sampler with its per-completion random stream) run over any model. Left padding (`cache.pad`) is an
        attention_mask with zeros there and positions counted from each row's first real token."""
        B, t = input_ids.shape
        total = cache.length + t
        device = input_ids.device
        positions = torch.arange(cache.length, total, device=device).expand(B, t)
        mask = None
        if cache.pad is not None:
            positions = (positions - cache.pad[:, None]).clamp(min=0)
            mask = (torch.arange(total, device=device)[None] >= cache.pad[:, None]).long()  # (B, total)
        out = self.hf(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache.past,
            use_cache=True,
            logits_to_keep=1,
        )
        cache.past, cache.length = out.past_key_values, total
        return out.logits[:, -1].float()

    def flops_per_token(self, seq_len: int) -> int | None:
        """6 N + 12 L H_q T as `CausalLM.flops_per_token` counts it (N: every parameter but the input embedding's, the
        head counted once when tied), for dense softmax-attention models; None for a mixture of experts (not every
        parameter runs for a token) and for models with linear-attention layers, so that no MFU is claimed."""
        c = self.config.get_text_config()  # a multimodal config keeps the decoder's sizes in its text config
        if any(getattr(c, k, None) for k in ("num_experts", "num_local_experts", "n_routed_experts")):
            return None
        layers, heads = getattr(c, "num_hidden_layers", None), getattr(c, "num_attention_heads", None)
        head_dim = getattr(c, "head_dim", None) or (getattr(c, "hidden_size", 0) // heads if heads else None)
        if not (layers and heads and head_dim):  # sizes under other names: not counted rather than guessed
            return None
        if set(getattr(c, "layer_types", None) or []) - SOFTMAX_ATTENTION:  # linear attention, convolutions, ...
            return None
        embed = self.hf.get_input_embeddings().weight
        n = sum(p.numel() for p in self.hf.parameters()) - embed.numel()
        head = self._head()
        if head is not None and head.weight is embed:
            n += embed.numel()
        return 6 * n + 12 * layers * heads * head_dim * seq_len

    def save_pretrained(self, directory: str | Path, tokenizer=None, max_shard_size: int | str = "5GB") -> None:
        """transformers' own layout (config.json, model.safetensors), which `from_pretrained` loads as it is."""
        self.hf.save_pretrained(directory, max_shard_size=max_shard_size)
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(directory)

    def load_weights(self, directory: str | Path) -> None:
        """The weights `save_pretrained` wrote, into this model (a resume)."""
        from transformers import AutoModelForCausalLM

        saved = AutoModelForCausalLM.from_pretrained(directory, dtype=self.hf.dtype)
        missing, unexpected = self.hf.load_state_dict(saved.state_dict(), strict=False)
        if missing or unexpected:
            raise ModelError(f"{directory}: the saved weights do not fit this model ({missing or unexpected})")


def build_transformers_model(path: Path, args, *, dtype, device, attn_backend: str = "auto") -> TransformersModel:
    """A TransformersModel of the checkpoint at `path` (config.json + safetensors, as transformers writes them) on
    `device`, in `dtype` (default: the checkpoint's, else fp32), with `args`' model settings."""
    from transformers import AutoModelForCausalLM

    if args is not None:
        check_transformers_path(args)
    attn = ATTN_FOR_TRANSFORMERS.get(attn_backend)
    hf = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, **({"attn_implementation": attn} if attn else {}), device_map={"": device}
    )
    hf.train()
    settings = {}
    if args is not None:
        settings = dict(
            use_kernels=args.use_kernels,
            label_smoothing=args.label_smoothing_factor,
            z_loss=args.z_loss,
            neftune_noise_alpha=args.neftune_noise_alpha,
            tiled_mlp=args.tiled_mlp,
            router_aux_loss_coef=args.router_aux_loss_coef,
        )
    return TransformersModel(hf, **settings)
