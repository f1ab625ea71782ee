"""What an engine reports: its load (``EngineStats``, for the router and the worker's load reports) and what
its latest step computed (``StepComposition``, for the router's cost fits)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from engine.block_manager import BlockManager
from engine.scheduler import Scheduler
from engine.speculative import SpeculationStats


@dataclass
class EngineStats:
    free_blocks: int
    total_blocks: int
    num_waiting: int
    waiting_prompt_tokens: int  # prompt tokens queued for prefill (waiting + rest of partial prefills)
    waiting_prefills: list[tuple[int, int]]  # per queued prompt: (tokens to compute, tokens cached)
    num_running: int
    running_context_tokens: int
    recent_step_times_s: list[float]
    prompt_tokens_computed: int
    prompt_tokens_cached: int
    prefix_cache_queries: int  # prompt tokens looked up at first admission (prompt_tokens_cached: the hits)
    num_preemptions: int
    speculation: SpeculationStats = field(default_factory=SpeculationStats)  # cumulative; all 0 when off
    # the LoRA adapters of the running and of the waiting sequences (sorted names; the base model is none)
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()


@dataclass
class StepComposition:
    """What one step computed, for the router's cost fits: each prompt chunk as (request id, tokens
    computed, tokens before it in the sequence), and the decode rows (one token each) with the tokens
    their sequences hold. A speculating sequence's chunk (its last token and its draft) counts as a prompt
    chunk: it costs what a chunk of that length after that context costs; such chunks are also counted
    apart, with their sequences' tokens, and ``decoded_tokens`` is what the decoding sequences (decode rows
    and drafted chunks) produced: more than one a sequence where drafts were accepted."""

    prefill_chunks: list[tuple[str, int, int]]
    decode_seqs: int
    decode_context_tokens: int
    drafted_seqs: int = 0
    drafted_context_tokens: int = 0
    decoded_tokens: int = 0


def engine_stats(scheduler: Scheduler, block_manager: BlockManager, step_times_s: Iterable[float],
                 prompt_tokens_computed: int, speculation: SpeculationStats) -> EngineStats:
    """Load figures for the router (cheap: taken after every step)."""
    sch = scheduler
    queued = [(s.num_tokens - s.num_cached_tokens, s.num_cached_tokens) for s in sch.waiting]
    queued += [(s.num_tokens - s.num_computed_tokens, 0) for s in sch.running
               if s.num_computed_tokens < s.num_tokens - 1]
    return EngineStats(
        free_blocks=block_manager.num_free_blocks, total_blocks=block_manager.num_blocks,
        num_waiting=len(sch.waiting) + len(sch.held), waiting_prompt_tokens=sum(new for new, _ in queued),
        waiting_prefills=queued,
        num_running=len(sch.running), running_context_tokens=sum(s.num_tokens for s in sch.running),
        recent_step_times_s=list(step_times_s), prompt_tokens_computed=prompt_tokens_computed,
        prompt_tokens_cached=sch.prompt_tokens_cached, prefix_cache_queries=sch.prefix_cache_queries,
        num_preemptions=sch.num_preemptions,
        speculation=replace(speculation, accepted_per_position=list(speculation.accepted_per_position)),
        running_loras=_adapters(sch.running), waiting_loras=_adapters([*sch.waiting, *sch.held]),
    )


def _adapters(seqs: Iterable) -> tuple[str, ...]:
    return tuple(sorted({s.lora for s in seqs if s.lora is not None}))
