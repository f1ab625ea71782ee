"""The gRPC API (`tidepool.v1.Serving`): Chat and Complete, server-streamed, plus health and reflection.

Same `Frontend` and the same error mapping as HTTP, so a request gets the same answer on either API.
A client that cancels its call cancels this handler; closing the `Generation` aborts the request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from engine.errors import InvalidRequestError
from engine.output import TokenLogprobs
from engine.structured_output import StructuredOutput
from services.config import GatewayConfig
from services.dispatcher import Dispatcher
from services.gateway import errors
from services.gateway.auth import check_bearer
from services.gateway.frontend import Frontend, Options
from services.gateway.generation import Delta, Generation
from services.gateway.grpc_chat import chat_request, fill_chunk, with_chat_fields
from services.gateway.protocol import ChatCompletionRequest
from services.gateway.responses import ResponseShape
from services.gateway.structured_outputs import StructuredOutputsParams, requested_output
from services.sessions import SessionStore
from tidepool.v1 import serving_pb2, serving_pb2_grpc

SERVICE_NAME = serving_pb2.DESCRIPTOR.services_by_name["Serving"].full_name
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def _options(s: serving_pb2.SamplingOptions) -> Options:
    """The request's sampling fields as `Options`; an unset optional field is the model's default (its
    generation_config.json) or else the engine's (the frontend's `SamplingParams.validate` checks each
    value, naming the field)."""
    def opt(name: str):
        return getattr(s, name) if s.HasField(name) else None

    return Options(max_tokens=opt("max_tokens"), temperature=opt("temperature"), top_p=opt("top_p"),
                   top_k=opt("top_k"), min_p=opt("min_p"), seed=opt("seed"), stop=list(s.stop), stop_token_ids=list(s.stop_token_ids),
                   n=s.n if s.HasField("n") else 1, ignore_eos=s.ignore_eos,
                   include_stop_str_in_output=s.include_stop_str_in_output,
                   allowed_token_ids=list(s.allowed_token_ids) or None, bad_words=list(s.bad_words),
                   skip_special_tokens=s.skip_special_tokens if s.HasField("skip_special_tokens") else True,
                   presence_penalty=opt("presence_penalty"), frequency_penalty=opt("frequency_penalty"),
                   repetition_penalty=opt("repetition_penalty"), logprobs=opt("logprobs"),
                   prompt_logprobs=opt("prompt_logprobs"),
                   logit_bias=sorted(s.logit_bias.items()), min_tokens=opt("min_tokens"),
                   priority=s.priority, cache_salt=opt("cache_salt"),
                   truncate_prompt_tokens=opt("truncate_prompt_tokens"),
                   structured_output=_structured_output(s.structured_output) if s.HasField("structured_output") else None)


async def _options_off_loop(s: serving_pb2.SamplingOptions, chat: ChatCompletionRequest | None = None,
                            tool_call_parser: str | None = None) -> Options:
    """`_options` (with a chat's own fields: `grpc_chat.with_chat_fields`) in a thread: a structured output's grammar, a
    forced call's too, compiles there (milliseconds for a large schema, the first time), which would stall
    every stream this event loop serves."""
    def build() -> Options:
        options = _options(s)
        return options if chat is None else with_chat_fields(options, chat, tool_call_parser)

    return await asyncio.to_thread(build)


def _structured_output(spec: serving_pb2.StructuredOutput) -> StructuredOutput:
    """As HTTP's ``structured_outputs`` (the same checks and messages)."""
    kind = spec.WhichOneof("kind")
    if kind is None:
        raise InvalidRequestError("structured_outputs", "set one of json_schema, regex, choice, grammar and "
                                                        "json_object")
    value = list(spec.choice.values) if kind == "choice" else getattr(spec, kind)
    fields = {{"json_schema": "json"}.get(kind, kind): value, "disable_any_whitespace": spec.disable_any_whitespace}
    return requested_output(None, StructuredOutputsParams.model_validate(fields))


def _token_logprobs(items: list[TokenLogprobs]) -> list[serving_pb2.TokenLogprob]:
    return [serving_pb2.TokenLogprob(token_id=it.token_id, logprob=it.logprob, rank=it.rank or 0,
                                     top=[serving_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in it.top])
            for it in items]


def _chunk(delta: Delta, request_id: str, prompt_logprobs: list[TokenLogprobs]) -> serving_pb2.GenerateChunk:
    """``prompt_logprobs``: the choice's prompt's, on its first chunk ([] on the others)."""
    return serving_pb2.GenerateChunk(index=delta.index, text=delta.text, token_ids=delta.token_ids,
                                     finish_reason=delta.finish_reason or "", request_id=request_id,
                                     logprobs=_token_logprobs(delta.logprobs or ()),
                                     prompt_logprobs=_token_logprobs(prompt_logprobs))


@dataclass(frozen=True)
class _Undecodable:
    """Request bytes that are not a valid message. The deserializer returns this instead of raising (grpc
    would answer UNKNOWN), and the handler answers INVALID_ARGUMENT."""

    error: str


def _lenient(message: type[Message]) -> Callable[[bytes], Message | _Undecodable]:
    def parse(data: bytes) -> Message | _Undecodable:
        try:
            return message.FromString(data)
        except DecodeError as exc:
            return _Undecodable(f"the request is not a valid {message.DESCRIPTOR.full_name}: {exc}")

    return parse


def add_serving(servicer: ServingServicer, server: grpc.aio.Server) -> None:
    """Register the Serving service as the generated ``add_ServingServicer_to_server`` does, with lenient
    request deserializers."""
    def handler(method, request: type[Message]) -> grpc.RpcMethodHandler:
        return grpc.unary_stream_rpc_method_handler(method, request_deserializer=_lenient(request),
                                                    response_serializer=serving_pb2.GenerateChunk.SerializeToString)

    handlers = {"Chat": handler(servicer.Chat, serving_pb2.ChatRequest),
                "Complete": handler(servicer.Complete, serving_pb2.CompleteRequest),
                "Embed": grpc.unary_unary_rpc_method_handler(
                    servicer.Embed, request_deserializer=_lenient(serving_pb2.EmbedRequest),
                    response_serializer=serving_pb2.EmbedResponse.SerializeToString)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def _refuse_undecodable(request: Message | _Undecodable) -> None:
    if isinstance(request, _Undecodable):
        raise errors.MalformedBodyError(request.error)


class ServingServicer(serving_pb2_grpc.ServingServicer):
    def __init__(self, frontend: Frontend, config: GatewayConfig, metrics) -> None:
        self.frontend, self.config, self.metrics = frontend, config, metrics

    async def Chat(self, request: serving_pb2.ChatRequest, context) -> AsyncIterator[serving_pb2.GenerateChunk]:
        async def start() -> tuple[Generation, ResponseShape | None]:
            _refuse_undecodable(request)
            chat = chat_request(request)
            parser = self.config.tool_call_parser
            options = await _options_off_loop(request.sampling, chat, parser)
            gen = await self.frontend.chat(request.model or self.frontend.model_id,
                                           [m.as_dict() for m in chat.messages], options, request.session_id or None)
            reader, reasoning = options.tool_call_reader(parser), self.config.reasoning_parser
            # Read as HTTP reads a chat answer when there is anything to split off it.
            shape = ResponseShape(gen, chat.model, chat=True, logprobs=None, tool_calls=reader,
                                  reasoning=reasoning) if reader or reasoning else None
            return gen, shape

        async for chunk in self._serve("Chat", start, context):
            yield chunk

    async def Complete(self, request: serving_pb2.CompleteRequest,
                       context) -> AsyncIterator[serving_pb2.GenerateChunk]:
        async def start() -> tuple[Generation, None]:
            _refuse_undecodable(request)
            prompt = list(request.prompt_token_ids) or request.prompt
            options = await _options_off_loop(request.sampling)
            options.add_special_tokens = not request.HasField("add_special_tokens") or request.add_special_tokens
            return await self.frontend.complete(request.model or self.frontend.model_id, [prompt], options), None

        async for chunk in self._serve("Complete", start, context):
            yield chunk

    async def Embed(self, request: serving_pb2.EmbedRequest, context) -> serving_pb2.EmbedResponse:
        try:
            check_bearer(dict(context.invocation_metadata()).get("authorization", ""), self.config.api_key)
            _refuse_undecodable(request)
            results = await self.frontend.embed(
                request.model or self.frontend.model_id, [list(i.token_ids) or i.text for i in request.inputs],
                request.dimensions if request.HasField("dimensions") else None,
                not request.HasField("add_special_tokens") or request.add_special_tokens)
        except Exception as exc:
            self.metrics.inc_request("grpc:Embed", errors.classify(exc).grpc_code.name)
            await errors.grpc_abort(context, exc)
        self.metrics.inc_request("grpc:Embed", grpc.StatusCode.OK.name)
        usage = serving_pb2.Usage(prompt_tokens=sum(r.num_prompt_tokens for r in results),
                                  cached_tokens=sum(r.num_cached_tokens for r in results))
        return serving_pb2.EmbedResponse(embeddings=[serving_pb2.Embedding(values=r.embedding) for r in results],
                                         usage=usage)

    async def _serve(self, method: str, start, context) -> AsyncIterator[serving_pb2.GenerateChunk]:
        gen = None
        try:
            check_bearer(dict(context.invocation_metadata()).get("authorization", ""), self.config.api_key)
            gen, shape = await start()
            # A cancel that lands while gRPC is sending abandons this generator without running its
            # `finally`, so the request is also stopped when the call ends, however it ends.
            context.add_done_callback(lambda _: gen.close())
            started: set[int] = set()  # choices whose first chunk was sent
            async for d in gen:
                chunk = _chunk(d, gen.request_id, [] if d.index in started else gen.prompt_logprobs_of(d.index))
                started.add(d.index)
                if shape is not None:
                    fill_chunk(chunk, shape.delta(d))
                if gen.finished:  # the delta that ends the last open choice carries the usage
                    u = gen.usage
                    chunk.usage.CopyFrom(serving_pb2.Usage(prompt_tokens=u.prompt_tokens,
                                                           completion_tokens=u.completion_tokens,
                                                           cached_tokens=u.cached_tokens,
                                                           accepted_prediction_tokens=u.accepted_prediction_tokens,
                                                           rejected_prediction_tokens=u.rejected_prediction_tokens))
                yield chunk
            self.metrics.inc_request(f"grpc:{method}", grpc.StatusCode.OK.name)
        except Exception as exc:
            err = errors.classify(exc)
            self.metrics.inc_request(f"grpc:{method}", err.grpc_code.name)
            await errors.grpc_abort(context, exc)
        finally:
            if gen is not None:
                gen.close()


class _Health(health.aio.HealthServicer):
    """Standard health service; SERVING while every role (prefill, decode) has a live worker, NOT_SERVING
    while one has none, e.g. until a dead worker's replacement serves (checked on each call)."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        super().__init__()
        self.dispatcher = dispatcher

    def _status(self) -> int:
        return (health_pb2.HealthCheckResponse.NOT_SERVING if self.dispatcher.missing_roles()
                else health_pb2.HealthCheckResponse.SERVING)

    async def Check(self, request, context):
        status = self._status()
        for service in ("", SERVICE_NAME):
            await self.set(service, status)
        return await super().Check(request, context)

    async def List(self, request, context) -> health_pb2.HealthListResponse:
        """Every service this server reports on, with its status (the base class leaves List out)."""
        status = health_pb2.HealthCheckResponse(status=self._status())
        return health_pb2.HealthListResponse(statuses={"": status, SERVICE_NAME: status})


def _enable_reflection(server: grpc.aio.Server, service_names: tuple[str, ...]) -> None:
    """Server reflection under both v1alpha and v1 (what grpcurl and current clients ask for first).

    grpcio-reflection implements only v1alpha; v1 has the same messages in a renamed package, so the
    same servicer answers it with the same bytes.
    """
    servicer = reflection.aio.ReflectionServicer((*service_names, reflection.SERVICE_NAME, REFLECTION_V1))
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo, request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(REFLECTION_V1,
                                                                          {"ServerReflectionInfo": v1}),))


async def start_grpc_server(dispatcher: Dispatcher, sessions: SessionStore | None,
                            config: GatewayConfig) -> grpc.aio.Server:
    """Start the gRPC gateway on the configured host and port (``await server.stop(grace)`` ends it)."""
    server = grpc.aio.server()
    frontend = Frontend(dispatcher, sessions, config)
    add_serving(ServingServicer(frontend, config, dispatcher.metrics), server)
    health_pb2_grpc.add_HealthServicer_to_server(_Health(dispatcher), server)
    _enable_reflection(server, (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name))
    address = f"{config.host}:{config.grpc_port}"
    if server.add_insecure_port(address) == 0:
        raise OSError(f"gRPC gateway cannot listen on {address}")
    await server.start()
    return server
