"""Tokenizer: a `tokenizers.Tokenizer` plus the Hugging Face tokenizer config (special tokens, chat template).

Reads and writes the Hugging Face layout so that a model directory works both here and in `transformers`:
- `tokenizer.json`: the fast tokenizer (loaded with the `tokenizers` library, no `transformers` at run time);
- `tokenizer_config.json`: bos/eos/pad/unk tokens, `chat_template` (a string, or a list of named templates
  of which "default" is used), `model_max_length`, `add_bos_token`/`add_eos_token`;
- `chat_template.jinja` (transformers 5 writes the template there, and reads it before the config's): read when
  present, wins over the config; written beside the config's copy (older transformers read only that);
- `special_tokens_map.json`: read for special tokens the config does not name.

Chat templates render in a sandboxed jinja2 environment (`ImmutableSandboxedEnvironment`, `trim_blocks`,
`lstrip_blocks`, a `raise_exception` global, a `tojson` filter and `strftime_now`), as Hugging Face does,
so a model's own template renders the same text here and there. Templates that mark the assistant's text with
`{% generation %}...{% endgeneration %}` (transformers' `AssistantTracker` tag, which TRL's `assistant_only_loss`
relies on) render their blocks unchanged; `render_with_generation_spans` also returns where each block's text
lies in the rendering, which `trainer.data.sft_data` supervises instead of locating turns by prefix renders.

`byte_level_tokenizer()` builds the embedded default: 256 byte tokens (id == byte value) and ChatML special
tokens, with a ChatML chat template. It needs no download and round-trips any UTF-8 text exactly.
"""

from __future__ import annotations

import json
import re
import tempfile
from datetime import datetime
from pathlib import Path

from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from trainer.checkpoint_hf import CheckpointError, read_json

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML, used for models whose tokenizer has no chat template (and by the `tiny` preset)."""

CHATML_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


class TokenizerError(ValueError):
    """A tokenizer directory that cannot be used, with the file and the reason in one line."""


def _bytes_to_unicode() -> dict[int, str]:
    # The byte-level alphabet GPT-2 introduced: printable bytes map to themselves, the rest to code points
    # from 256 up, so every byte is one visible character the BPE model can hold in its vocabulary.
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class _GenerationBlocks(Extension):
    """`{% generation %}body{% endgeneration %}` renders `body` unchanged and, while `spans` is a list (set by
    `Tokenizer.render_with_generation_spans`), records the (start, end) characters of `body` in the output.

    The start is the length of everything rendered before it: `Template.generate` yields the output in order and
    the renderer appends each piece to `rendered` before the next is computed. As in transformers, a block inside
    a macro or a `{% set %}` capture is buffered elsewhere, so its recorded place would be wrong."""

    tags = {"generation"}

    def __init__(self, environment):
        super().__init__(environment)
        self.rendered: list[str] | None = None
        self.spans: list[tuple[int, int]] | None = None

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_record"), [], [], body).set_lineno(lineno)

    def _record(self, caller) -> str:
        text = caller()
        if self.spans is not None:
            start = sum(map(len, self.rendered))
            self.spans.append((start, start + len(text)))
        return text


def _compile_template(source: str):
    def raise_exception(message):
        raise TokenizerError(f"chat template: {message}")

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _GenerationBlocks]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def _token_content(value) -> str | None:
    # tokenizer_config.json stores special tokens either as strings or as AddedToken dicts.
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and "content" in value:
        return value["content"]
    return None


class Tokenizer:
    """Encode, decode and render chat templates; the special-token ids the data pipeline needs."""

    def __init__(
        self,
        backend,
        *,
        bos_token=None,
        eos_token=None,
        pad_token=None,
        unk_token=None,
        chat_template: str | None = None,
        model_max_length: int | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        extra_config: dict | None = None,
        name_or_path: str = "",
    ):
        self.backend = backend  # tokenizers.Tokenizer
        self.name_or_path = name_or_path  # the directory it was read from ("" when built here)
        self.bos_token, self.eos_token, self.pad_token, self.unk_token = bos_token, eos_token, pad_token, unk_token
        self.chat_template = chat_template
        self.model_max_length = model_max_length
        self.add_bos_token, self.add_eos_token = add_bos_token, add_eos_token
        self.extra_config = dict(extra_config or {})
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            token = getattr(self, name)
            if token is not None and backend.token_to_id(token) is None:
                raise TokenizerError(f"tokenizer: {name} {token!r} is not in the vocabulary")
        self._template = None

    def __getstate__(self) -> dict:
        """Everything but the compiled chat template (jinja's compiled filters do not pickle; it is compiled again
        on first use), so that a tokenizer reaches worker processes started by spawn or forkserver."""
        return {**self.__dict__, "_template": None}

    # ---- special tokens -------------------------------------------------------------------------------
    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_to_id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        """The pad id; the eos id when the tokenizer names no pad token (padding is never a target anyway)."""
        pad = self.token_to_id(self.pad_token)
        return pad if pad is not None else self.eos_token_id

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    # ---- encode / decode ------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            ids = self._add_specials(ids)
        return ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and, for each, the (start, end) character span of `text` it came from."""
        enc = self.backend.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets  # fresh lists from tokenizers (the offsets already tuples): no copies

    def _add_specials(self, ids: list[int]) -> list[int]:
        if self.add_bos_token and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        if self.add_eos_token and self.eos_token_id is not None:
            ids = ids + [self.eos_token_id]
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ---- chat template --------------------------------------------------------------------------------
    def _compiled(self, chat_template: str | None):
        if chat_template is not None:
            return _compile_template(chat_template)
        if self._template is None:
            self._template = _compile_template(self.chat_template or DEFAULT_CHAT_TEMPLATE)
        return self._template

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = False,
        tokenize: bool = False,
        chat_template: str | None = None,
        **kwargs,
    ):
        """Render `messages` with the model's chat template (or the default ChatML one) -> text or ids."""
        text = self._compiled(chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )
        return self.encode(text) if tokenize else text

    @property
    def has_generation_blocks(self) -> bool:
        """Whether the chat template marks the assistant's text with `{% generation %}` blocks."""
        return bool(_GENERATION_TAG.search(self.chat_template or DEFAULT_CHAT_TEMPLATE))

    def render_with_generation_spans(self, messages: list[dict], **kwargs) -> tuple[str, list[tuple[int, int]]]:
        """(text, [(start, end) of each `{% generation %}` block's text]) of the rendered conversation; what
        transformers' `return_assistant_tokens_mask` marks, as characters."""
        template = self._compiled(None)
        tracker = next(e for e in template.environment.extensions.values() if isinstance(e, _GenerationBlocks))
        tracker.rendered, tracker.spans = [], []
        try:
            for piece in template.generate(
                messages=messages, bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs
            ):
                tracker.rendered.append(piece)
            return "".join(tracker.rendered), tracker.spans
        finally:
            tracker.rendered = tracker.spans = None

    # ---- files ----------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerError(
                f"{tok_file}: not found (a fast tokenizer file is required; convert with transformers once)"
            )
        try:
            backend = Backend.from_file(str(tok_file))
        except Exception as exc:
            raise TokenizerError(f"{tok_file}: cannot be read by the tokenizers library: {exc}") from None
        config = _read_json(path / "tokenizer_config.json")
        specials = _read_json(path / "special_tokens_map.json")
        names = {}
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            names[name] = _token_content(config.get(name)) or _token_content(specials.get(name))
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            by_name = {t.get("name"): t.get("template") for t in template}
            template = by_name.get("default") or next(iter(by_name.values()), None)
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text()
        known = {
            "bos_token",
            "eos_token",
            "pad_token",
            "unk_token",
            "chat_template",
            "model_max_length",
            "add_bos_token",
            "add_eos_token",
        }
        max_len = config.get("model_max_length")
        return cls(
            backend,
            **names,
            chat_template=template,
            model_max_length=int(max_len) if isinstance(max_len, (int, float)) and max_len < 1e12 else None,
            add_bos_token=bool(config.get("add_bos_token", False)),
            add_eos_token=bool(config.get("add_eos_token", False)),
            extra_config={k: v for k, v in config.items() if k not in known and k != "added_tokens_decoder"},
            name_or_path=str(path),
        )

    @classmethod
    def from_transformers(cls, tokenizer) -> Tokenizer:
        """A transformers tokenizer (`AutoTokenizer.from_pretrained(...)`) as ours: the files its `save_pretrained`
        writes, read back by `from_pretrained`, so that its vocabulary, special tokens and chat template are the
        same. A slow tokenizer writes no tokenizer.json: a one-line TokenizerError."""
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer.save_pretrained(tmp)
            if not (Path(tmp) / "tokenizer.json").is_file():
                raise TokenizerError(
                    f"processing_class: a {type(tokenizer).__name__} saves no tokenizer.json (a slow tokenizer; "
                    "expected a fast one: AutoTokenizer.from_pretrained(..., use_fast=True))"
                )
            ours = cls.from_pretrained(tmp)
        ours.name_or_path = str(getattr(tokenizer, "name_or_path", "") or "")
        return ours

    def adopt_default_chat_template(self) -> bool:
        """Make ChatML (`DEFAULT_CHAT_TEMPLATE`, what rendering falls back to) this tokenizer's own template when it has
        none, so that it is saved with the model and generation renders as training did; True when it had none."""
        if self.chat_template is not None:
            return False
        self.chat_template = DEFAULT_CHAT_TEMPLATE
        return True

    def save_pretrained(self, path: str | Path) -> None:
        """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json and chat_template.jinja (loadable by
        AutoTokenizer)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(path / "tokenizer.json"))
        specials = {
            k: v
            for k, v in (
                ("bos_token", self.bos_token),
                ("eos_token", self.eos_token),
                ("pad_token", self.pad_token),
                ("unk_token", self.unk_token),
            )
            if v is not None
        }
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **self.extra_config,
            **specials,
            "add_bos_token": self.add_bos_token,
            "add_eos_token": self.add_eos_token,
            "clean_up_tokenization_spaces": False,
        }
        config["tokenizer_class"] = "PreTrainedTokenizerFast"  # we save the fast tokenizer only
        if self.model_max_length is not None:
            config["model_max_length"] = self.model_max_length
        jinja_file = path / "chat_template.jinja"
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
            jinja_file.write_text(self.chat_template)
        else:
            jinja_file.unlink(missing_ok=True)  # another tokenizer's, which would win over this config
        (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
        (path / "special_tokens_map.json").write_text(json.dumps(specials, indent=2, ensure_ascii=False) + "\n")


def _read_json(file: Path) -> dict:
    """An optional tokenizer file: {} when absent, a one-line TokenizerError when it is not a JSON object."""
    if not file.is_file():
        return {}
    try:
        return read_json(file)
    except CheckpointError as exc:
        raise TokenizerError(str(exc)) from None


def byte_level_tokenizer(model_max_length: int = 2048) -> Tokenizer:
    """The embedded tokenizer: ids 0-255 are bytes, then <|endoftext|>, <|im_start|>, <|im_end|> (259 ids)."""
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    backend = Backend(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHATML_SPECIALS])
    return Tokenizer(
        backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=DEFAULT_CHAT_TEMPLATE,
        model_max_length=model_max_length,
    )
