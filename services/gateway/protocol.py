"""OpenAI request bodies as pydantic models (they also make the OpenAPI schema).

Only types are checked here; value ranges are `SamplingParams.validate`'s job, so HTTP and gRPC reject the
same values with the same field names. Fields we don't use (user, metadata, ...) are accepted and ignored,
as OpenAI clients send them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from services.gateway.frontend import Options


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def as_dict(self) -> dict:
        """The message as the chat template and the session store take it (content parts joined)."""
        content = self.content if isinstance(self.content, str | None) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": content or ""}


class _SamplingBody(_Body):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, description="Sample from the k most likely tokens (0: off). Extension.")
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, description="Token ids that end a choice. Extension.")
    seed: int | None = None
    ignore_eos: bool = Field(False, description="Keep generating past end-of-sequence tokens. Extension.")
    stream: bool = False
    stream_options: StreamOptions | None = None

    def options(self, max_tokens: int | None = None) -> Options:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return Options(max_tokens=max_tokens if max_tokens is not None else self.max_tokens,
                       temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
                       stop=stop, stop_token_ids=list(self.stop_token_ids or []), n=self.n,
                       ignore_eos=self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingBody):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, description="Replaces max_tokens (OpenAI's newer name).")
    session_id: str | None = Field(None, description="Keep the conversation server-side (also header "
                                                     "X-Session-Id): send only the new messages. Extension.")

    def chat_options(self) -> Options:
        return self.options(self.max_completion_tokens)


class CompletionRequest(_SamplingBody):
    prompt: str | list[int] = Field(..., description="Text, or token ids.")
