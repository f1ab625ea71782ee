"""``tidepool serve --served-model-name`` and ``--chat-template`` on a live server (the tool server, which serves
the checkpoint as "tool-model" and "tools-alias" and renders chats with its own template): every name is
served over HTTP and gRPC and echoed back, the checkpoint's own name is not, the metrics carry the first name,
and chats render with the given template, not the checkpoint's; a server that does not speculate refuses a
predicted output."""

from __future__ import annotations

import httpx
import openai
import pytest
from conftest import TOOL_TEMPLATE
from live_helpers import openai_client, user_message

from engine.tokenizer import Tokenizer
from tidepool.v1 import serving_pb2, serving_pb2_grpc

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.timeout(120)]


def test_models_lists_each_served_name_and_a_request_may_name_any(tool_server):
    client = openai_client(tool_server)
    assert [m.id for m in client.models.list().data] == ["tool-model", "tools-alias"]
    assert tool_server.model_id == "tool-model" and client.models.retrieve("tools-alias").id == "tools-alias"
    for name in ("tool-model", "tools-alias"):
        resp = client.chat.completions.create(model=name, messages=user_message("Hi"), max_tokens=2,
                                              temperature=0.0)
        assert resp.model == name and resp.choices[0].message.content is not None
    checkpoint = tool_server.dispatcher.model_id  # the directory's name: not served under it
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model=checkpoint, prompt="Hi", max_tokens=2)
    assert checkpoint in str(err.value)


def test_grpc_serves_an_alias_and_defaults_to_the_first_name(tool_server):
    import grpc

    with grpc.insecure_channel(tool_server.grpc_target) as channel:
        stub = serving_pb2_grpc.ServingStub(channel)
        for name in ("tools-alias", ""):  # "": the served model
            request = serving_pb2.CompleteRequest(model=name, prompt="Hi", sampling=serving_pb2.SamplingOptions(
                max_tokens=2, temperature=0.0, ignore_eos=True))
            chunks = list(stub.Complete(request, timeout=60))
            assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 2
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Complete(serving_pb2.CompleteRequest(model=tool_server.dispatcher.model_id, prompt="Hi"),
                               timeout=60))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_metrics_and_status_carry_the_first_served_name(tool_server):
    metrics = httpx.get(f"{tool_server.http_url}/metrics", timeout=10).text
    assert 'model_name="tool-model"' in metrics and f'model_name="{tool_server.dispatcher.model_id}"' not in metrics
    status = httpx.get(f"{tool_server.http_url}/v1/cluster/status", timeout=10).json()
    assert status["model"] == "tool-model"


def test_chats_render_with_the_chat_template_option_not_the_checkpoints(tool_server, serving_model_dir):
    """/tokenizer_info reports the template in use; /tokenize renders a chat with tools as it, which the
    checkpoint's own template (the tiny model's) would render without them."""
    info = httpx.get(f"{tool_server.http_url}/tokenizer_info", timeout=10).json()
    own = Tokenizer.from_dir(serving_model_dir)
    assert info["chat_template"] == TOOL_TEMPLATE != own.chat_template
    tools = [{"type": "function", "function": {"name": "set_unit", "parameters": {"type": "object"}}}]
    body = {"model": "tools-alias", "messages": user_message("Hi"), "tools": tools}
    ids = httpx.post(f"{tool_server.http_url}/tokenize", json=body, timeout=10).json()["tokens"]
    rendered = own.with_chat_template(TOOL_TEMPLATE).apply_chat_template(user_message("Hi"), tools=tools)
    assert ids == own.encode(rendered) != own.encode(own.apply_chat_template(user_message("Hi")))
    assert "Tools: set_unit" in rendered


def test_a_prediction_is_refused_where_no_worker_speculates(tool_server):
    """Predicted outputs are drafts, which only a server started with --num-speculative-tokens verifies."""
    with pytest.raises(openai.BadRequestError) as err:
        openai_client(tool_server).chat.completions.create(
            model="tool-model", messages=user_message("hi"), max_tokens=4,
            prediction={"type": "content", "content": "hello"})
    assert err.value.body["param"] == "prediction" and "--num-speculative-tokens" in err.value.body["message"]
    assert err.value.body["code"] == "unsupported_parameter"
