"""Hostile inputs for the serving APIs, generated with hypothesis: HTTP bodies for the OpenAI routes, gRPC
requests (typed and raw bytes) and KV-transfer headers. ``tests/test_fuzz.py`` runs a few hundred cases
against a live server; ``benchmarks/chaos.py --fuzz-http N --fuzz-grpc N`` runs thousands.

Each ``fuzz_*`` runner sends ``n`` generated cases and returns a tally of the answers; a case counts as a
failure when the server answers HTTP 5xx, the gRPC codes INTERNAL or UNKNOWN, or the connection breaks.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field

import grpc
import httpx
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tidepool.v1 import serving_pb2

# ---- JSON values -----------------------------------------------------------------------------------------
surrogates = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)  # lone: written as \udXXX escapes
texts = st.text(st.one_of(st.characters(), surrogates), max_size=40)
numbers = st.one_of(
    st.integers(-(2**70), 2**70), st.sampled_from([10**400, -(10**400), 2**63, 2**64, -1, 0]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -0.0]))
junk = st.recursive(st.one_of(st.none(), st.booleans(), numbers, texts),
                    lambda inner: st.one_of(st.lists(inner, max_size=4),
                                            st.dictionaries(texts, inner, max_size=4)), max_leaves=12)


def _sampling(model: str, spoil) -> dict:
    """Optional OpenAI fields both routes take; valid ranges keep generation short (a few tokens)."""
    fields = {
        "model": st.just(model), "max_tokens": st.integers(1, 4), "temperature": st.sampled_from([0.0, 0.5, 1.0]),
        "top_p": st.floats(0.01, 1.0), "top_k": st.integers(-1, 50), "n": st.integers(1, 2),
        "seed": st.integers(0, 2**31), "stream": st.booleans(),
        "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3)),
    }
    return {name: spoil(value) for name, value in fields.items()}


def _bodies(required: dict, optional: dict) -> st.SearchStrategy:
    """max_tokens is always there: a valid body without it generates up to the context length (slow here)."""
    return st.fixed_dictionaries({**required, "max_tokens": optional.pop("max_tokens")}, optional=optional)


def _clean(valid: st.SearchStrategy) -> st.SearchStrategy:
    return valid


def _spoiled(valid: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly a valid value, sometimes junk of any type."""
    return st.one_of(valid, valid, valid, junk)


def _both(build) -> st.SearchStrategy:
    """Valid bodies, and bodies with junk values, unknown fields and required fields missing."""
    spoiled = st.tuples(build(_spoiled), st.dictionaries(texts, junk, max_size=2), st.booleans()).map(
        lambda b: {k: v for k, v in {**b[0], **b[1]}.items() if b[2] or k not in ("messages", "prompt")})
    return st.one_of(build(_clean), spoiled)


def chat_bodies(model: str) -> st.SearchStrategy:
    def build(spoil):
        message = spoil(st.fixed_dictionaries(
            {"role": spoil(st.sampled_from(["system", "user", "assistant"])), "content": spoil(texts)}))
        return _bodies({"messages": spoil(st.lists(message, min_size=1, max_size=3))}, _sampling(model, spoil))
    return _both(build)


def completion_bodies(model: str) -> st.SearchStrategy:
    def build(spoil):
        prompt = st.one_of(texts, st.lists(st.integers(-5, 2**33), min_size=1, max_size=8),
                           st.lists(texts, min_size=1, max_size=2))
        return _bodies({"prompt": spoil(prompt)}, _sampling(model, spoil))
    return _both(build)


def http_cases(model: str) -> st.SearchStrategy:
    """(path, raw body bytes): JSON (NaN/Infinity allowed, as some clients send them), raw bytes, cut JSON."""
    routes = st.one_of(st.tuples(st.just("/v1/chat/completions"), chat_bodies(model)),
                       st.tuples(st.just("/v1/completions"), completion_bodies(model)))
    as_json = routes.map(lambda pb: (pb[0], json.dumps(pb[1], allow_nan=True).encode()))
    raw = st.tuples(st.sampled_from(["/v1/chat/completions", "/v1/completions"]), st.binary(max_size=200))
    cut = st.tuples(as_json, st.integers(0, 200)).map(lambda c: (c[0][0], c[0][1][:c[1]]))
    return st.one_of(as_json, as_json, raw, cut)


# ---- gRPC requests ---------------------------------------------------------------------------------------
utf8 = st.text(max_size=40)  # protobuf strings must be valid UTF-8: the client library refuses others
floats32 = st.one_of(st.floats(width=32, allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 1.0]))
sampling_options = st.builds(
    serving_pb2.SamplingOptions, max_tokens=st.one_of(st.integers(1, 4), st.integers(0, 2**32 - 1)),
    temperature=floats32, top_p=floats32, top_k=st.integers(-(2**31), 2**31 - 1),
    seed=st.integers(-(2**63), 2**63 - 1), stop=st.lists(utf8, max_size=3), n=st.integers(0, 2**32 - 1),
    ignore_eos=st.booleans())
chat_messages = st.builds(serving_pb2.ChatMessage, role=st.one_of(st.sampled_from(["user", "system"]), utf8),
                          content=utf8)


def grpc_cases(model: str) -> st.SearchStrategy:
    """(method, serialized request bytes): typed Chat/Complete requests, and raw bytes (often not protobuf)."""
    models = st.one_of(st.just(model), utf8)
    chat = st.builds(serving_pb2.ChatRequest, model=models, messages=st.lists(chat_messages, max_size=3),
                     sampling=sampling_options, session_id=st.one_of(st.just(""), utf8))
    complete = st.builds(serving_pb2.CompleteRequest, model=models, prompt=utf8, sampling=sampling_options,
                         prompt_token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=8))
    valid_options = st.builds(serving_pb2.SamplingOptions, max_tokens=st.integers(1, 4), temperature=st.just(0.0),
                              stop=st.lists(utf8, max_size=2), n=st.integers(1, 2), ignore_eos=st.booleans())
    valid_chat = st.builds(serving_pb2.ChatRequest, model=st.just(model), sampling=valid_options,
                           messages=st.lists(st.builds(serving_pb2.ChatMessage, role=st.just("user"),
                                                       content=utf8), min_size=1, max_size=2))
    valid_complete = st.builds(serving_pb2.CompleteRequest, model=st.just(model), sampling=valid_options,
                               prompt=st.text(min_size=1, max_size=40))
    typed = st.one_of(st.tuples(st.just("Chat"), st.one_of(valid_chat, chat)),
                      st.tuples(st.just("Complete"), st.one_of(valid_complete, complete)))
    raw = st.tuples(st.sampled_from(["Chat", "Complete"]), st.binary(max_size=200))
    return st.one_of(typed.map(lambda mr: (mr[0], mr[1].SerializeToString())), raw)


# ---- runners ---------------------------------------------------------------------------------------------
@dataclass
class FuzzTally:
    cases: int = 0
    answers: Counter = field(default_factory=Counter)  # HTTP status or gRPC code name -> count
    failures: list[str] = field(default_factory=list)  # the first few failing cases, for the report

    def fail(self, case: str) -> None:
        if len(self.failures) < 5:
            self.failures.append(case[:300])

    @property
    def failed(self) -> int:
        return sum(n for answer, n in self.answers.items() if answer in ("INTERNAL", "UNKNOWN", "broken")
                   or (isinstance(answer, int) and answer >= 500))


def _run(strategy: st.SearchStrategy, n: int, case_fn) -> None:
    """Run ``case_fn`` on ``n`` generated cases: no shrinking, no example database (the tally is the result)."""
    @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def run(case) -> None:
        case_fn(case)
    run()


def fuzz_http(base_url: str, model: str, n: int, timeout_s: float = 30.0) -> FuzzTally:
    tally = FuzzTally()
    with httpx.Client(base_url=base_url, timeout=timeout_s) as client:
        def send(case: tuple[str, bytes]) -> None:
            path, body = case
            tally.cases += 1
            try:
                with client.stream("POST", path, content=body,
                                   headers={"content-type": "application/json"}) as response:
                    response.read()  # a stream must end cleanly too
                    answer = response.status_code
            except httpx.HTTPError as exc:
                answer = "broken"
                tally.fail(f"{path} {body!r}: {exc!r}")
            tally.answers[answer] += 1
            if isinstance(answer, int) and answer >= 500:
                tally.fail(f"{path} {body!r} -> {answer}")
        _run(http_cases(model), n, send)
    return tally


def fuzz_grpc(target: str, model: str, n: int, timeout_s: float = 30.0) -> FuzzTally:
    tally = FuzzTally()
    with grpc.insecure_channel(target) as channel:
        calls = {m: channel.unary_stream(f"/tidepool.v1.Serving/{m}", request_serializer=lambda b: b,
                                         response_deserializer=lambda b: b) for m in ("Chat", "Complete")}

        def send(case: tuple[str, bytes]) -> None:
            method, request = case
            tally.cases += 1
            try:
                for _ in calls[method](request, timeout=timeout_s):
                    pass
                answer = "OK"
            except grpc.RpcError as exc:
                answer = exc.code().name
                if answer in ("INTERNAL", "UNKNOWN"):
                    tally.fail(f"{method} {request!r} -> {answer}: {exc.details()}")
            tally.answers[answer] += 1
        _run(grpc_cases(model), n, send)
    return tally
