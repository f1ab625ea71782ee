"""Streaming clients: any OpenAI-compatible HTTP server (SSE), and Tidepool's gRPC ``Serving`` service.

Both fill a ``RequestRecord`` in place while the stream runs, so a run cut short still has what was
measured. A chunk counts as a token arrival when it carries text, token ids or a finish reason; chunks that
carry nothing (the role-only first chunk many servers send before any token exists, usage-only chunks)
are not, so TTFT is the first real token. Output tokens come from ``usage.completion_tokens`` when the
server reports it, else from the token ids (gRPC) or the number of token chunks.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime

import grpc
import httpx

from loadtest.workloads import RequestSpec
from tidepool.v1 import serving_pb2, serving_pb2_grpc

_SSE_LINE_END = re.compile(r"\r\n|\r|\n")


@dataclass
class RequestRecord:
    """What one request measured. Times are seconds; ``chunk_s`` and ``latency_s`` count from ``start_s``."""

    request_id: str
    prompt_tokens: int = 0  # the workload's intended length until the server reports usage
    status: str = "pending"  # "ok" | "failed" | "rejected"
    start_s: float = 0.0  # time.perf_counter() when the request was sent
    end_s: float = 0.0  # time.perf_counter() when it finished, however it finished (set by the runner)
    chunk_s: list[float] = field(default_factory=list)
    latency_s: float = 0.0  # last event received (vLLM's E2EL)
    output_tokens: int = 0
    cached_tokens: int = 0
    generated_text: str = ""
    error: str = ""
    retry_after_s: float | None = None
    server_usage: bool = False  # the server reported usage: its token counts stand
    _token_ids: int = 0  # token ids seen in the stream (gRPC), the fallback output count

    @property
    def ttft_s(self) -> float:
        return self.chunk_s[0] if self.chunk_s else 0.0

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:], strict=False)]

    def token_event(self, now: float, text: str, n_token_ids: int = 0) -> None:
        self.chunk_s.append(now)
        self.generated_text += text
        self._token_ids += n_token_ids

    def finish(self) -> None:
        if not self.chunk_s:
            self.status, self.error = "failed", self.error or "stream ended before any token arrived"
            return
        self.status = "ok"
        if not self.output_tokens:
            self.output_tokens = self._token_ids or len(self.chunk_s)

    def answered(self, now: float) -> None:
        """A request answered whole, with no tokens (an embedding): its one event at ``now``."""
        self.chunk_s.append(now)
        self.latency_s, self.status = now, "ok"

    def fail(self, error: str) -> None:
        self.status, self.error = "failed", error


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After value: delta-seconds or an HTTP date."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


async def sse_lines(text: AsyncIterator[str]) -> AsyncIterator[str]:
    """An event stream's lines, ended where SSE ends them: at CRLF, CR or LF only. Not httpx's ``aiter_lines``,
    which also splits at the Unicode line breaks (U+2028, U+0085, ...) that JSON may leave raw in a string."""
    pending = ""
    async for chunk in text:
        pending += chunk
        held = "\r" if pending.endswith("\r") else ""  # maybe the first half of a CRLF: wait for the next chunk
        *lines, pending = _SSE_LINE_END.split(pending.removesuffix(held))
        pending += held
        for line in lines:
            yield line
    if pending:
        yield pending.removesuffix("\r")


async def sse_data(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """Each server-sent event's data (multi-line data joined with newlines); comments are skipped."""
    data: list[str] = []
    async for line in lines:
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        if name == "data":
            data.append(value.removeprefix(" "))
    if data:
        yield "\n".join(data)


def server_root(base_url: str) -> str:
    """``http://host:8000`` from ``http://host:8000/`` or ``http://host:8000/v1``."""
    return base_url.rstrip("/").removesuffix("/v1")


def first_model(base_url: str, api_key: str | None = None, timeout_s: float = 30.0) -> str:
    """The first model id of the server's ``GET /v1/models``, what ``vllm bench serve`` uses without --model."""
    url = server_root(base_url) + "/v1/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(url, headers=headers, timeout=timeout_s)
        response.raise_for_status()
        models = response.json().get("data") or []
        return models[0]["id"]
    except (httpx.HTTPError, httpx.InvalidURL, ValueError, AttributeError, IndexError, KeyError, TypeError) as e:
        raise ValueError(f"no --model given, and asking {url} for one failed ({type(e).__name__}: {e}); "
                         "is the server running there? Or pass --model NAME") from None


class OpenAIClient:
    """POSTs ``/v1/chat/completions`` (specs with messages) or ``/v1/completions`` with ``stream=true``, or
    each prompt to ``/v1/embeddings`` (``embeddings``: its answer is the request's one event)."""

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None, ignore_eos: bool = True,
                 temperature: float | None = 0.0, timeout_s: float = 6 * 3600,
                 max_connections: int | None = None, path: str | None = None, embeddings: bool = False):
        """``temperature`` None sends none (the server's default); ``path`` overrides the API path."""
        base = server_root(base_url)
        self.model, self.ignore_eos, self.temperature, self.path = model, ignore_eos, temperature, path
        self.embeddings = embeddings
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            base_url=base, timeout=httpx.Timeout(timeout_s),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    def _request(self, spec: RequestSpec) -> tuple[str, dict, dict]:
        body: dict = {"model": spec.model or self.model, "max_tokens": spec.max_tokens,
                      "stream": True, "stream_options": {"include_usage": True}}
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.ignore_eos:
            body["ignore_eos"] = True  # vLLM and Tidepool extension: always generate max_tokens
        headers = {**self._headers, "X-Request-Id": spec.request_id}
        if spec.messages is None:
            return self.path or "/v1/completions", {**body, "prompt": spec.prompt}, headers
        body["messages"] = spec.messages
        if spec.session_id:
            body["session_id"] = spec.session_id
            headers["X-Session-Id"] = spec.session_id
        return self.path or "/v1/chat/completions", body, headers

    async def send(self, spec: RequestSpec, rec: RequestRecord) -> RequestRecord:
        if self.embeddings:
            return await self._embed(spec, rec)
        path, body, headers = self._request(spec)
        rec.start_s = start = time.perf_counter()
        try:
            async with self._http.stream("POST", path, json=body, headers=headers) as resp:
                if resp.status_code != 200:
                    await _refused(resp, rec)
                    return rec
                async for data in sse_data(sse_lines(resp.aiter_text())):
                    if data.strip() == "[DONE]":
                        break
                    now = time.perf_counter() - start
                    rec.latency_s = now
                    self._on_event(json.loads(data), now, rec)
                    if rec.status == "failed":
                        return rec
        except (httpx.HTTPError, OSError, ValueError) as e:
            rec.fail(f"{type(e).__name__}: {e}")
            return rec
        rec.finish()
        return rec

    async def _embed(self, spec: RequestSpec, rec: RequestRecord) -> RequestRecord:
        """One prompt's embedding: its latency is the request's TTFT and E2EL, its usage the prompt's tokens."""
        body = {"model": spec.model or self.model, "input": spec.prompt}
        rec.start_s = start = time.perf_counter()
        try:
            resp = await self._http.post(self.path or "/v1/embeddings", json=body,
                                         headers={**self._headers, "X-Request-Id": spec.request_id})
            if resp.status_code != 200:
                await _refused(resp, rec)
                return rec
            usage = resp.json().get("usage") or {}
        except (httpx.HTTPError, OSError, ValueError) as e:
            rec.fail(f"{type(e).__name__}: {e}")
            return rec
        rec.answered(time.perf_counter() - start)
        rec.server_usage, rec.prompt_tokens = True, usage.get("prompt_tokens") or rec.prompt_tokens
        return rec

    @staticmethod
    def _on_event(event: dict, now: float, rec: RequestRecord) -> None:
        if "error" in event:  # an error reported mid-stream
            rec.fail(f"stream error: {json.dumps(event['error'])[:500]}")
            return
        if usage := event.get("usage"):
            rec.server_usage = True
            rec.output_tokens = usage.get("completion_tokens") or 0
            rec.prompt_tokens = usage.get("prompt_tokens") or rec.prompt_tokens
            rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        for choice in event.get("choices") or []:
            delta = choice.get("delta") or {}
            text = choice.get("text") or delta.get("content") or delta.get("reasoning_content") or ""
            token_ids = choice.get("token_ids") or []
            if text or token_ids or choice.get("finish_reason"):
                rec.token_event(now, text, len(token_ids))

    async def aclose(self) -> None:
        await self._http.aclose()


async def _refused(resp: httpx.Response, rec: RequestRecord) -> None:
    """A non-200 answer: the request failed, or was rejected (429) with the server's retry-after."""
    detail = (await resp.aread()).decode("utf-8", "replace")[:500]
    rec.fail(f"HTTP {resp.status_code}: {detail}")
    if resp.status_code == 429:
        rec.status = "rejected"
        rec.retry_after_s = parse_retry_after(resp.headers.get("retry-after"))


class GrpcClient:
    """Calls ``Serving.Chat`` (specs with messages) or ``Serving.Complete`` and reads the chunk stream."""

    def __init__(self, target: str, model: str, *, api_key: str | None = None, ignore_eos: bool = True,
                 temperature: float | None = 0.0, timeout_s: float = 6 * 3600):
        self.model, self.ignore_eos, self.temperature, self.timeout_s = model, ignore_eos, temperature, timeout_s
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._channel = grpc.aio.insecure_channel(target)
        self._stub = serving_pb2_grpc.ServingStub(self._channel)

    def _call(self, spec: RequestSpec):
        sampling = serving_pb2.SamplingOptions(max_tokens=spec.max_tokens, ignore_eos=self.ignore_eos)
        if self.temperature is not None:  # unset: the server's default, as over HTTP
            sampling.temperature = self.temperature
        metadata = (*self._metadata, ("x-request-id", spec.request_id))
        if spec.messages is None:
            request = serving_pb2.CompleteRequest(model=spec.model or self.model, prompt=spec.prompt,
                                                  sampling=sampling)
            return self._stub.Complete(request, timeout=self.timeout_s, metadata=metadata)
        request = serving_pb2.ChatRequest(
            model=spec.model or self.model, sampling=sampling, session_id=spec.session_id or "",
            messages=[serving_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in spec.messages])
        return self._stub.Chat(request, timeout=self.timeout_s, metadata=metadata)

    async def send(self, spec: RequestSpec, rec: RequestRecord) -> RequestRecord:
        rec.start_s = start = time.perf_counter()
        try:
            async for chunk in self._call(spec):
                now = time.perf_counter() - start
                rec.latency_s = now
                if chunk.HasField("usage"):
                    rec.server_usage = True
                    rec.output_tokens = chunk.usage.completion_tokens
                    rec.prompt_tokens = chunk.usage.prompt_tokens or rec.prompt_tokens
                    rec.cached_tokens = chunk.usage.cached_tokens
                if chunk.text or chunk.token_ids or chunk.finish_reason:
                    rec.token_event(now, chunk.text, len(chunk.token_ids))
        except grpc.aio.AioRpcError as e:
            rec.fail(f"gRPC {e.code().name}: {e.details()}")
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                rec.status = "rejected"
                trailers = dict(e.trailing_metadata() or ())
                rec.retry_after_s = parse_retry_after(trailers.get("retry-after"))
            return rec
        rec.finish()
        return rec

    async def aclose(self) -> None:
        await self._channel.close()
