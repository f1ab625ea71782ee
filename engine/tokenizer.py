"""Hugging Face ``tokenizer.json`` (``tokenizers`` package) + the jinja2 chat template of
``tokenizer_config.json``; EOS ids from generation_config / config / tokenizer_config; streaming
detokenization that never emits half a UTF-8 character.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import Template
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from engine.config import EngineConfig, read_json, special_token_ids
from engine.errors import CheckpointError, InvalidRequestError


def _token_text(value: Any) -> str | None:
    """tokenizer_config stores special tokens as a string or as an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """transformers' tojson: keys in their order and no HTML escaping (Jinja's sorts keys and escapes <, >, &
    and '), so tool definitions render as the model was trained on them."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationBlock(Extension):
    """transformers' ``{% generation %}...{% endgeneration %}``, which marks the assistant's text for training
    masks: rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise(message: str) -> None:
    """A template's ``raise_exception``: it refuses the messages it was given (roles out of turn, say)."""
    raise InvalidRequestError("messages", f"the chat template refuses these messages: {message}")


def compile_chat_template(source: str) -> Template:
    """A chat template's Jinja source, compiled as transformers renders chat templates (its tojson, its
    ``{% generation %}`` block, ``raise_exception`` and ``strftime_now``); jinja2's TemplateSyntaxError when
    it is not a template."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", _GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, chat_template: str | None, bos_token: str | None,
                 eos_token: str | None, eos_token_ids: list[int], bos_token_id: int | None,
                 file: Path | None = None):
        self._tok = tokenizer
        self.file = file  # the tokenizer.json it was read from (structured outputs' grammars read it too)
        self.bos_token, self.eos_token = bos_token, eos_token
        self.eos_token_ids = eos_token_ids
        self.bos_token_id = bos_token_id
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.chat_template = chat_template  # the Jinja source, as tokenizer_config.json has it
        self._template = compile_chat_template(chat_template) if chat_template else None

    @classmethod
    def from_dir(cls, path: str | Path, model_dir: str | Path | None = None) -> Tokenizer:
        """The tokenizer files (tokenizer.json, tokenizer_config.json, chat_template.jinja) of ``path``; the
        special token ids from ``model_dir``'s config.json and generation_config.json (default: ``path``'s),
        for a tokenizer kept apart from its model (``--tokenizer``)."""
        path = Path(path)
        model_dir = path if model_dir is None else Path(model_dir)
        file = path / "tokenizer.json"
        if not file.is_file():  # the tokenizers library would say only "No such file or directory"
            raise CheckpointError(f"{file}: not found (a checkpoint needs a fast tokenizer's tokenizer.json)")
        try:
            tok = HFTokenizer.from_file(str(file))
        except Exception as exc:  # the library raises a bare Exception for a file it cannot parse
            raise CheckpointError(f"{file}: not a tokenizer the tokenizers library can read: {exc}") from exc
        tc = read_json(path / "tokenizer_config.json") or {}
        template = tc.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_path = path / "chat_template.jinja"
        if template is None and jinja_path.exists():
            template = jinja_path.read_text()
        bos, eos = _token_text(tc.get("bos_token")), _token_text(tc.get("eos_token"))
        bos_id, eos_ids = special_token_ids(read_json(model_dir / "config.json") or {},
                                            read_json(model_dir / "generation_config.json"))
        if bos_id is None and bos:
            bos_id = tok.token_to_id(bos)
        eos_id = tok.token_to_id(eos) if eos else None
        if eos_id is not None and eos_id not in eos_ids:
            eos_ids.append(eos_id)
        return cls(tok, template, bos, eos, eos_ids, bos_id, file)

    def with_chat_template(self, chat_template: str) -> Tokenizer:
        """This tokenizer rendering chats with ``chat_template`` instead of the checkpoint's (``--chat-template``)."""
        return Tokenizer(self._tok, chat_template, self.bos_token, self.eos_token, self.eos_token_ids,
                         self.bos_token_id, self.file)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special-token strings in it (as a chat template writes them) become
        their ids. BOS is left to the chat template unless ``add_special_tokens``."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def stream_step(self, stream: DecodeStream, token_id: int) -> str | None:
        """``stream``'s new text with ``token_id`` (the tokenizers library's ``DecodeStream.step``)."""
        return stream.step(self._tok, token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    # Names the rendering sets itself; a request's chat_template_kwargs may not replace them.
    TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"})

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """The chat as the template renders it; ``kwargs`` are further template variables (Qwen3's
        ``enable_thinking``, say). InvalidRequestError when there is no template, or it refuses the messages."""
        if self._template is None:
            raise InvalidRequestError("messages", "this model has no chat template (its tokenizer_config.json "
                                                  "holds none): send the prompt to /v1/completions")
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                     **kwargs)


def load_tokenizer(config: EngineConfig, model_dir: Path, vocab_size: int, required: bool = False
                   ) -> Tokenizer | None:
    """The model's tokenizer, from ``config.tokenizer`` else the checkpoint's directory; None when the checkpoint has no tokenizer.json, none was named
    and none is ``required`` (prompts are then token ids). A named tokenizer that cannot be read, or that has
    more tokens than the model's ``vocab_size``, is a ValueError naming it."""
    if config.tokenizer is None:
        return Tokenizer.from_dir(model_dir) if required or (model_dir / "tokenizer.json").exists() else None
    try:
        tokenizer = Tokenizer.from_dir(Path(config.tokenizer).expanduser(), model_dir)
    except CheckpointError as exc:  # a plain ValueError: not the model's checkpoint
        raise ValueError(f"the tokenizer {config.tokenizer!r}: {exc}") from None
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(f"the tokenizer {config.tokenizer!r} has {tokenizer.vocab_size} tokens, more than the "
                         f"model's vocabulary of {vocab_size}: it is not this model's tokenizer")
    return tokenizer


class IncrementalDetokenizer:
    """Streams text for a growing token sequence: ``push`` returns only newly completed text.

    Decodes a short window (the previously emitted tokens and the new ones) rather than the whole
    sequence, and holds text back while it ends in an incomplete UTF-8 character ("\\ufffd"). ``context``:
    tokens decoded ahead of the stream (a prompt's last few, so its first word spaces right) whose text is
    never emitted, even when they end in an incomplete character.

    The tokenizers library's ``DecodeStream`` runs that windowed decode in one call a token (about half the
    cost of the two decodes from Python: ``benchmarks/detokenize.py``); this class keeps the window's bounds
    beside it. Where the stream cannot go
    on, the same decode continues from those bounds in Python: a decoder whose text for a window does not begin
    with its text for the window's start (byte-fallback tokens that are invalid UTF-8 together, the library's
    "Invalid prefix"), and a context ending mid-character, which the stream would emit once completed."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, context: list[int] | None = None,
                 use_stream: bool = True):
        """``use_stream`` False: the windowed decode in Python throughout (what the stream is measured against)."""
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(context or [])
        self._prefix = 0  # start of the window whose text was already emitted up to _read
        self._read = len(self._ids)  # tokens before this index are emitted (or were context)
        whole = not self._ids or not tokenizer.decode(self._ids, skip_special_tokens).endswith("\ufffd")
        self._stream = DecodeStream(self._ids, skip_special_tokens) if use_stream and whole else None

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        if self._stream is not None:
            try:
                text = self._tok.stream_step(self._stream, token_id)
            except Exception as exc:  # the library raises a bare Exception
                if "Invalid prefix" not in str(exc):
                    raise
                self._stream = None  # its state took the token in part: the window goes on in Python
            else:
                if text is None:
                    return ""
                self._prefix, self._read = self._read, len(self._ids)
                return text
        seen = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        text = self._tok.decode(self._ids[self._prefix:], self._skip)
        if len(text) <= len(seen) or text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(seen):]

    def flush(self) -> str:
        """Whatever is still held back (e.g. an incomplete character at the end of generation)."""
        seen = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        text = self._tok.decode(self._ids[self._prefix:], self._skip)
        self._prefix = self._read = len(self._ids)
        self._stream = None  # what it held is out now: anything pushed later goes on from these bounds
        return text[len(seen):]
