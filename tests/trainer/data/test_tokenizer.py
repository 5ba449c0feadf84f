"""The tokenizer: byte-level round trip, offsets, chat templates, and the Hugging Face file layout."""

import json

import pytest
from jinja2.exceptions import SecurityError

from trainer.data.tokenizer import DEFAULT_CHAT_TEMPLATE, Tokenizer, TokenizerError, byte_level_tokenizer

TEXTS = ["hello world", "héllo 🌍\n\tx", "12+34=46", ""]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_round_trip_and_ids_are_bytes(text):
    tok = byte_level_tokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_special_tokens_and_offsets():
    tok = byte_level_tokenizer()
    assert tok.vocab_size == 259
    assert (tok.pad_token_id, tok.eos_token_id) == (256, 258)
    text = "<|im_start|>user\nhé<|im_end|>"
    ids, offsets = tok.encode_with_offsets(text)
    assert ids[0] == 257 and ids[-1] == 258
    assert offsets[0] == (0, 12) and offsets[-1] == (len(text) - 10, len(text))
    # the two bytes of "é" both map to its one character
    assert offsets[-3] == offsets[-2] == (text.index("é"), text.index("é") + 1)
    assert tok.decode(ids) == "user\nhé"
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_chat_template_renders_chatml():
    tok = byte_level_tokenizer()
    msgs = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    assert tok.apply_chat_template(msgs) == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
    assert tok.apply_chat_template(msgs[:1], add_generation_prompt=True).endswith("<|im_start|>assistant\n")
    assert tok.apply_chat_template(msgs, tokenize=True) == tok.encode(tok.apply_chat_template(msgs))


def test_template_is_sandboxed_and_can_raise():
    tok = byte_level_tokenizer()
    with pytest.raises(TokenizerError, match="no system"):
        tok.apply_chat_template([], chat_template="{{ raise_exception('no system') }}")
    with pytest.raises(SecurityError):  # the sandbox refuses attribute access to internals
        tok.apply_chat_template([], chat_template="{{ messages.__class__.__mro__ }}")


def test_save_load_round_trip_and_transformers_reads_it(tmp_path):
    tok = byte_level_tokenizer()
    tok.save_pretrained(tmp_path)
    again = Tokenizer.from_pretrained(tmp_path)
    assert again.chat_template == DEFAULT_CHAT_TEMPLATE
    assert (again.eos_token, again.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert again.encode("héllo") == tok.encode("héllo")
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert hf.apply_chat_template(msgs, tokenize=False) == tok.apply_chat_template(msgs)
    assert hf.encode("héllo 🌍", add_special_tokens=False) == tok.encode("héllo 🌍")
    assert hf.eos_token_id == tok.eos_token_id


def test_chat_template_jinja_file_wins(tmp_path):
    byte_level_tokenizer().save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert Tokenizer.from_pretrained(tmp_path).apply_chat_template([{"role": "user", "content": "a"}]) == "[a]"


def test_bad_directories(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json: not found"):
        Tokenizer.from_pretrained(tmp_path)
    byte_level_tokenizer().save_pretrained(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>",\n "x": }')
    with pytest.raises(TokenizerError, match=r"tokenizer_config.json:2:\d+: invalid JSON"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
    with pytest.raises(TokenizerError, match="eos_token '<nope>' is not in the vocabulary"):
        Tokenizer.from_pretrained(tmp_path)
