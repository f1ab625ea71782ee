"""What the HTTP and gRPC APIs share: model check, prompt building, limits, sessions, sampling defaults.

Each API parses its own wire format into `Options` and messages, then calls `chat` or `complete`, which
return a started `Generation` (up-front rejections have been raised by then).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from services.dispatcher import Dispatcher, GenerateRequest
from services.errors import PromptTooLongError
from services.gateway.errors import NotFoundError
from services.gateway.generation import Generation
from services.sessions import SessionStore

log = logging.getLogger(__name__)

# OpenAI's legacy completions API defaults to 16 tokens; chat defaults to the rest of the context.
COMPLETION_DEFAULT_MAX_TOKENS = 16


@dataclass
class Options:
    """Sampling fields as the APIs name them; None means the engine's default."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    n: int = 1
    ignore_eos: bool = False

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        given = {k: v for k, v in (("temperature", self.temperature), ("top_p", self.top_p),
                                   ("top_k", self.top_k), ("seed", self.seed)) if v is not None}
        params = SamplingParams(max_tokens=default_max_tokens if self.max_tokens is None else self.max_tokens,
                                stop=list(self.stop), stop_token_ids=list(self.stop_token_ids), n=self.n,
                                ignore_eos=self.ignore_eos, **given)
        params.validate()
        return params


class Frontend:
    def __init__(self, dispatcher: Dispatcher, sessions: SessionStore | None,
                 max_prompt_tokens: int | None = None) -> None:
        self.dispatcher = dispatcher
        self.sessions = sessions
        self.max_prompt_tokens = max_prompt_tokens

    @property
    def model_id(self) -> str:
        return self.dispatcher.model_id

    def check_model(self, model: str) -> None:
        if model != self.model_id:
            raise NotFoundError("model", model, "model")

    async def chat(self, model: str, messages: list[dict], options: Options,
                   session_id: str | None = None) -> Generation:
        """Start a chat turn; with a session, ``messages`` are appended to the stored history."""
        self.check_model(model)
        history: list[dict] = []
        if session_id:
            if self.sessions is None:
                raise InvalidRequestError("session_id", "sessions are not enabled on this server")
            history = await self.sessions.history(session_id)
        if not history and not messages:
            raise InvalidRequestError("messages", "at least one message is required")
        text = self.dispatcher.tokenizer.apply_chat_template(history + messages, add_generation_prompt=True)
        prompt_ids = self.dispatcher.tokenizer.encode(text)
        on_complete = None
        if session_id:
            async def on_complete(gen: Generation) -> None:
                reply = {"role": "assistant", "content": gen.texts[0]}
                await self.sessions.append(session_id, messages + [reply])
        return await self._start("chatcmpl", prompt_ids, options, "messages", None, on_complete)

    async def complete(self, model: str, prompt: str | list[int], options: Options) -> Generation:
        self.check_model(model)
        tokenizer = self.dispatcher.tokenizer
        prompt_ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not prompt_ids:
            raise InvalidRequestError("prompt", "the prompt is empty")
        if not all(0 <= t < tokenizer.vocab_size for t in prompt_ids):
            raise InvalidRequestError("prompt", f"token ids must be in [0, {tokenizer.vocab_size})")
        return await self._start("cmpl", prompt_ids, options, "prompt", COMPLETION_DEFAULT_MAX_TOKENS, None)

    async def _start(self, id_prefix: str, prompt_ids: list[int], options: Options, prompt_field: str,
                     default_max_tokens: int | None, on_complete) -> Generation:
        limit = self.dispatcher.max_model_len
        if self.max_prompt_tokens is not None and len(prompt_ids) > self.max_prompt_tokens:
            raise PromptTooLongError(len(prompt_ids), self.max_prompt_tokens)
        if len(prompt_ids) >= limit:  # at least one token must fit after the prompt
            raise PromptTooLongError(len(prompt_ids), limit - 1)
        room = limit - len(prompt_ids)
        params = options.sampling_params(min(default_max_tokens or room, room))
        if params.max_tokens > room:
            raise InvalidRequestError("max_tokens", f"{params.max_tokens} tokens don't fit after the "
                                      f"{len(prompt_ids)}-token {prompt_field}: the context is {limit} tokens")
        request_id = f"{id_prefix}-{uuid.uuid4().hex}"
        events = self.dispatcher.generate(GenerateRequest(request_id, prompt_ids, params))
        gen = Generation(request_id, events, params.n, on_complete)
        try:
            await gen.start()
        except BaseException:
            gen.close()
            raise
        return gen
