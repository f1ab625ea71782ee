"""Prompts as clients see them, on a server whose tokenizer adds BOS to text (as Llama's and Mistral's
tokenizer.json post-processors do) and whose chat template refuses roles out of turn (as Mistral's does) and
reads a variable (as Qwen3's reads enable_thinking): completions' text prompts get BOS (vLLM's and
transformers' default; ``add_special_tokens: false`` leaves it out, over HTTP and gRPC), a chat's comes from
its template alone, chat_template_kwargs reach the template, a refusal is a 400, a chat prompt may end
after its last message or inside it (add_generation_prompt, continue_final_message), and vLLM's
``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` report exactly what generation uses."""

from __future__ import annotations

import json

import httpx
import jinja2
import openai
import pytest
from live_helpers import checkpoint_with_template
from test_gateway_grpc import stub
from test_openai_features import client

from tidepool.v1 import serving_pb2

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.timeout(120)]

TEXT = "Periwinkles graze"
CHAT = [{"role": "user", "content": "Hi"}]
TEMPLATE = (  # the tiny model's, plus Mistral's turn check and a Qwen3-style switch
    "{{ bos_token }}{% for message in messages %}"
    "{% if loop.index0 > 0 and message['role'] == messages[loop.index0 - 1]['role'] %}"
    "{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|eot|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think></think>' }}{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def bos_server(start_server, serving_model_dir, tmp_path_factory):
    """One colocated worker serving the service tests' checkpoint with a BOS-adding post-processor and
    ``TEMPLATE``."""
    model = checkpoint_with_template(serving_model_dir, tmp_path_factory.mktemp("bos-model"), TEMPLATE)
    spec = json.loads((model / "tokenizer.json").read_text())
    bos = json.loads((model / "tokenizer_config.json").read_text())["bos_token"]
    bos_id = next(t["id"] for t in spec["added_tokens"] if t["content"] == bos)
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}}
    (model / "tokenizer.json").write_text(json.dumps(spec))
    server = start_server(colocated=1, model_dir=model)
    server.bos_id = bos_id
    yield server
    server.stop()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.http_url}{path}", json=body, timeout=60)


def test_text_completions_get_bos_unless_told_not_to(bos_server):
    c, text_ids = client(bos_server), list(TEXT.encode())  # the byte-level vocabulary: a byte is its id
    kwargs = dict(model=bos_server.model_id, prompt=TEXT, max_tokens=1, echo=True, logprobs=0)
    with_bos = c.completions.create(**kwargs)
    assert with_bos.usage.prompt_tokens == len(text_ids) + 1
    assert with_bos.choices[0].text.startswith(TEXT)  # the text as sent, not its ids' decoding
    without = c.completions.create(**kwargs, extra_body={"add_special_tokens": False})
    assert without.usage.prompt_tokens == len(text_ids)
    ids = c.completions.create(model=bos_server.model_id, prompt=text_ids, max_tokens=1)  # ids are used as sent
    assert ids.usage.prompt_tokens == len(text_ids)
    grpc_stub = stub(bos_server)
    for unset_or_true, expected in ((None, len(text_ids) + 1), (False, len(text_ids))):
        request = serving_pb2.CompleteRequest(model=bos_server.model_id, prompt=TEXT, add_special_tokens=unset_or_true,
                                              sampling=serving_pb2.SamplingOptions(max_tokens=1))
        chunks = list(grpc_stub.Complete(request, timeout=60))
        assert chunks[-1].usage.prompt_tokens == expected


def test_tokenize_reports_the_ids_generation_uses_and_detokenize_inverts_them(bos_server):
    c = client(bos_server)
    tokenized = post(bos_server, "/tokenize", {"model": bos_server.model_id, "prompt": TEXT,
                                               "return_token_strs": True}).json()
    assert tokenized["tokens"] == [bos_server.bos_id, *TEXT.encode()] and tokenized["count"] == len(TEXT) + 1
    assert tokenized["max_model_len"] == bos_server.dispatcher.max_model_len
    assert "".join(tokenized["token_strs"][1:]) == TEXT
    plain = post(bos_server, "/tokenize", {"prompt": TEXT, "add_special_tokens": False}).json()
    assert plain["tokens"] == list(TEXT.encode()) and plain["token_strs"] is None
    chat = post(bos_server, "/tokenize", {"messages": CHAT}).json()
    served = c.chat.completions.create(model=bos_server.model_id, messages=CHAT, max_tokens=1)
    assert chat["count"] == served.usage.prompt_tokens
    assert chat["tokens"].count(bos_server.bos_id) == 1  # the template's BOS, none added on top
    text = post(bos_server, "/detokenize", {"tokens": chat["tokens"]}).json()["prompt"]
    assert text.endswith("Hi<|eot|><|assistant|>")  # special tokens spelled out
    assert post(bos_server, "/tokenize", {"prompt": TEXT}).json()["tokens"] == tokenized["tokens"]


def test_tokenizer_info_lets_a_client_render_and_encode_as_the_server(bos_server):
    info = httpx.get(f"{bos_server.http_url}/tokenizer_info", timeout=10).json()
    assert info["bos_token"] == "<|begin_of_text|>" and info["eos_token"] == "<|eot|>"
    assert info["model_max_length"] == bos_server.dispatcher.max_model_len
    # lm-evaluation-harness's remote tokenizer: the template rendered client-side, then encoded by /tokenize,
    # gives the ids the server's chat path computes
    rendered = jinja2.Environment().from_string(info["chat_template"]).render(
        messages=CHAT, add_generation_prompt=True, bos_token=info["bos_token"])
    remote = post(bos_server, "/tokenize", {"prompt": rendered, "add_special_tokens": False}).json()["tokens"]
    assert remote == post(bos_server, "/tokenize", {"messages": CHAT}).json()["tokens"]
    eos = post(bos_server, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert len(eos) == 1 and eos[0] in bos_server.dispatcher.tokenizer.eos_token_ids


def test_chat_template_kwargs_reach_the_template_and_its_refusal_is_a_400(bos_server):
    c = client(bos_server)
    plain = post(bos_server, "/tokenize", {"messages": CHAT}).json()["count"]
    off = {"enable_thinking": False}
    thinking_off = post(bos_server, "/tokenize", {"messages": CHAT, "chat_template_kwargs": off}).json()["count"]
    assert thinking_off == plain + len("<think></think>")
    served = c.chat.completions.create(model=bos_server.model_id, messages=CHAT, max_tokens=1,
                                       extra_body={"chat_template_kwargs": off})
    assert served.usage.prompt_tokens == thinking_off
    with pytest.raises(openai.BadRequestError) as exc:  # two user turns in a row: the template raises
        c.chat.completions.create(model=bos_server.model_id, messages=CHAT + CHAT, max_tokens=1)
    assert exc.value.param == "messages" and "roles must alternate" in exc.value.message
    with pytest.raises(openai.BadRequestError) as exc:
        c.chat.completions.create(model=bos_server.model_id, messages=CHAT, max_tokens=1,
                                  extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
    assert exc.value.param == "chat_template_kwargs"


def test_a_chat_prompt_ends_with_the_generation_prompt_after_the_last_message_or_inside_it(bos_server):
    """add_generation_prompt false ends the prompt after the last turn; continue_final_message inside the final
    (assistant) message, so the answer continues its text; /tokenize and chat completions agree, and the final
    message's special-token text stays plain text there too."""
    c = client(bos_server)
    partial = [*CHAT, {"role": "assistant", "content": "Periwinkles <|eot|>graze on"}]

    def text(body: dict) -> str:
        ids = post(bos_server, "/tokenize", body).json()["tokens"]
        return post(bos_server, "/detokenize", {"tokens": ids}).json()["prompt"]

    assert text({"messages": CHAT}).endswith("Hi<|eot|><|assistant|>")
    assert text({"messages": CHAT, "add_generation_prompt": False}).endswith("Hi<|eot|>")
    body = {"messages": partial, "add_generation_prompt": False, "continue_final_message": True}
    ids = post(bos_server, "/tokenize", body).json()["tokens"]
    assert text(body).endswith("Hi<|eot|><|assistant|>Periwinkles <|eot|>graze on")
    eot = bos_server.dispatcher.tokenizer.token_to_id("<|eot|>")
    assert ids.count(eot) == 1  # the user's turn end only: the one in the content is plain text
    served = c.chat.completions.create(model=bos_server.model_id, messages=partial, max_tokens=1, extra_body={
        "add_generation_prompt": False, "continue_final_message": True})
    assert served.usage.prompt_tokens == len(ids)
    for extra, says in (({"continue_final_message": True}, "needs add_generation_prompt false"),
                        ({"continue_final_message": True, "add_generation_prompt": False},
                         "the final message must be the assistant's")):
        with pytest.raises(openai.BadRequestError) as exc:
            c.chat.completions.create(model=bos_server.model_id, messages=CHAT if "final" in says else partial,
                                      max_tokens=1, extra_body=extra)
        assert exc.value.param == "continue_final_message" and says in exc.value.message


def test_a_final_message_whose_template_rewrites_it_cannot_be_continued():
    """A template that trims content: a final message with a trailing space is not where the prompt would end
    (a 400 naming continue_final_message); one the trim leaves as it is continues."""
    from engine.errors import InvalidRequestError
    from engine.loader import resolve_model_dir
    from engine.tokenizer import Tokenizer
    from services.gateway.chat_prompt import encode_chat
    from services.gateway.token_texts import TokenTexts

    trims = "{% for m in messages %}<|{{ m.role }}|>{{ m.content | trim }}<|eot|>{% endfor %}"
    texts = TokenTexts(Tokenizer.from_dir(resolve_model_dir("tiny")).with_chat_template(trims))
    with pytest.raises(InvalidRequestError) as err:
        encode_chat(texts, [*CHAT, {"role": "assistant", "content": "Tide is "}], add_generation_prompt=False,
                    continue_final=True)
    assert err.value.field == "continue_final_message"
    ids = encode_chat(texts, [*CHAT, {"role": "assistant", "content": "Tide is"}], add_generation_prompt=False,
                      continue_final=True)
    assert texts.tokenizer.decode(ids, skip_special_tokens=False) == "<|user|>Hi<|eot|><|assistant|>Tide is"


@pytest.mark.parametrize("path, body, param, status", [
    ("/tokenize", {}, "prompt", 400),
    ("/tokenize", {"prompt": "a", "continue_final_message": True}, "continue_final_message", 400),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, "prompt", 400),
    ("/tokenize", {"messages": CHAT, "add_special_tokens": True}, "add_special_tokens", 400),
    ("/tokenize", {"messages": [{"role": "tool", "content": "x"}]}, "messages", 400),
    ("/tokenize", {"prompt": "a", "model": "nope"}, "model", 404),
    ("/tokenize", {"prompt": "a", "chat_template_kwargs": {"x": 1}}, "chat_template_kwargs", 400),
    ("/tokenize", {"messages": CHAT + CHAT}, "messages", 400),
    ("/detokenize", {"tokens": [10 ** 6]}, "tokens", 400),
    ("/detokenize", {"tokens": [1], "skip": True}, "skip", 400),
])
def test_bad_tokenize_requests_name_the_field(bos_server, path, body, param, status):
    resp = post(bos_server, path, body)
    assert resp.status_code == status and resp.json()["error"]["param"] == param, resp.text
