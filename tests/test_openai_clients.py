"""Third-party OpenAI clients against the live server: LangChain's ChatOpenAI and OpenAI LLM (which sends a
list of prompts in one request) and LiteLLM. Each covers chat, streaming, logprobs, stop, n, seed, a penalty
and an error, as the client's users would call them."""

from __future__ import annotations

import os

import httpx
import openai
import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of the price list on import

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.timeout(120)]

QUESTION = "What hides under the rocks at low tide?"
GREEDY = {"temperature": 0, "max_tokens": 6, "seed": 11, "frequency_penalty": 0.5}


def stop_char(text: str) -> str:
    """A character from the middle of ``text`` that makes a good stop string."""
    visible = [ch for ch in text if ch.isprintable() and ch != "\ufffd" and not ch.isspace()]
    assert len(visible) >= 2, f"greedy output too short to pick a stop string from: {text!r}"
    return visible[len(visible) // 2]


def completion_requests(server) -> float:
    """How many /v1/completions requests the server has answered with 200 (its Prometheus counter)."""
    text = httpx.get(f"{server.http_url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("tidepool_requests_total{") and 'api="/v1/completions"' in line
               and 'status="200"' in line)


def test_langchain_chat_openai(live_server):
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI

    base = {"model": live_server.model_id, "base_url": f"{live_server.http_url}/v1", "api_key": "none",
            "max_retries": 0, "timeout": 60, "extra_body": {"ignore_eos": True}}
    llm = ChatOpenAI(**base, **GREEDY, logprobs=True, top_logprobs=2)
    reply = llm.invoke(QUESTION)
    assert reply.usage_metadata["output_tokens"] == 6
    logprobs = reply.response_metadata["logprobs"]["content"]
    assert len(logprobs) == 6 and all(len(e["top_logprobs"]) == 2 for e in logprobs)
    assert "".join(chunk.content for chunk in llm.stream(QUESTION)) == reply.content
    stop = stop_char(reply.content)
    assert llm.invoke(QUESTION, stop=[stop]).content == reply.content[:reply.content.index(stop)]
    two = ChatOpenAI(**base, temperature=1.0, max_tokens=3, seed=5, n=2).generate([[HumanMessage(QUESTION)]])
    assert len(two.generations[0]) == 2
    with pytest.raises(openai.BadRequestError) as exc:
        ChatOpenAI(**base, temperature=5).invoke(QUESTION)
    assert exc.value.param == "temperature"


def test_langchain_openai_llm_sends_a_list_of_prompts(live_server):
    from langchain_openai import OpenAI

    base = {"model": live_server.model_id, "base_url": f"{live_server.http_url}/v1", "api_key": "none",
            "max_retries": 0, "timeout": 60, "extra_body": {"ignore_eos": True}}
    llm = OpenAI(**base, **GREEDY, logprobs=1)
    prompts = ["Barnacles", "Sea urchins graze on"]
    before = completion_requests(live_server)
    result = llm.generate(prompts)
    assert completion_requests(live_server) == before + 1  # one request held both prompts
    assert len(result.generations) == 2
    texts = [g[0].text for g in result.generations]
    for prompt, text, gens in zip(prompts, texts, result.generations, strict=True):
        assert llm.invoke(prompt) == text  # each choice belongs to its own prompt
        assert len(gens[0].generation_info["logprobs"]["tokens"]) == 6
    assert result.llm_output["token_usage"]["completion_tokens"] == 12
    assert "".join(llm.stream(prompts[1])) == texts[1]
    stop = stop_char(texts[1])
    assert llm.invoke(prompts[1], stop=[stop]) == texts[1][:texts[1].index(stop)]
    assert len(OpenAI(**base, temperature=1.0, max_tokens=3, seed=5, n=2).generate(prompts).generations[1]) == 2
    with pytest.raises(openai.BadRequestError) as exc:
        OpenAI(**base, presence_penalty=3).invoke(prompts[0])
    assert exc.value.param == "presence_penalty"


def test_litellm_completion(live_server):
    import litellm

    base = {"model": f"openai/{live_server.model_id}", "api_base": f"{live_server.http_url}/v1",
            "api_key": "none", "num_retries": 0, "timeout": 60, "extra_body": {"ignore_eos": True},
            "messages": [{"role": "user", "content": QUESTION}]}
    reply = litellm.completion(**base, **GREEDY, logprobs=True, top_logprobs=2)
    text = reply.choices[0].message.content
    assert reply.usage.completion_tokens == 6 and len(reply.choices[0].logprobs.content) == 6
    streamed = litellm.completion(**base, **GREEDY, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed) == text
    stop = stop_char(text)
    assert litellm.completion(**base, **GREEDY, stop=[stop]).choices[0].message.content == text[:text.index(stop)]
    two = litellm.completion(**base, temperature=1.0, max_tokens=3, seed=5, n=2)
    assert sorted(c.index for c in two.choices) == [0, 1]
    with pytest.raises(litellm.BadRequestError) as exc:
        litellm.completion(**base, max_tokens=2, top_p=0)
    assert "top_p" in str(exc.value)
