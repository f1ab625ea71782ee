"""Token-exact workloads (``--tokenizer``): random prompts that are exactly the asked number of tokens under a
BPE tokenizer trained here (merges, a BOS post-processor, byte tokens that cannot stand alone) and under the
tiny model's byte-level one; ShareGPT files; lengths counted with the tokenizer for the other workloads."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from loadtest.config import BenchConfig
from loadtest.plan import build_workload
from loadtest.tokens import PromptTokenizer, random_token_requests
from loadtest.workloads import sharegpt_requests, synth_text

pytestmark = pytest.mark.timeout(60)


def write_bpe_tokenizer(directory: Path) -> Path:
    """A byte-level BPE of 400 tokens trained on the load test's word list; adds ``<s>`` to every prompt."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<s>", "</s>"], show_progress=False)
    rng = random.Random(0)
    tok.train_from_iterator([synth_text(rng, 200, 1.0) for _ in range(200)], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return directory


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> PromptTokenizer:
    return PromptTokenizer.load(write_bpe_tokenizer(tmp_path_factory.mktemp("bpe")))


def test_random_prompts_are_exactly_the_input_length_in_tokens(bpe):
    assert bpe.num_special == 1  # the BOS the post-processor adds
    specs = random_token_requests(bpe, 50, input_len=64, output_len=5, prefix_len=8, seed=1, id_prefix="r-")
    for spec in specs:
        # 8 prefix + 64 tokens as the server encodes the prompt (vLLM's total): the text leaves room for BOS
        assert spec.prompt_len == 72 == bpe.prompt_count(spec.prompt)
        assert bpe.count(spec.prompt) == 71 and spec.max_tokens == 5
        assert "\ufffd" not in spec.prompt and "<s>" not in spec.prompt
    assert sum(len(s.prompt) for s in specs) > 1.5 * 64 * len(specs)  # merges: several characters a token
    assert len(os.path.commonprefix([s.prompt for s in specs])) >= 8  # the shared prefix tokens
    assert len({s.prompt for s in specs}) > 40 and specs[3].request_id == "r-3"  # random start offsets


def test_random_lengths_follow_the_range_ratio_and_the_seed(bpe):
    specs = random_token_requests(bpe, 200, input_len=41, output_len=20, range_ratio=0.5, seed=2)
    lens = [s.prompt_len for s in specs]
    assert all(s.prompt_len == bpe.prompt_count(s.prompt) for s in specs)
    assert min(lens) >= 20 + 1 and max(lens) <= 60 + 1 and len(set(lens)) > 10  # 40 text tokens +- 50%, BOS
    assert {s.max_tokens for s in specs} <= set(range(10, 31)) and len({s.max_tokens for s in specs}) > 5
    again = random_token_requests(bpe, 200, input_len=41, output_len=20, range_ratio=0.5, seed=2)
    other = random_token_requests(bpe, 200, input_len=41, output_len=20, range_ratio=0.5, seed=3)
    assert [s.prompt for s in again] == [s.prompt for s in specs] != [s.prompt for s in other]
    with pytest.raises(ValueError, match="range_ratio"):
        random_token_requests(bpe, 1, input_len=8, output_len=1, range_ratio=1.0)


def test_byte_level_tiny_tokenizer_gives_exact_lengths():
    from engine.loader import resolve_model_dir

    tok = PromptTokenizer.load(resolve_model_dir("tiny"))
    assert len(tok.allowed) == 128 and tok.num_special == 0  # bytes >= 0x80 never stand alone
    specs = random_token_requests(tok, 20, input_len=33, output_len=2, seed=0)
    assert all(s.prompt_len == 33 == len(s.prompt.encode()) == tok.prompt_count(s.prompt) for s in specs)
    assert tok.chars_per_token() == 1.0


def test_tokenizer_path_errors_are_clear(tmp_path, bpe):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        PromptTokenizer.load(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot load"):
        PromptTokenizer.load(tmp_path)
    assert PromptTokenizer.load(Path(bpe.name) / "tokenizer.json").num_special == 1  # the file itself works


def _sharegpt(path: Path) -> Path:
    def conv(human: str, gpt: str) -> dict:
        return {"id": human[:8], "conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": gpt}]}

    rng = random.Random(5)
    rows = [conv(synth_text(rng, 40, 1.0), synth_text(rng, 30, 1.0)) for _ in range(6)]
    rows += [conv("hi", "a long enough answer here"),  # prompt under 4 tokens: skipped
             conv(synth_text(rng, 40, 1.0), "ok"),  # answer under 4 tokens: skipped unless overridden
             {"id": "lonely", "conversations": [{"from": "human", "value": "no answer"}]}]
    path.write_text(json.dumps(rows))
    return path


def test_sharegpt_file_gives_prompts_with_counted_lengths(tmp_path, bpe):
    path = _sharegpt(tmp_path / "sg.json")
    specs = sharegpt_requests(str(path), 5, bpe.prompt_count, seed=0, id_prefix="s-")
    assert [s.request_id for s in specs] == [f"s-{i}" for i in range(5)]
    data = {c["conversations"][0]["value"]: c["conversations"][1]["value"] for c in json.loads(path.read_text())
            if len(c["conversations"]) == 2}
    for spec in specs:
        assert spec.prompt in data and spec.prompt != "hi"
        assert spec.prompt_len == bpe.prompt_count(spec.prompt)
        assert spec.max_tokens == bpe.prompt_count(data[spec.prompt]) >= 4
    fixed = sharegpt_requests(str(path), 20, bpe.prompt_count, output_len=3, seed=0)
    assert len(fixed) == 20 and {s.max_tokens for s in fixed} == {3}  # 7 usable, reused to reach 20
    assert len({s.request_id for s in fixed}) == 20 and len({s.prompt for s in fixed}) == 7
    assert [s.prompt for s in sharegpt_requests(str(path), 5, bpe.prompt_count, seed=0)] == [s.prompt for s in specs]
    (tmp_path / "bad.json").write_text('{"conversations": 3}')
    with pytest.raises(ValueError, match="not a ShareGPT"):
        sharegpt_requests(str(tmp_path / "bad.json"), 1, len)


def test_other_workloads_count_prompts_with_the_tokenizer(tmp_path, bpe):
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}) + "\n")
    w = build_workload(BenchConfig(model="m", workload="mooncake", trace=str(trace), length_scale=32 / 512), bpe)
    spec = w.specs[0]
    assert spec.prompt_len == bpe.prompt_count(spec.prompt)
    assert abs(spec.prompt_len - 38) <= 8  # chars per token measured on the tokenizer: close to 600/16 tokens
    chat = build_workload(BenchConfig(model="m", workload="chat", num_users=1, turns=1, input_len=30), bpe)
    first = chat.sessions[0].request(0)
    assert first.prompt_len == bpe.prompt_count(first.messages[0]["content"])
    no_tok = build_workload(BenchConfig(model="m", workload="random", num_prompts=2, input_len=30), None)
    assert [len(s.prompt) for s in no_tok.specs] == [30, 30]  # the chars-per-token estimate, 1 by default
