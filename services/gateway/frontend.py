"""What the HTTP and gRPC APIs share: model check, prompt building, limits, sessions, sampling defaults.

Each API parses its own wire format into `Options` and messages, then calls `chat` or `complete`, which
return a started `Generation` (up-front rejections have been raised by then). Prompt text is measured
before it is tokenized (text that cannot fit the token limit is refused unread), and templating and
tokenizing run in a worker thread, so a long prompt never stalls the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Literal

from engine.errors import InvalidRequestError
from engine.generation_defaults import GenerationDefaults
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutput
from engine.tokenizer import Tokenizer
from services.config import GatewayConfig
from services.dispatcher import Dispatcher, GenerateRequest
from services.errors import PromptTooLongError
from services.gateway.chat_prompt import encode_chat
from services.gateway.errors import NotFoundError, PromptTextTooLongError
from services.gateway.generation import Echo, Generation, merge_streams
from services.gateway.reasoning import END_THINK, THINK, after_thinking
from services.gateway.request_body import refuse
from services.gateway.token_texts import TokenTexts
from services.gateway.tool_calls import ToolCallParser, call_parser
from services.messages import EmbeddingResult, SessionSequence, TokenEvent
from services.sessions import SessionStore, SessionTurn

log = logging.getLogger(__name__)

# OpenAI's legacy completions API defaults to 16 tokens; chat defaults to the rest of the context.
COMPLETION_DEFAULT_MAX_TOKENS = 16
# No token of a real vocabulary averages this many characters over a whole prompt, so longer text cannot
# fit the token limit and is refused without tokenizing it.
MAX_CHARS_PER_TOKEN = 64
MAX_PROMPTS = 256  # prompts in one completions request (each is a request of its own to the cluster)
MAX_EMBEDDING_INPUTS = 2048  # inputs in one embeddings request (OpenAI's limit)
CHAT_ROLES = ("system", "developer", "user", "assistant")  # what the chat templates render ("tool" with tools on)
_OPTIONAL = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "logprobs", "prompt_logprobs", "min_tokens")


PRIORITY_LIMIT = 2**31 - 1  # a request's priority: an int32, as vLLM's and the gRPC field's


@dataclass
class Options:
    """A request's sampling fields and prompt options, as the APIs name them; None means the engine's default."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    allowed_token_ids: list[int] | None = None  # None: any token
    bad_words: list[str] = field(default_factory=list)  # words a choice never completes (vLLM's)
    n: int = 1
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    min_tokens: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logprobs: int | None = None  # None: none; k: the sampled token's and the k most likely
    logit_bias: list[tuple[int, float]] = field(default_factory=list)
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's (after the first) and the k most likely
    echo: bool = False  # completions: each choice's text (and logprobs) starts with its prompt's
    echo_only: bool = False  # ... and holds nothing else: the one token computed is not returned
    # Completions: a text prompt gets the tokenizer's special tokens (its post-processor's BOS, say), as
    # transformers' and vLLM's do; a chat's come from its template.
    add_special_tokens: bool = True
    # Chat: the template's variables beyond the messages (vLLM's chat_template_kwargs, and the tools shown)
    chat_template_kwargs: dict = field(default_factory=dict)
    # Chat: how the prompt ends (vLLM's): with the assistant turn's opening, or (both false) after the last
    # message, or inside it: the answer continues the final (assistant) message's text
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict] | None = None  # chat: the functions the model is shown, and whose calls are read back
    # chat with tools: "auto" (the model may call), "required" (it writes a list of calls) or "named" (it writes
    # the arguments of ``tool_name``)
    tool_choice: Literal["auto", "required", "named"] = "auto"
    tool_name: str | None = None
    parallel_tool_calls: bool = True  # False: an answer holds at most one call
    priority: int = 0  # lower is served first among waiting prompts (vLLM's)
    structured_output: StructuredOutput | None = None  # what the output keeps to (checked already); None: free
    prediction: str | None = None  # chat: the text the answer is expected to mostly repeat (OpenAI's Predicted Outputs)
    cache_salt: str | None = None  # only requests with the same salt share cached prefixes (vLLM's)
    # vLLM's: only the prompt's last k tokens are kept (-1: as many as fit before max_tokens); None: all of them
    truncate_prompt_tokens: int | None = None

    def tool_call_reader(self, parser: str | None) -> Callable[[], ToolCallParser] | None:
        """How the answers are read for tool calls with the server's ``parser`` (None: no tools asked)."""
        if not self.tools:
            return None
        return call_parser(parser, self.tools, self.tool_choice, self.tool_name, self.parallel_tool_calls)

    def sampling_params(self, default_max_tokens: int, defaults: GenerationDefaults,
                        bad_words_token_ids: list[list[int]] | None = None,
                        prediction_ids: list[int] | None = None) -> SamplingParams:
        """``defaults``: the model's, for the sampling fields left unset (and a cap on ``default_max_tokens``);
        ``bad_words_token_ids``: ``bad_words`` encoded (``bad_word_sequences``); ``prediction_ids``: the
        prediction encoded."""
        given = {name: getattr(self, name) for name in _OPTIONAL}
        if self.max_tokens is None:
            max_tokens = min(default_max_tokens, defaults.max_tokens or default_max_tokens)
        else:
            max_tokens = self.max_tokens
        params = SamplingParams(max_tokens=max_tokens, stop=list(self.stop), stop_token_ids=list(self.stop_token_ids),
                                n=self.n, ignore_eos=self.ignore_eos, logit_bias=list(self.logit_bias),
                                include_stop_str_in_output=self.include_stop_str_in_output,
                                allowed_token_ids=self.allowed_token_ids,
                                bad_words_token_ids=list(bad_words_token_ids or []),
                                skip_special_tokens=self.skip_special_tokens,
                                structured_output=self.structured_output, prediction_ids=list(prediction_ids or []),
                                cache_salt=self.cache_salt, **defaults.apply(given))
        params.validate()
        return params


def bad_word_sequences(tokenizer: Tokenizer, words: list[str]) -> list[list[int]]:
    """Each bad word's tokens, as vLLM encodes them: the word (left-stripped), and after a space where that
    spells the word as another token of the same length (a word-initial piece, for BPE vocabularies)."""
    sequences: list[list[int]] = []
    for word in words:
        if not word.strip():
            raise InvalidRequestError("bad_words", "a bad word must not be blank")
        bare = tokenizer.encode(word.lstrip())
        spaced = tokenizer.encode(" " + word.lstrip())
        sequences.append(bare)
        if spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences.append(spaced)
    return sequences


class Frontend:
    def __init__(self, dispatcher: Dispatcher, sessions: SessionStore | None, config: GatewayConfig) -> None:
        self.dispatcher = dispatcher
        self.sessions = sessions
        self.max_prompt_tokens = config.max_prompt_tokens
        self.max_n = config.max_n
        self.tool_calls = config.tool_call_parser is not None
        self.token_texts = TokenTexts(dispatcher.tokenizer)
        # With a reasoning parser, a structured output waits for the end of the thinking block (after_thinking).
        tokenizer = dispatcher.tokenizer
        self.thinking_tags = None if config.reasoning_parser is None else (tokenizer.encode(THINK),
                                                                         tokenizer.encode(END_THINK))

    @property
    def model_id(self) -> str:
        """The model's name in the APIs (the first --served-model-name)."""
        return self.dispatcher.served_model_names[0]

    @property
    def prompt_token_limit(self) -> int:
        """The most prompt tokens a request may have (one token must fit after the prompt)."""
        limit = self.dispatcher.max_model_len - 1
        return limit if self.max_prompt_tokens is None else min(limit, self.max_prompt_tokens)

    def check_model(self, model: str) -> str | None:
        """The LoRA adapter ``model`` names (None: the base model); NotFoundError for a model not served."""
        if model in self.dispatcher.served_model_names:
            return None
        if model in self.dispatcher.loras:
            return model
        raise NotFoundError("model", model, "model")

    async def chat(self, model: str, messages: list[dict], options: Options, session_id: str | None = None,
                   continued: SessionSequence | None = None) -> Generation:
        """Start a chat turn; with a session, ``messages`` are appended to the stored history. ``continued``
        (without a session): the earlier turn whose reply is the last assistant message of ``messages``, as
        token ids, kept where they still fit (``encode_chat``). The generation's ``prompt_ids`` are the turn's.

        A session's turns run one at a time (SessionBusyError while another runs): the turn holds the
        session from before its history is read until the reply is stored, or the turn fails or is cancelled.
        """
        lora = self.check_model(model)
        _check_roles(messages, self.tool_calls)
        if options.tools and session_id:
            raise InvalidRequestError("tools", "tools with a session are not supported: send the whole conversation "
                                               "without session_id")
        history: list[dict] = []
        turn: SessionTurn | None = None
        if session_id:
            if self.sessions is None:
                raise InvalidRequestError("session_id", "sessions are not enabled on this server")
            turn = await self.sessions.begin_turn(session_id, messages)
        try:
            previous = continued
            if turn is not None:
                history, previous = await asyncio.gather(self.sessions.history(session_id),
                                                         self.sessions.last_sequence(session_id))
            if not history and not messages:
                raise InvalidRequestError("messages", "at least one message is required")
            self._check_text_size(sum(len(m["content"]) for m in history + messages))
            prompt_ids = self._truncated(await asyncio.to_thread(
                encode_chat, self.token_texts, history + messages, previous, options.chat_template_kwargs,
                options.add_generation_prompt, options.continue_final_message), options)
            if turn is not None:
                turn.prompt_ids = prompt_ids
            if options.structured_output is not None and self.thinking_tags is not None:
                options = dataclasses.replace(options, structured_output=after_thinking(
                    options.structured_output, prompt_ids, *self.thinking_tags))
            return await self._start("chatcmpl", [prompt_ids], options, "messages", None, turn, lora=lora)
        except BaseException:
            if turn is not None:  # once the turn's events run, they release it themselves; twice is harmless
                await turn.release()
            raise

    async def complete(self, model: str, prompts: list[str | list[int]], options: Options) -> Generation:
        """Start a completion of each prompt (text or token ids); choice ``i * n + j`` is prompt i's j-th."""
        lora = self.check_model(model)
        if not prompts:
            raise InvalidRequestError("prompt", "at least one prompt is required")
        if len(prompts) > MAX_PROMPTS:
            raise InvalidRequestError("prompt", f"at most {MAX_PROMPTS} prompts in one request")
        encoded = [await self._encoded(p, options.add_special_tokens, options) for p in prompts]
        prompt_ids = [ids for ids, _ in encoded]
        echo = None
        if options.echo:  # a text prompt is echoed as sent; one sent as token ids, or cut, as its tokens' text
            texts = [p if isinstance(p, str) and whole else await self.detokenize(ids)
                     for p, (ids, whole) in zip(prompts, encoded, strict=True)]
            echo = Echo(texts, prompt_ids, output=not options.echo_only)
        return await self._start("cmpl", prompt_ids, options, "prompt", COMPLETION_DEFAULT_MAX_TOKENS, None, echo,
                                 lora)

    async def embed(self, model: str, inputs: list[str | list[int]], dimensions: int | None,
                    add_special_tokens: bool) -> list[EmbeddingResult]:
        """Each input's embedding, in order (``Dispatcher.embed``: each a request of its own to the cluster, all at
        once); the first that fails cancels the rest."""
        if self.check_model(model) is not None:
            raise InvalidRequestError("model", "embeddings run with the base model only, not a LoRA adapter")
        if not inputs:
            raise InvalidRequestError("input", "at least one input is required")
        if len(inputs) > MAX_EMBEDDING_INPUTS:
            raise InvalidRequestError("input", f"at most {MAX_EMBEDDING_INPUTS} inputs in one request")
        self.dispatcher.pooling.check(dimensions, self.dispatcher.hidden_size)  # before any input is tokenized
        prompts = [(await self._encoded(text, add_special_tokens, None, "input"))[0] for text in inputs]
        if longest := max((ids for ids in prompts if len(ids) > self.prompt_token_limit), key=len, default=None):
            raise PromptTooLongError(len(longest), self.prompt_token_limit)
        request_id = f"embd-{uuid.uuid4().hex}"
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self.dispatcher.embed(f"{request_id}-{i}", ids, dimensions))
                         for i, ids in enumerate(prompts)]
        except ExceptionGroup as failed:  # the first failure is the request's (the rest were cancelled by it)
            raise failed.exceptions[0] from None
        return [task.result() for task in tasks]

    async def prompt_ids(self, prompt: str | list[int], add_special_tokens: bool) -> list[int]:
        """A completion prompt's token ids, whole (for ``/tokenize``; see ``_encoded``)."""
        return (await self._encoded(prompt, add_special_tokens, None))[0]

    async def _encoded(self, prompt: str | list[int], add_special_tokens: bool, options: Options | None,
                       field_name: str = "prompt") -> tuple[list[int], bool]:
        """(A completion prompt's token ids, whether they are all of them): text encoded (``add_special_tokens``:
        with the tokenizer's special tokens), cut as ``options`` ask (``truncate_prompt_tokens``; None: whole),
        ids checked; errors name the request's ``field_name``."""
        tokenizer = self.dispatcher.tokenizer
        if isinstance(prompt, str):
            self._check_text_size(len(prompt))
            whole = await asyncio.to_thread(tokenizer.encode, prompt, add_special_tokens)
        else:
            whole = list(prompt)
        prompt_ids = whole if options is None else self._truncated(whole, options)
        if not isinstance(prompt, str):
            if len(prompt_ids) > self.prompt_token_limit:  # before the scan of every id
                raise PromptTooLongError(len(prompt_ids), self.prompt_token_limit)
            if not all(0 <= t < tokenizer.vocab_size for t in prompt_ids):
                raise InvalidRequestError(field_name, f"token ids must be in [0, {tokenizer.vocab_size})")
        if not prompt_ids:
            raise InvalidRequestError(field_name, f"the {field_name} is empty")
        return prompt_ids, len(prompt_ids) == len(whole)

    async def chat_prompt_ids(self, messages: list[dict], template_kwargs: dict, add_generation_prompt: bool = True,
                              continue_final_message: bool = False) -> list[int]:
        """A stateless chat's prompt token ids, as ``chat`` computes them (for ``/tokenize``)."""
        _check_roles(messages, self.tool_calls)
        if not messages:
            raise InvalidRequestError("messages", "at least one message is required")
        self._check_text_size(sum(len(m["content"]) for m in messages))
        return await asyncio.to_thread(encode_chat, self.token_texts, messages, None, template_kwargs,
                                       add_generation_prompt, continue_final_message)

    async def detokenize(self, token_ids: list[int]) -> str:
        """The text of ``token_ids``, special tokens spelled out (for ``/detokenize``)."""
        tokenizer = self.dispatcher.tokenizer
        if not all(0 <= t < tokenizer.vocab_size for t in token_ids):
            raise InvalidRequestError("tokens", f"token ids must be in [0, {tokenizer.vocab_size})")
        return await asyncio.to_thread(tokenizer.decode, token_ids, skip_special_tokens=False)

    def _truncated(self, prompt_ids: list[int], options: Options) -> list[int]:
        """The prompt's last ``options.truncate_prompt_tokens`` tokens (vLLM's; -1: as many as fit before
        ``max_tokens``, or the most a prompt may have when it is not given); all of them without it."""
        keep = options.truncate_prompt_tokens
        if keep is None:
            return prompt_ids
        limit = self.prompt_token_limit
        if keep == -1:
            room = limit if options.max_tokens is None else self.dispatcher.max_model_len - options.max_tokens
            keep = max(1, min(limit, room))  # (a max_tokens that leaves no room is refused with its own error)
        elif not 1 <= keep <= limit:
            raise InvalidRequestError("truncate_prompt_tokens", f"must be -1 or in [1, {limit}] (the most prompt "
                                                                f"tokens this server takes), got {keep}")
        return prompt_ids[-keep:]

    def _check_text_size(self, chars: int) -> None:
        limit = self.prompt_token_limit
        if chars > limit * MAX_CHARS_PER_TOKEN:
            raise PromptTextTooLongError(chars, limit * MAX_CHARS_PER_TOKEN, limit)

    async def _prediction_ids(self, prediction: str | None) -> list[int] | None:
        """A chat's predicted text encoded (None: none given). Its tokens are drafts, which only a server that
        speculates verifies; text longer than the context could hold is refused unread."""
        if prediction is None:
            return None
        if not self.dispatcher.speculates:
            raise refuse("prediction", "predicted outputs are drafts for speculative decoding, which this server "
                                       "does not run (start it with --num-speculative-tokens K)")
        most = self.dispatcher.max_model_len * MAX_CHARS_PER_TOKEN
        if len(prediction) > most:
            raise InvalidRequestError("prediction", f"{len(prediction)} characters cannot fit the model's "
                                                    f"{self.dispatcher.max_model_len}-token context")
        return await asyncio.to_thread(self.dispatcher.tokenizer.encode, prediction, False)

    def _sampling_params(self, prompt_ids: list[int], options: Options, prompt_field: str,
                         default_max_tokens: int | None, bad_words_token_ids: list[list[int]],
                         prediction_ids: list[int] | None) -> SamplingParams:
        limit = self.dispatcher.max_model_len
        if self.max_prompt_tokens is not None and len(prompt_ids) > self.max_prompt_tokens:
            raise PromptTooLongError(len(prompt_ids), self.max_prompt_tokens)
        if len(prompt_ids) >= limit:  # at least one token must fit after the prompt
            raise PromptTooLongError(len(prompt_ids), limit - 1)
        room = limit - len(prompt_ids)
        params = options.sampling_params(min(default_max_tokens or room, room), self.dispatcher.generation_defaults,
                                         bad_words_token_ids, prediction_ids)
        if params.max_tokens > room:
            raise InvalidRequestError("max_tokens", f"{params.max_tokens} tokens don't fit after the "
                                      f"{len(prompt_ids)}-token {prompt_field}: the context is {limit} tokens")
        return params

    async def _start(self, id_prefix: str, prompts: list[list[int]], options: Options, prompt_field: str,
                     default_max_tokens: int | None, turn: SessionTurn | None, echo: Echo | None = None,
                     lora: str | None = None) -> Generation:
        """``lora``: the LoRA adapter the prompts run with (None: the base model)."""
        if options.n > self.max_n:
            raise InvalidRequestError("n", f"must be at most {self.max_n} on this server, got {options.n}")
        if not -PRIORITY_LIMIT <= options.priority <= PRIORITY_LIMIT:
            raise InvalidRequestError("priority", f"must be in [{-PRIORITY_LIMIT}, {PRIORITY_LIMIT}], got "
                                                  f"{options.priority}")
        vocab = self.dispatcher.tokenizer.vocab_size
        for name, ids in (("logit_bias", [t for t, _ in options.logit_bias]), ("stop_token_ids", options.stop_token_ids),
                          ("allowed_token_ids", options.allowed_token_ids or [])):
            if any(not 0 <= token < vocab for token in ids):
                raise InvalidRequestError(name, f"token ids must be in [0, {vocab})")
        # Every prompt is checked before any starts.
        bad_words = bad_word_sequences(self.dispatcher.tokenizer, options.bad_words)
        prediction_ids = await self._prediction_ids(options.prediction)
        params = [self._sampling_params(ids, options, prompt_field, default_max_tokens, bad_words, prediction_ids)
                  for ids in prompts]
        request_id = f"{id_prefix}-{uuid.uuid4().hex}"
        if len(prompts) == 1:
            events = self.dispatcher.generate(GenerateRequest(request_id, prompts[0], params[0], options.priority,
                                                              lora))
        else:
            events = merge_streams([
                _shifted(self.dispatcher.generate(GenerateRequest(f"{request_id}-p{i}", ids, p, options.priority,
                                                                  lora)), i * options.n)
                for i, (ids, p) in enumerate(zip(prompts, params, strict=True))])
        if turn is not None:
            events = turn.run(events, options.n)
        gen = Generation(request_id, events, options.n * len(prompts), choices_per_prompt=options.n, echo=echo,
                         predicted=prediction_ids is not None, prompts=prompts)
        try:
            await gen.start()
        except BaseException:
            gen.close()
            raise
        return gen


def _check_roles(messages: list[dict], tools: bool) -> None:
    """``tools``: tool calling is on, and the templates render tool messages too."""
    roles = CHAT_ROLES + ("tool",) if tools else CHAT_ROLES
    for i, message in enumerate(messages):  # HTTP's schema checks this too; gRPC's strings are free
        if message["role"] not in roles:
            raise InvalidRequestError(f"messages.{i}.role", f"{message['role']!r} is not one of {', '.join(roles)}")


async def _shifted(events: AsyncIterator[TokenEvent], offset: int) -> AsyncIterator[TokenEvent]:
    """A prompt's events with choice indices moved past the earlier prompts' choices."""
    async with contextlib.aclosing(events):
        async for event in events:
            yield dataclasses.replace(event, index=event.index + offset)
