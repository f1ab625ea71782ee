"""Completions' echo and the prompt logprobs behind it, through the official `openai` client against the live
server, driven as lm-evaluation-harness drives a server for loglikelihood tasks (`local-completions`: token-id
prompts, echo, logprobs 1, max_tokens 1, temperature 0) and checked against transformers' log-softmax on the
served weights; streamed, and with max_tokens 0 (the prompt only); and vLLM's prompt_logprobs field on
completions and chat, with ranks, checked the same way."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
import transformers
from test_openai_features import client, token_id

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.timeout(120)]

TEXT = "Barnacles feed by kicking their feathery legs through the passing water."  # > 4 blocks of bytes


def log_softmax(model_dir, ids: list[int]) -> torch.Tensor:
    """transformers' float32 log-softmax at each position: row i is the distribution of token i + 1."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].log_softmax(-1)


def test_an_lm_eval_loglikelihood_request_scores_each_prompt_as_transformers(live_server, serving_model_dir):
    gen = torch.Generator().manual_seed(21)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (40, 23)]
    resp = client(live_server).completions.create(
        model=live_server.model_id, prompt=prompts, temperature=0, max_tokens=1, logprobs=1, seed=1234, echo=True,
        extra_body={"return_tokens_as_token_ids": True})
    assert resp.usage.prompt_tokens == 63 and resp.usage.completion_tokens == 2
    for choice, ids in zip(sorted(resp.choices, key=lambda c: c.index), prompts, strict=True):
        lp, ref = choice.logprobs, log_softmax(serving_model_dir, ids)
        assert [token_id(t) for t in lp.tokens][:len(ids)] == ids and len(lp.tokens) == len(ids) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
        assert lp.token_logprobs[1:len(ids)] == pytest.approx([ref[i - 1, ids[i]].item() for i in range(1, len(ids))],
                                                              abs=1e-3)
        for i in range(1, len(ids)):  # lm-eval's greedy test: the token's logprob is the top one's
            assert (max(lp.top_logprobs[i].values()) == lp.token_logprobs[i]) == (ref[i - 1].argmax() == ids[i])
            assert len(lp.top_logprobs[i]) in (1, 2)  # the most likely token and the prompt's


def test_echo_streams_the_prompt_first_and_max_tokens_0_returns_only_the_prompt(live_server):
    c = client(live_server)
    kwargs = dict(model=live_server.model_id, prompt=TEXT, max_tokens=3, temperature=0, echo=True,
                  extra_body={"ignore_eos": True})
    whole = c.completions.create(**kwargs)
    assert whole.choices[0].text.startswith(TEXT) and whole.usage.completion_tokens == 3
    chunks = list(c.completions.create(stream=True, **kwargs))
    assert chunks[0].choices[0].text.startswith(TEXT)
    assert "".join(ch.choices[0].text for ch in chunks) == whole.choices[0].text
    only = c.completions.create(model=live_server.model_id, prompt=TEXT, max_tokens=0, echo=True, logprobs=0)
    choice = only.choices[0]
    assert (choice.text, choice.finish_reason, only.usage.completion_tokens) == (TEXT, "length", 0)
    assert len(choice.logprobs.tokens) == only.usage.prompt_tokens == len(TEXT.encode())
    # its blocks were cached by the requests above; a scored prompt is computed whole all the same
    assert only.usage.prompt_tokens_details.cached_tokens == 0
    with pytest.raises(openai.BadRequestError) as exc:  # max_tokens 0 means something only with echo
        c.completions.create(model=live_server.model_id, prompt=TEXT, max_tokens=0)
    assert exc.value.param == "max_tokens" and "echo" in exc.value.message


def test_streamed_text_with_unicode_line_breaks_reaches_a_client_reading_by_splitlines(live_server):
    """U+2028, U+2029 and U+0085 are text to JSON and SSE, but line ends to str.splitlines (so to httpx's
    ``aiter_lines``): the events carry them escaped, so each data line is whole JSON for such a client too."""
    text = "tide\u2028pool\u2029rock\x85pool"
    body = {"model": live_server.model_id, "prompt": text, "max_tokens": 2, "temperature": 0, "echo": True,
            "stream": True}
    with httpx.stream("POST", live_server.http_url + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["text"].startswith(text)


def check_prompt_logprobs(entries: list, ids: list[int], ref: torch.Tensor, k: int) -> None:
    """vLLM's shape: null, then per token {id: {logprob, rank, decoded_token}} for it and the k most likely."""
    assert len(entries) == len(ids) and entries[0] is None
    for i in range(1, len(ids)):
        row, entry = ref[i - 1], entries[i]
        prompt = entry[str(ids[i])]
        assert prompt["logprob"] == pytest.approx(row[ids[i]].item(), abs=1e-3)
        assert prompt["rank"] == int((row > row[ids[i]] + 1e-5).sum()) + 1  # (float ties aside)
        assert prompt["decoded_token"] == f"token_id:{ids[i]}"
        top = row.topk(k)
        assert {int(t) for t in entry} == {ids[i], *top.indices.tolist()}
        for place, (t, lp) in enumerate(zip(top.indices.tolist(), top.values.tolist(), strict=True), 1):
            if t != ids[i]:
                assert entry[str(t)]["rank"] == place and entry[str(t)]["logprob"] == pytest.approx(lp, abs=1e-3)


def test_vllms_prompt_logprobs_hold_each_prompt_tokens_logprob_rank_and_top_k(live_server, serving_model_dir):
    c = client(live_server)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (30, 17)]
    resp = c.completions.create(model=live_server.model_id, prompt=prompts, max_tokens=2, temperature=0,
                                extra_body={"prompt_logprobs": 2, "return_tokens_as_token_ids": True})
    for choice in resp.choices:
        ids = prompts[choice.index]
        check_prompt_logprobs(choice.model_extra["prompt_logprobs"], ids, log_softmax(serving_model_dir, ids), 2)
        assert choice.logprobs is None  # the prompt's, not the answer's
    messages = [{"role": "user", "content": "Which crab lives in a borrowed shell?"}]
    tokenizer = live_server.dispatcher.tokenizer
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages))
    chat = c.chat.completions.create(model=live_server.model_id, messages=messages, max_tokens=2, n=2,
                                     temperature=0.8, extra_body={"prompt_logprobs": 0,
                                                                  "return_tokens_as_token_ids": True})
    assert chat.usage.prompt_tokens == len(ids)
    check_prompt_logprobs(chat.model_extra["prompt_logprobs"], ids, log_softmax(serving_model_dir, ids), 0)


@pytest.mark.parametrize("extra, named", [({"prompt_logprobs": 21}, "must be in [0, 20]"),
                                          ({"prompt_logprobs": 1, "stream": True}, "not available with stream")])
def test_prompt_logprobs_out_of_range_or_streamed_is_a_400_naming_it(live_server, extra, named):
    with pytest.raises(openai.BadRequestError) as exc:
        client(live_server).completions.create(model=live_server.model_id, prompt=TEXT, max_tokens=2,
                                               extra_body=extra)
    assert exc.value.param == "prompt_logprobs" and named in exc.value.message
