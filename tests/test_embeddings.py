"""Embeddings in the engine (engine/pooling.py): the last prompt token's final-norm hidden state, normalized as
the checkpoint's sentence-transformers config says, equal to transformers' on the same weights, whatever the
step shares it with (a generation, other prompts, chunks of its own, a cached prefix); Matryoshka dimensions;
the checkpoints embedding models ship (the base model alone, under its ``*Model`` name); the poolings refused;
and the router's choice of a worker for a prompt computed alone."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.errors import InvalidRequestError
from engine.loader import load_model
from engine.pooling import Pooling, read_pooling
from engine.sampling_params import SamplingParams
from router.conductor import Conductor, Decision, Reject, RouteRequest, WorkerLoad
from router.estimator import (
    DEFAULT_PEER_LINK,
    DEFAULT_POOL_LINK,
    DecodeModel,
    Estimator,
    PrefillModel,
    TransferModel,
)
from router.view import SLO

pytestmark = pytest.mark.timeout(120)

PROMPTS = [[5, 17, 42, 99, 3, 250, 8, 61, 77, 12, 140, 2, 33], [7] * 40, [200, 1, 9]]


def _qwen3_config(tie: bool) -> transformers.Qwen3Config:
    return transformers.Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    max_position_embeddings=512, tie_word_embeddings=tie, bos_token_id=1,
                                    eos_token_id=2)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """A Qwen3 causal LM, and its body saved alone as an embedding model ships it (Qwen3-Embedding: the
    ``Qwen3Model``'s tensors, no LM head), under the architecture name it carries, with the reference model."""
    torch.manual_seed(0)
    lm = transformers.Qwen3ForCausalLM(_qwen3_config(tie=False)).eval()
    root = tmp_path_factory.mktemp("embedding-models")
    lm.save_pretrained(root / "causal")
    lm.model.save_pretrained(root / "base")  # architectures: ["Qwen3Model"]
    return {"causal": root / "causal", "base": root / "base", "reference": lm.model}


def _expected(reference, prompt: list[int], normalize: bool = True, dimensions: int | None = None) -> torch.Tensor:
    with torch.no_grad():
        hidden = reference(input_ids=torch.tensor([prompt])).last_hidden_state[0, -1, :dimensions]
    return torch.nn.functional.normalize(hidden, dim=0) if normalize else hidden


def _run(engine: Engine) -> dict:
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


@pytest.mark.parametrize("kind", ["causal", "base"])
def test_an_embedding_is_the_last_tokens_normalized_hidden_state_as_transformers_computes_it(checkpoints, kind):
    # Small chunks: the 40-token prompt takes several steps, each beside the others' prompts and a generation.
    engine = Engine(EngineConfig(model=str(checkpoints[kind]), num_blocks=64, max_num_batched_tokens=16))
    for i, prompt in enumerate(PROMPTS):
        engine.add_embedding_request(f"e{i}", prompt)
    engine.add_request("g", PROMPTS[0], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    outputs = _run(engine)
    for i, prompt in enumerate(PROMPTS):
        (out,) = outputs[f"e{i}"]
        assert out.finished and out.new_token_ids == [] and out.num_prompt_tokens == len(prompt)
        np.testing.assert_allclose(out.embedding, _expected(checkpoints["reference"], prompt), atol=2e-5)
    assert len([t for out in outputs["g"] for t in out.new_token_ids]) == 4  # the generation ran beside them
    assert engine.stats().free_blocks == 64  # every block back (the full ones still cached)


def test_a_cached_prefix_is_reused_and_the_vector_is_the_same(checkpoints):
    engine = Engine(EngineConfig(model=str(checkpoints["causal"]), num_blocks=64, block_size=16))
    engine.add_embedding_request("first", PROMPTS[1])
    (first,) = _run(engine)["first"]
    engine.add_embedding_request("again", PROMPTS[1])
    engine.add_embedding_request("longer", PROMPTS[1] + [4, 5])
    outputs = _run(engine)
    assert first.num_cached_tokens == 0
    assert outputs["again"][0].num_cached_tokens == 32 and outputs["longer"][0].num_cached_tokens == 32
    np.testing.assert_allclose(outputs["again"][0].embedding, first.embedding, atol=1e-6)
    np.testing.assert_allclose(outputs["longer"][0].embedding,
                               _expected(checkpoints["reference"], PROMPTS[1] + [4, 5]), atol=2e-5)


def test_matryoshka_dimensions_cut_the_vector_before_it_is_normalized(checkpoints):
    engine = Engine(EngineConfig(model=str(checkpoints["causal"]), num_blocks=64))
    engine.add_embedding_request("cut", PROMPTS[0], dimensions=8)
    (out,) = _run(engine)["cut"]
    assert len(out.embedding) == 8
    np.testing.assert_allclose(out.embedding, _expected(checkpoints["reference"], PROMPTS[0], dimensions=8),
                               atol=2e-5)
    for dimensions in (0, 65):
        with pytest.raises(InvalidRequestError, match=r"dimensions: must be in \[1, 64\]"):
            engine.add_embedding_request("bad", PROMPTS[0], dimensions=dimensions)
    assert engine.stats().free_blocks == 64


def test_a_base_checkpoint_loads_as_the_causal_lm_it_is_the_body_of_and_generates_only_if_tied(checkpoints, tmp_path):
    base = ModelConfig.from_dir(checkpoints["base"])
    assert base.architecture == "Qwen3ForCausalLM"
    _, untied = load_model(checkpoints["base"])
    assert untied.base_checkpoint and not untied.generates  # its LM head is not in the checkpoint
    torch.manual_seed(1)
    tied = transformers.Qwen3ForCausalLM(_qwen3_config(tie=True)).eval()
    tied.model.save_pretrained(tmp_path)
    model, config = load_model(tmp_path)
    assert config.generates  # the head is the embedding matrix, which the checkpoint holds
    engine_logits = model.logits(model.model.embed_tokens.weight[:3])
    torch.testing.assert_close(engine_logits, tied.lm_head(tied.model.embed_tokens.weight[:3]).float())


def _sentence_transformers(path, pooling: dict, modules: list[str]) -> None:
    (path / "1_Pooling").mkdir(parents=True, exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **pooling}))
    entries = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    entries += [{"idx": i + 2, "name": str(i + 2), "path": f"{i + 2}_{m}", "type": f"sentence_transformers.models.{m}"}
                for i, m in enumerate(modules)]
    (path / "modules.json").write_text(json.dumps(entries))


def test_the_sentence_transformers_config_says_whether_vectors_are_normalized(checkpoints, tmp_path):
    assert read_pooling(tmp_path) == Pooling(normalize=True)  # none: vLLM's default for a decoder
    _sentence_transformers(tmp_path, {"pooling_mode_lasttoken": True}, ["Normalize"])
    assert read_pooling(tmp_path) == Pooling(normalize=True)
    _sentence_transformers(checkpoints["base"], {"pooling_mode_lasttoken": True}, [])
    try:
        engine = Engine(EngineConfig(model=str(checkpoints["base"]), num_blocks=64))
        engine.add_embedding_request("raw", PROMPTS[0])
        (out,) = _run(engine)["raw"]
    finally:
        (checkpoints["base"] / "modules.json").unlink()
    np.testing.assert_allclose(out.embedding, _expected(checkpoints["reference"], PROMPTS[0], normalize=False),
                               atol=1e-4)


@pytest.mark.parametrize("pooling, modules, reason", [
    ({"pooling_mode_mean_tokens": True}, ["Normalize"], "its sentence-transformers pooling is mean"),
    ({"pooling_mode_cls_token": True}, [], "its sentence-transformers pooling is CLS token"),
    ({"pooling_mode_lasttoken": True}, ["Dense", "Normalize"], "its sentence-transformers modules include Dense"),
])
def test_a_pooling_other_than_the_last_token_is_refused_by_name(tmp_path, pooling, modules, reason):
    _sentence_transformers(tmp_path, pooling, modules)
    refused = read_pooling(tmp_path)
    assert reason in refused.refused
    with pytest.raises(InvalidRequestError, match="this model's embeddings are not served: " + reason):
        refused.check(None, 64)


def test_a_broken_module_list_names_the_file(tmp_path):
    (tmp_path / "modules.json").write_text("{")
    with pytest.raises(ValueError, match="modules.json: not a sentence-transformers module list"):
        read_pooling(tmp_path)


# ---- routing a prompt computed alone -------------------------------------------------------------------------

ESTIMATOR = Estimator(PrefillModel(per_pair_s=0.0, per_token_s=1e-3, fixed_s=0.0), DecodeModel(0.01, 0.001, 1e-6),
                      TransferModel(DEFAULT_PEER_LINK, DEFAULT_POOL_LINK), kv_bytes_per_token=1024)


class _Index:
    def __init__(self, held: dict[str, int]) -> None:
        self.held = held

    def longest_prefix(self, hashes) -> dict[str, int]:
        return self.held


def _load(worker_id: str, role: str, queued: list | None = None) -> WorkerLoad:
    return WorkerLoad(worker_id, role, queued_prefills=queued or [], free_blocks=100, total_blocks=100,
                      updated_at=1000.0)


@pytest.mark.parametrize("policy", ["tidepool", "round_robin"])
def test_a_prompt_alone_goes_to_the_prefill_worker_that_ends_it_first_with_no_decode_worker_needed(policy):
    conductor = Conductor(policy, ESTIMATOR, SLO(ttft_s=1.0, tbt_s=0.05), block_size=16, copy_inflight=False)
    request = RouteRequest("e", 200, list(range(12)), 0)
    loads = [_load("p0", "prefill"), _load("p1", "prefill"), _load("d0", "decode")]
    # p1 holds 10 of its 12 blocks: 40 tokens to compute, against p0's 200
    decision = conductor.route_prompt(request, loads, _Index({"p1": 10}), now=1000.0)
    assert isinstance(decision, Decision)
    assert (decision.prefill, decision.decode, decision.cached_blocks) == ("p1", "p1", 10)
    assert decision.est_ttft_s == pytest.approx(0.04 + ESTIMATOR.request_overhead_s)
    # What it routes counts on a worker until the worker's report includes it: of two prompts alike, the second
    # goes to the other worker (the first's 0.2 s queued on the one it went to).
    fresh = RouteRequest("f", 200, [], 0)
    assert [conductor.route_prompt(fresh, loads, _Index({}), now=1000.0).prefill for _ in range(2)] == ["p0", "p1"]


def test_a_prompt_alone_needs_no_decode_worker():
    conductor = Conductor("tidepool", ESTIMATOR, SLO(ttft_s=1.0, tbt_s=0.05))
    alone = conductor.route_prompt(RouteRequest("e", 20, [], 0), [_load("p0", "prefill")], _Index({}), now=1000.0)
    assert isinstance(alone, Decision) and alone.prefill == alone.decode == "p0"


def test_a_prompt_no_worker_ends_within_the_ttft_slo_is_rejected_by_a_policy_that_rejects_early():
    slo = SLO(ttft_s=0.1, tbt_s=0.05)
    request = RouteRequest("e", 500, [], 0)  # 0.5 s on any worker
    rejected = Conductor("tidepool", ESTIMATOR, slo).route_prompt(request, [_load("p0", "prefill")], _Index({}),
                                                                  now=1000.0)
    assert isinstance(rejected, Reject) and rejected.reason == "ttft"
    assert rejected.retry_after_s == pytest.approx(0.4)
    baseline = Conductor("least_loaded", ESTIMATOR, slo).route_prompt(request, [_load("p0", "prefill")],
                                                                      _Index({}), now=1000.0)
    assert isinstance(baseline, Decision)  # a baseline never rejects
    none = Conductor("tidepool", ESTIMATOR, slo).route_prompt(request, [_load("d0", "decode")], _Index({}), now=1.0)
    assert isinstance(none, Reject) and none.reason == "no live prefill worker"
