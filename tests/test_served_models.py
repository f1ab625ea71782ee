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
from test_engine_model import build_hf_checkpoint, longrope, prompts

from engine.config import ModelConfig
from engine.loader import resolve_model_dir

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
