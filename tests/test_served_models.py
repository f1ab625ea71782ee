"""Checkpoints beyond the Llama family through the whole served path, driven as a client drives it (the
official ``openai`` client): a mixture of experts (Qwen3-MoE) on disaggregated prefill and decode workers,
its prompt's KV handed off between them, and a sliding-window Mistral (v0.1's kind), its prompts longer than
the window, on a colocated worker and disaggregated (the hand-off carries only the blocks the window keeps),
and a LongRoPE Phi-3 whose sequences pass its original context. Each answers with the greedy tokens
transformers generates."""

from __future__ import annotations

import shutil

import openai
import pytest
import torch
from live_helpers import wait_until
from test_engine_model import build_hf_checkpoint, longrope, prompts

from engine.config import ModelConfig
from engine.loader import resolve_model_dir
from kvstore.hashing import block_hashes, salt_for
from kvstore.pool import POOL_HOLDER, KVPool

NEW_TOKENS = 12


def serve_checkpoint(start_server, path, arch: str, overrides: dict, workers: dict):
    """A tiny random ``arch`` checkpoint with the built-in byte-level tokenizer (and a vocabulary to match it),
    served by ``workers``: (the server, the transformers model)."""
    tiny = resolve_model_dir("tiny")
    hf = build_hf_checkpoint(path, arch, vocab_size=ModelConfig.from_dir(tiny).vocab_size, **overrides)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, path / name)
    return start_server(model_dir=path, **workers), hf


def greedy_ids(server, ids: list[int]) -> list[int]:
    client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none", max_retries=0, timeout=120)
    response = client.completions.create(
        model=server.model_id, prompt=ids, max_tokens=NEW_TOKENS, temperature=0, logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    return [int(token.removeprefix("token_id:")) for token in response.choices[0].logprobs.tokens]


def transformers_ids(hf, ids: list[int]) -> list[int]:
    with torch.no_grad():
        return hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids):].tolist()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch, overrides, workers", [
    ("qwen3_moe", {}, dict(prefill=1, decode=1)),
    ("mistral", {"sliding_window": 20}, dict(colocated=1)),
    # gRPC: the KV leaves layer by layer, while the prefill's last chunk computes
    ("mistral", {"sliding_window": 20}, dict(prefill=1, decode=1, kv_transport="grpc")),
    # LongRoPE, an original context of 32: the 30-token prompt's sequence passes it on the decode worker
    ("phi3", longrope(), dict(prefill=1, decode=1)),
], ids=["qwen3_moe_disaggregated", "mistral_sliding_window_colocated", "mistral_sliding_window_disaggregated",
        "phi3_longrope_disaggregated"])
def test_a_checkpoint_answers_a_client_as_transformers_generates(start_server, tmp_path, arch, overrides, workers):
    server, hf = serve_checkpoint(start_server, tmp_path, arch, overrides, workers)
    try:
        for ids in prompts((30, 70)):  # 70 tokens: the window has passed the first three blocks
            assert greedy_ids(server, ids) == transformers_ids(hf, ids), len(ids)
    finally:
        server.stop()


@pytest.mark.timeout(300)
def test_a_longrope_prompt_is_taken_from_the_pool_by_another_prefill_worker_under_the_long_salt(start_server,
                                                                                                 tmp_path):
    """A prompt past LongRoPE's original context (32) is computed with the long factors on one prefill worker and
    shared under the long salt; round robin sends it again to the other, which reads those blocks from the pool
    and answers as transformers does; a short prompt of the same tokens finds none of them."""
    server, hf = serve_checkpoint(start_server, tmp_path, "phi3", longrope(),
                                  dict(prefill=2, decode=1, kv_transport="grpc", policy="round_robin"))
    client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none", max_retries=0, timeout=120)
    (long,) = prompts((70,))

    def complete(ids: list[int]) -> tuple[str, int]:
        response = client.completions.create(model=server.model_id, prompt=ids, max_tokens=NEW_TOKENS,
                                             temperature=0, extra_body={"ignore_eos": True})
        return response.choices[0].text, response.usage.prompt_tokens_details.cached_tokens

    pool = KVPool(server.server.cluster.redis_url, server.model_id, 16)
    try:
        first = complete(long)  # on the first prefill worker
        hashes = block_hashes(long, 16, salt_for(server.model_id, long_rope=True))
        assert wait_until(lambda: pool.longest_prefix(hashes).get(POOL_HOLDER, 0) == len(hashes), 30)
        assert complete(long) == (first[0], 64)  # the other worker: 4 blocks from the pool (not the last token's)
        assert complete(long[:31])[1] == 0  # the first worker again: its blocks of these tokens are long-rotated
        assert greedy_ids(server, long) == transformers_ids(hf, long)
    finally:
        pool.close()
        server.stop()
