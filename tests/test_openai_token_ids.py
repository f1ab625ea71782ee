"""vLLM's ``return_token_ids`` through the official `openai` client against the live server, as RL rollout
frameworks use it (token in, token out): each choice's output token ids and the prompt's, whole and streamed.
A stream's deltas together hold every id, also those whose text is still held back, and the prompt's ids come
once (a chat's in its first chunk, each completion choice's in that choice's first chunk); they are the ids
``/tokenize`` gives and their text is the answer's. With them, ``truncate_prompt_tokens`` (vLLM's) is seen to
keep exactly the prompt's last k tokens."""

from __future__ import annotations

import grpc
import httpx
import pytest
from test_openai_features import CHAT, client

from tidepool.v1 import serving_pb2, serving_pb2_grpc

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.timeout(120)]

# Never matched; while the text so far could still begin it, the text is held back (7 characters), so the first
# deltas of a stream carry token ids and no text.
UNMATCHED_STOP = "\u2603" * 8


def tokenize(server, **body) -> list[int]:
    response = httpx.post(f"{server.http_url}/tokenize", json={"model": server.model_id, **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def text_of(server, ids: list[int]) -> str:
    """The ids' text as an answer's is (special tokens skipped)."""
    return server.dispatcher.tokenizer.decode(ids)


def extra(**fields) -> dict:
    return {"ignore_eos": True, "return_token_ids": True, **fields}


def test_completion_choices_hold_their_prompts_and_output_token_ids_whole_and_streamed(live_server):
    prompts = ["Limpets cling to", "Anemones close when"]
    kwargs = dict(model=live_server.model_id, prompt=prompts, max_tokens=12, temperature=0.0, n=2,
                  stop=[UNMATCHED_STOP], extra_body=extra())
    whole = client(live_server).completions.create(**kwargs)
    expected_prompts = [tokenize(live_server, prompt=p) for p in prompts]
    for choice in whole.choices:
        assert choice.prompt_token_ids == expected_prompts[choice.index // 2]
        assert len(choice.token_ids) == 12 and text_of(live_server, choice.token_ids) == choice.text
    assert whole.usage.completion_tokens == 4 * 12
    streamed: dict[int, list[int]] = {i: [] for i in range(4)}
    prompts_seen: dict[int, list[list[int]]] = {i: [] for i in range(4)}
    first_chunks: set[int] = set()
    for chunk in client(live_server).completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            if choice.model_extra.get("prompt_token_ids") is not None:
                prompts_seen[choice.index].append(choice.prompt_token_ids)
                assert choice.index not in first_chunks  # in the choice's first chunk, and only there
            first_chunks.add(choice.index)
            streamed[choice.index] += choice.token_ids
    assert streamed == {c.index: c.token_ids for c in whole.choices}
    assert prompts_seen == {i: [expected_prompts[i // 2]] for i in range(4)}


def test_a_chat_response_holds_its_prompts_and_each_choices_token_ids_whole_and_streamed(live_server):
    kwargs = dict(model=live_server.model_id, messages=CHAT, max_tokens=12, temperature=0.0, n=2,
                  stop=[UNMATCHED_STOP], extra_body=extra())
    whole = client(live_server).chat.completions.create(**kwargs)
    prompt = tokenize(live_server, messages=CHAT)
    assert whole.model_extra["prompt_token_ids"] == prompt and whole.usage.prompt_tokens == len(prompt)
    for choice in whole.choices:
        assert len(choice.token_ids) == 12
        assert text_of(live_server, choice.token_ids) == choice.message.content
    chunks = list(client(live_server).chat.completions.create(stream=True, **kwargs))
    assert chunks[0].model_extra.get("prompt_token_ids") == prompt
    assert all(c.model_extra.get("prompt_token_ids") is None for c in chunks[1:])
    streamed = {0: [], 1: []}
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.model_extra.get("token_ids") or []
    assert streamed == {c.index: c.token_ids for c in whole.choices}


def test_without_return_token_ids_no_token_ids_are_added(live_server):
    whole = client(live_server).completions.create(model=live_server.model_id, prompt="Limpets", max_tokens=2,
                                                   temperature=0.0)
    assert "token_ids" not in whole.choices[0].model_extra and "prompt_token_ids" not in whole.choices[0].model_extra


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens_for_text_ids_and_chat(live_server):
    c, limit = client(live_server), live_server.dispatcher.max_model_len
    text = "Periwinkles graze the algae off the rocks at low tide."
    whole = tokenize(live_server, prompt=text)
    cut = c.completions.create(model=live_server.model_id, prompt=text, max_tokens=2, temperature=0.0, echo=True,
                               extra_body=extra(truncate_prompt_tokens=5))
    assert cut.choices[0].prompt_token_ids == whole[-5:] and cut.usage.prompt_tokens == 5
    assert cut.choices[0].text.startswith(text_of(live_server, whole[-5:]))  # echo: the text of what was kept
    kept = c.completions.create(model=live_server.model_id, prompt=text, max_tokens=2, temperature=0.0, echo=True,
                                extra_body=extra(truncate_prompt_tokens=len(whole)))
    assert kept.choices[0].text.startswith(text) and kept.choices[0].prompt_token_ids == whole  # nothing cut
    # token ids past the context, cut to what fits before max_tokens (-1)
    ids = [(7 * i) % 200 + 30 for i in range(limit + 40)]
    fitted = c.completions.create(model=live_server.model_id, prompt=ids, max_tokens=8, temperature=0.0,
                                  extra_body=extra(truncate_prompt_tokens=-1))
    assert fitted.choices[0].prompt_token_ids == ids[-(limit - 8):] and len(fitted.choices[0].token_ids) == 8
    messages = [{"role": "user", "content": "tide " * limit}]
    chat = c.chat.completions.create(model=live_server.model_id, messages=messages, max_tokens=4, temperature=0.0,
                                     extra_body=extra(truncate_prompt_tokens=-1))
    assert chat.model_extra["prompt_token_ids"] == tokenize(live_server, messages=messages)[-(limit - 4):]
    grpc_request = serving_pb2.CompleteRequest(
        model=live_server.model_id, prompt=text,
        sampling=serving_pb2.SamplingOptions(max_tokens=2, temperature=0.0, truncate_prompt_tokens=7))
    chunks = list(serving_pb2_grpc.ServingStub(grpc.insecure_channel(live_server.grpc_target)).Complete(
        grpc_request, timeout=60))
    assert chunks[-1].usage.prompt_tokens == 7


@pytest.mark.parametrize("keep", [0, -2, 10**6])
def test_a_truncation_out_of_range_is_a_400_naming_it(live_server, keep):
    body = {"model": live_server.model_id, "prompt": "tide", "max_tokens": 1, "truncate_prompt_tokens": keep}
    response = httpx.post(f"{live_server.http_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "truncate_prompt_tokens", response.text
