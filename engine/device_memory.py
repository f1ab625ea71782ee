"""How many KV blocks an engine gets: ``num_blocks`` when given, the ``kv_cache_bytes`` budget on CPU, and
on CUDA what the device has left (vLLM's ``--gpu-memory-utilization``).

On CUDA, after the weights are loaded, one profiling forward pass runs at the engine's largest step:
``max_num_batched_tokens`` prompt tokens split over ``min(max_num_seqs, tokens)`` sequences (so the
logits are as many rows as a full batch samples), into a scratch cache just large enough; then the
sampler's largest step (``sample_largest_step``, vLLM's dummy sampler run): every row a full batch samples,
``k + 1`` a sequence when it drafts, through every transform at once (a structured output's mask,
penalties, temperature, min-p, top-k, top-p and top logprobs) and, with a draft model, the draws taken ahead,
beside the most rows of prompt logprobs a step computes (``scheduler.PROMPT_LOGPROBS_ROWS``). Then

    kv_cache_bytes = total × gpu_memory_utilization − used
    used = peak torch allocation during the pass (weights, activations, anything else this process holds)
           − the scratch cache
           + memory outside torch's allocator (total − free − torch reserved: the CUDA context, library
             workspaces, and what other processes hold on the device, which this engine cannot have)

as vLLM computes it, so ``gpu_memory_utilization`` caps everything this engine puts on the device. Decode
steps allocate less than such a prefill; what the passes do not see (split-K scratch, a draft model's own
passes, allocator fragmentation) comes out of the share left above the utilization.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from engine.config import EngineConfig, ModelConfig
from engine.kv_cache import KVCache, num_blocks_for
from engine.model import CausalLM
from engine.runner import ModelRunner, SeqChunk
from engine.sampler import sample, top_logprobs
from engine.sampling_params import MAX_LOGPROBS, SamplingParams
from engine.scheduler import PROMPT_LOGPROBS_ROWS, Sequence
from engine.structured_output import GrammarMasks, all_allowed
from engine.token_counts import TokenCounts

GIB = 1024**3


def kv_cache_bytes_for_device(total_bytes: int, used_bytes: int, utilization: float) -> int:
    """``total_bytes × utilization − used_bytes`` (the module docstring); ValueError when nothing is left."""
    budget = int(total_bytes * utilization) - used_bytes
    if budget <= 0:
        raise ValueError(f"weights and activations need {used_bytes / GIB:.2f} GiB of "
                         f"{total_bytes / GIB:.2f} GiB at gpu_memory_utilization {utilization:g}, leaving "
                         "nothing for the KV cache: "
                         "lower max_num_batched_tokens or raise --gpu-memory-utilization")
    return budget


@torch.inference_mode()
def profile_device_memory(model: CausalLM, model_config: ModelConfig, config: EngineConfig,
                          attention_backend: str) -> tuple[int, int]:
    """(device total bytes, bytes used besides the KV cache) from one forward pass at
    ``max_num_batched_tokens`` and the sampler's largest step on ``config.device`` (CUDA), as the module
    docstring defines them."""
    device = torch.device(config.device)
    tokens, B = config.max_num_batched_tokens, config.block_size
    seqs = min(config.max_num_seqs, tokens)
    lens = [tokens // seqs + (i < tokens % seqs) for i in range(seqs)]
    blocks = [-(-n // B) for n in lens]
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    scratch = KVCache(model_config, sum(blocks), B, config.dtype, device, config.kv_cache_dtype,
                      seqs * (config.residual_blocks + 1), residual_blocks=config.residual_blocks)
    scratch_bytes = torch.cuda.memory_allocated(device) - before
    runner = ModelRunner(model, model_config, scratch, None, attention_backend)
    firsts = [sum(blocks[:i]) for i in range(seqs)]
    runner.run([SeqChunk([0] * n, 0, list(range(first, first + nb)))
                for n, nb, first in zip(lens, blocks, firsts, strict=True)])
    sample_largest_step(config, model_config.vocab_size)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    outside = total - free - torch.cuda.memory_reserved(device)
    del runner, scratch
    torch.cuda.empty_cache()
    return total, peak - scratch_bytes + max(0, outside)


@torch.inference_mode()
def sample_largest_step(config: EngineConfig, vocab_size: int) -> tuple[int, int]:
    """Sample the engine's largest batch of rows on ``config.device`` as the costliest request would be sampled,
    after scoring the most prompt-logprob rows a step computes, for the profile to see the step's peak; returns
    (rows sampled, prompt-logprob rows). The rows sampled: ``max_num_seqs`` times ``k + 1`` (a drafted
    sequence's chunk is verified row by row), each with logits, a grammar's mask, penalties over a history
    (read from count tables sized for every sequence, a draft model's too: ``token_counts``), temperature,
    min-p, top-k, top-p and the most top logprobs, and a draw taken ahead where a draft model samples its
    drafts (``sampler.draw_ahead``). The prompt rows' logits stay on the device meanwhile, as the
    step's logits hold both (``Engine.step`` scores them, then samples)."""
    rows = config.max_num_seqs * (config.num_speculative_tokens + 1)
    prompt_rows = min(PROMPT_LOGPROBS_ROWS, config.max_num_batched_tokens)
    params = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                            presence_penalty=0.1, logprobs=MAX_LOGPROBS)
    step_logits = torch.zeros(prompt_rows + rows, vocab_size, device=config.device)
    top_logprobs(step_logits[:prompt_rows], [0] * prompt_rows, [MAX_LOGPROBS] * prompt_rows)
    logits = step_logits[prompt_rows:]
    allowed = GrammarMasks.apply(logits, all_allowed(rows, vocab_size))
    draws = None
    if config.speculative_model is not None:
        draws = list(torch.empty(rows, vocab_size, device=config.device).exponential_())
    # Every sequence's penalty counts, and a draft model's of them too (``token_counts.TokenCounts``)
    sequences = config.max_num_seqs * (2 if config.speculative_model is not None else 1)
    counts = TokenCounts(vocab_size, config.device, sequences)
    history = list(range(min(64, vocab_size)))
    per_seq = config.num_speculative_tokens + 1
    penalties = counts.penalties([Sequence(row // per_seq, "", history, len(history) // 2, params)
                                  for row in range(rows)])
    tokens = sample(allowed, [params] * rows, [None] * rows, penalties, draws=draws)
    top_logprobs(logits, tokens, [MAX_LOGPROBS] * rows)
    return rows, prompt_rows


def engine_num_blocks(model: CausalLM, model_config: ModelConfig, config: EngineConfig,
                      attention_backend: str, extra_block_bytes: int = 0) -> int:
    """``config.num_blocks`` if set; on CUDA the blocks that fit the profiled budget; else the blocks of
    ``config.kv_cache_bytes`` (``kv_cache.num_blocks_for``: windows of fp8/kivi2 come off either budget).
    ``extra_block_bytes``: what each block costs besides the model's (a draft model's block of as many tokens)."""
    if config.num_blocks:
        return config.num_blocks
    if torch.device(config.device).type != "cuda":
        return num_blocks_for(model_config, config, extra_block_bytes)
    total, used = profile_device_memory(model, model_config, config, attention_backend)
    budget = kv_cache_bytes_for_device(total, used, config.gpu_memory_utilization)
    return num_blocks_for(model_config, replace(config, kv_cache_bytes=budget), extra_block_bytes)
