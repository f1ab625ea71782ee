"""The tiny model's byte-level tokenizer: round trips, chat template, EOS ids, streaming detokenization (also
with a byte-fallback and a Metaspace tokenizer, whose decoders the stream must follow too)."""

from __future__ import annotations

import json
import random

import pytest
import transformers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from tokenizers.decoders import DecodeStream

from engine.errors import InvalidRequestError
from engine.loader import resolve_model_dir
from engine.tokenizer import IncrementalDetokenizer, Tokenizer

pytestmark = pytest.mark.timeout(60)
TEXTS = ["Hello, world!", "naïve café — 東京 🌊🐙\n\ttabs", "", " leading and trailing spaces  ",
         "bytes like <| and |> and \x00 stay text"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    mp = pytest.MonkeyPatch()
    mp.setenv("TIDEPOOL_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    yield Tokenizer.from_dir(resolve_model_dir("tiny"))
    mp.undo()


@pytest.mark.parametrize("text", TEXTS)
def test_any_text_round_trips(tok, text):
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte
    assert tok.decode(ids) == text


def test_chat_template_uses_special_tokens(tok):
    prompt = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Hi"}])
    assert prompt == "<|begin_of_text|><|system|>Be brief.<|eot|><|user|>Hi<|eot|><|assistant|>"
    ids = tok.encode(prompt)
    assert ids[0] == tok.bos_token_id == 256
    assert ids[-1] == tok.token_to_id("<|assistant|>")
    assert tok.decode(ids) == "Be brief.Hi"  # special tokens skipped
    no_gen = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert not no_gen.endswith("<|assistant|>")


def test_a_chat_without_a_template_is_a_request_error(tmp_path, tok):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((resolve_model_dir("tiny") / name).read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["chat_template"]  # a base model's tokenizer
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidRequestError) as exc:
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "Hi"}])
    assert exc.value.field == "messages" and "/v1/completions" in str(exc.value)


def test_eos_ids(tok):
    assert set(tok.eos_token_ids) == {tok.token_to_id("<|end_of_text|>"), tok.token_to_id("<|eot|>")}


def test_incremental_detokenizer_streams_whole_characters(tok):
    text = "naïve café — 東京 🌊🐙!"
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(i) for i in tok.encode(text)]
    assert "".join(pieces) + detok.flush() == text
    assert all("\ufffd" not in p for p in pieces)
    wave = tok.encode("🌊")
    held = IncrementalDetokenizer(tok)
    assert [held.push(i) for i in wave] == ["", "", "", "🌊"]


def test_context_that_ends_mid_character_is_never_emitted(tok):
    """A prompt of token ids may end inside a character: its bytes stay context, not output text."""
    context = tok.encode("ab") + tok.encode("🌊")[:2]
    detok = IncrementalDetokenizer(tok, context=context)
    assert "".join(map(detok.push, tok.encode("ok"))) + detok.flush() == "ok"


def byte_fallback_tokenizer() -> Tokenizer:
    """Llama-2 / Gemma style: byte tokens <0xNN> for what the vocabulary lacks, decoded by ByteFallback, which
    turns a run of byte tokens that is not UTF-8 into one U+FFFD per byte, valid bytes in it too."""
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256)), "▁", "▁the", "▁y", "a", "漢", "▁»"]
    model = models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], byte_fallback=True, unk_token="<unk>")
    hf = HFTokenizer(model)
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    hf.add_special_tokens(["<|eot|>"])
    return Tokenizer(hf, None, None, None, [], None)


def metaspace_tokenizer() -> Tokenizer:
    """Mistral / Llama-2 style with a Metaspace decoder, trained on a few sentences."""
    hf = HFTokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    hf.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    hf.train_from_iterator(TEXTS * 20, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<|eot|>"]))
    return Tokenizer(hf, None, None, None, [], None)


def streamed(tok: Tokenizer, ids: list[int], context: int, skip: bool, use_stream: bool) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip, context=ids[:context], use_stream=use_stream)
    return [detok.push(i) for i in ids[context:]] + [detok.flush()]


@pytest.mark.parametrize("family", ["byte-level", "byte-fallback", "metaspace"])
def test_the_stream_emits_what_the_window_decoded_in_python_does(tok, family):
    """Token by token, with and without prompt context and special tokens, over random ids (invalid UTF-8,
    stray specials) and real text: the library's stream (and where it refuses a token, the Python window
    after it) hands out the same pieces as the windowed decode in Python throughout."""
    tok = {"byte-level": tok, "byte-fallback": byte_fallback_tokenizer(), "metaspace": metaspace_tokenizer()}[family]
    rng = random.Random(7)
    for trial in range(120):
        text = "".join(rng.choice(TEXTS + ["<|eot|>", "»", " the"]) for _ in range(4))
        ids = [rng.randrange(tok.vocab_size) for _ in range(30)] if trial % 2 else tok.encode(text)
        context, skip = rng.choice([0, 2, 4]), trial % 4 < 2
        assert streamed(tok, ids, context, skip, True) == streamed(tok, ids, context, skip, False), (ids, context)


def test_a_token_the_library_stream_refuses_goes_on_from_the_window():
    """'l' then bytes that are not UTF-8 together: the byte fallback turns the 'l' already handed out into
    U+FFFD as well, so the window's text no longer begins with what it emitted, and tokenizers' DecodeStream
    raises ("Invalid prefix"). The detokenizer goes on in Python from the same window."""
    tok = byte_fallback_tokenizer()
    ids = [3 + b for b in b"l\xbbQ\xe2o"] + [tok.token_to_id("漢"), tok.token_to_id("▁y")]
    stream = DecodeStream([], True)
    with pytest.raises(Exception, match="Invalid prefix"):
        for i in ids:
            stream.step(tok._tok, i)
    pieces = streamed(tok, ids, 0, True, True)
    assert pieces == streamed(tok, ids, 0, True, False)
    assert pieces[0] == "l" and pieces[-3:] == ["\ufffd" * 4 + "漢", " y", ""]


def test_incremental_detokenizer_skips_special_tokens(tok):
    detok = IncrementalDetokenizer(tok)
    out = "".join(map(detok.push, tok.encode("ok"))) + detok.push(tok.token_to_id("<|eot|>"))
    assert out == "ok"


def test_a_template_renders_tools_as_transformers_renders_them(tmp_path, tok):
    # transformers' tojson keeps key order and escapes nothing; its {% generation %} block renders its body
    template = ("{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% for m in messages %}<|{{ m.role }}|>"
                "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
                "{% else %}{{ m.content }}{% endif %}<|eot|>{% endfor %}<|assistant|>")
    tools = [{"type": "function", "function": {"name": "lookup", "description": "Finds <tags> & the 'quoted'",
                                               "parameters": {"type": "object", "properties": {}}}}]
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    tiny = resolve_model_dir("tiny")
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tiny / "tokenizer.json"), chat_template=template)
    expected = theirs.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    ours = Tokenizer(tok._tok, template, tok.bos_token, tok.eos_token, tok.eos_token_ids, tok.bos_token_id)
    assert ours.apply_chat_template(messages, tools=tools) == expected
    assert '{"type": "function", "function": {"name": "lookup", "description": "Finds <tags> & the \'quoted\'"' \
        in expected


def test_a_checkpoint_without_a_tokenizer_takes_one_named_apart(tiny, tmp_path):
    """--tokenizer: the files come from the named directory, the EOS ids from the model's configs as well; the
    engine's answers have text, as with the checkpoint's own tokenizer."""
    from test_engine_model import build_hf_checkpoint

    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.sampling_params import SamplingParams

    build_hf_checkpoint(tmp_path / "model", "llama", vocab_size=272, eos_token_id=7)
    assert not (tmp_path / "model" / "tokenizer.json").exists()
    tiny_dir = str(resolve_model_dir("tiny"))
    assert Engine(EngineConfig(model=str(tmp_path / "model"))).tokenizer is None  # token ids only
    engine = Engine(EngineConfig(model=str(tmp_path / "model"), tokenizer=tiny_dir))
    tiny_tok = Tokenizer.from_dir(tiny_dir)
    assert engine.tokenizer.encode("tide") == tiny_tok.encode("tide")
    # the model's EOS id and the tokenizer's EOS token, not the ids of the tiny model's own configs
    assert engine.eos_token_ids == {7, tiny_tok.token_to_id(tiny_tok.eos_token)} != set(tiny_tok.eos_token_ids)
    engine.add_request("r", tiny_tok.encode("Hello, tide"), SamplingParams(max_tokens=6, temperature=0.0,
                                                                          ignore_eos=True))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert "".join(o.text for o in outputs) == tiny_tok.decode([t for o in outputs for t in o.new_token_ids])


def test_a_named_tokenizer_that_is_not_the_models_is_refused_naming_it(tiny, tmp_path):
    from test_engine_model import build_hf_checkpoint

    from engine.config import EngineConfig
    from engine.engine import Engine

    build_hf_checkpoint(tmp_path / "model", "llama")  # 128 tokens
    for directory, says in ((tmp_path, "tokenizer.json: not found"),
                            (resolve_model_dir("tiny"), "has 272 tokens, more than the model's vocabulary of 128")):
        with pytest.raises(ValueError, match=f"the tokenizer '{directory}'.*{says}"):
            Engine(EngineConfig(model=str(tmp_path / "model"), tokenizer=str(directory)))
