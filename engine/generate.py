"""``tidepool generate``: offline generation with the engine in this process.

Every prompt goes through the scheduler together (continuous batching), so this is also the quickest
way to check the engine against a reference. With ``--json`` it prints one object per prompt, one per
line: ``{"prompt_ids": [...], "token_ids": [...], "text": "..."}``; with ``--n`` > 1 the object also
has ``"samples": [{"token_ids", "text"}, ...]`` (the top-level fields are sample 0). Keep this stable.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine.config import QUANTIZATION_METHODS, EngineConfig
from engine.engine import Engine
from engine.errors import InvalidRequestError
from engine.kv_format import FORMATS, RESIDUAL_HELP
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutput

_ADAPTER = "adapter"  # what --lora's adapter is called in the engine


def _ids(value: str) -> list[int]:
    try:
        return [int(t) for t in value.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids takes comma-separated integers, got {value!r}") from None


def _text(value: str) -> str:
    """An option's text, or with ``@FILE`` the file's."""
    return Path(value[1:]).read_text() if value.startswith("@") else value


def _structured_output(args: argparse.Namespace) -> StructuredOutput | None:
    """The --json-schema / --regex / --choice / --grammar spec (``@FILE`` reads the file); None without one."""
    if args.json_schema is not None:
        return StructuredOutput("json", _text(args.json_schema))
    if args.regex is not None:
        return StructuredOutput("regex", args.regex)
    if args.choice:
        return StructuredOutput("choice", json.dumps(args.choice))
    return None if args.grammar is None else StructuredOutput("grammar", _text(args.grammar))


def add_generate_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="generate text offline with the engine in this process",
                              description="Generate from one or more prompts with the engine in this process "
                                          "(no cluster): the reference check against other engines.")
    p.add_argument("--model", default="tiny", help="'tiny' (built-in) or a Hugging Face checkpoint directory")
    prompts = p.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    prompts.add_argument("--prompt-ids", action="append", type=_ids, help="prompt token ids 1,2,3 (repeatable)")
    p.add_argument("--max-tokens", type=int, default=16, help="new tokens per sample")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens; 0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set with this mass")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="never draw a token less likely than this share of the most likely one; 0 = off")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling (default: random)")
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence tokens")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weights and KV cache dtype")
    p.add_argument("--quantization", default=None, choices=QUANTIZATION_METHODS,
                   help="fp8 or w8a8_int8: quantize a 16-bit checkpoint's projections as it loads (as tidepool "
                        "serve does)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=FORMATS,
                   help="KV cache format: auto (the --dtype), int8, fp8 or kivi2 (2-bit)")
    p.add_argument("--kv-residual-blocks", type=int, default=None, metavar="N", help=RESIDUAL_HELP)
    p.add_argument("--kv-window", type=int, default=None, metavar="TOKENS",
                   help="attention window: each token attends to the last TOKENS tokens and the --kv-sinks first "
                        "ones, so prompt + output may outgrow the model's context (default: full attention)")
    p.add_argument("--kv-sinks", type=int, default=0, metavar="N",
                   help="leading tokens every token attends to with --kv-window (attention sinks)")
    kept = p.add_mutually_exclusive_group()
    kept.add_argument("--json-schema", metavar="SCHEMA", help="keep each sample to this JSON Schema (its text, or "
                                                              "@FILE)")
    kept.add_argument("--regex", help="keep each sample to this regular expression (matched whole)")
    kept.add_argument("--choice", action="append", help="each sample is one of these strings (repeatable)")
    kept.add_argument("--grammar", metavar="GRAMMAR", help="keep each sample to this Lark or GBNF grammar (its "
                                                           "text, or @FILE)")
    p.add_argument("--tokenizer", metavar="DIR", default=None,
                   help="the model's tokenizer from DIR, for a checkpoint whose directory has none")
    p.add_argument("--num-speculative-tokens", type=int, default=0, metavar="K",
                   help="speculative decoding by n-gram prompt lookup, up to K draft tokens a step (0: off)")
    p.add_argument("--speculative-model", metavar="DIR", default=None,
                   help="with --num-speculative-tokens: draft with this smaller checkpoint of the same vocabulary")
    p.add_argument("--prediction", metavar="TEXT", default=None,
                   help="with --num-speculative-tokens: text each sample is expected to mostly repeat (OpenAI's "
                        "predicted output; @FILE reads the file), drafted from first; the samples do not change")
    p.add_argument("--lora", metavar="DIR", default=None,
                   help="run every prompt with the PEFT LoRA adapter in DIR (adapter_config.json and "
                        "adapter_model.safetensors), as tidepool serve --lora-modules serves it")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu, cuda, cuda:1")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    try:
        engine = Engine(EngineConfig(model=args.model, tokenizer=args.tokenizer, dtype=args.dtype, device=args.device,
                                     quantization=args.quantization,
                                     kv_cache_dtype=args.kv_cache_dtype,
                                     kv_residual_blocks=args.kv_residual_blocks, kv_window=args.kv_window,
                                     kv_sinks=args.kv_sinks, num_speculative_tokens=args.num_speculative_tokens,
                                     speculative_model=args.speculative_model,
                                     lora_modules={} if args.lora is None else {_ADAPTER: args.lora}))
    except ValueError as err:  # options that contradict each other or the model (or the adapter)
        print(f"tidepool generate: {err}", file=sys.stderr)
        return 2
    if (args.prompt is not None or args.prediction is not None) and engine.tokenizer is None:
        print("tidepool generate: this checkpoint has no tokenizer.json; use --prompt-ids (and no --prediction)",
              file=sys.stderr)
        return 2
    if args.prediction is not None and engine.proposer is None:
        print("tidepool generate: --prediction drafts for speculative decoding: add --num-speculative-tokens K",
              file=sys.stderr)
        return 2
    if args.prompt is not None:
        prompts = [engine.tokenizer.encode(text, add_special_tokens=True) for text in args.prompt]
    else:
        prompts = args.prompt_ids
    try:
        prediction = [] if args.prediction is None else engine.tokenizer.encode(_text(args.prediction), False)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, min_p=args.min_p, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos,
                                n=args.n, structured_output=_structured_output(args), prediction_ids=prediction)
        params.validate()
    except (InvalidRequestError, OSError) as err:
        print(f"tidepool generate: {err}", file=sys.stderr)
        return 2
    tokens: dict[tuple[int, int], list[int]] = {}
    texts: dict[tuple[int, int], str] = {}
    try:
        for i, ids in enumerate(prompts):
            engine.add_request(str(i), ids, params, lora=None if args.lora is None else _ADAPTER)
    except InvalidRequestError as err:
        print(f"tidepool generate: prompt {i}: {err}", file=sys.stderr)
        return 2
    while engine.has_unfinished():
        for out in engine.step():
            key = (int(out.request_id), out.index)
            tokens.setdefault(key, []).extend(out.new_token_ids)
            texts[key] = texts.get(key, "") + out.text
    for i, ids in enumerate(prompts):
        samples = [{"token_ids": tokens.get((i, j), []), "text": texts.get((i, j), "")} for j in range(args.n)]
        if args.json:
            record = {"prompt_ids": ids, **samples[0]}
            if args.n > 1:
                record["samples"] = samples
            print(json.dumps(record), flush=True)
        else:
            for j, sample in enumerate(samples):
                label = f"[{i}]" if args.n == 1 else f"[{i}.{j}]"
                print(f"{label} {sample['text']!r}  ({len(sample['token_ids'])} tokens)", flush=True)
    if engine.proposer is not None:
        spec = engine.stats().speculation
        print(f"speculative decoding: {spec.accepted_tokens} of {spec.draft_tokens} draft tokens accepted in "
              f"{spec.drafts} drafted steps", file=sys.stderr)
    return 0
