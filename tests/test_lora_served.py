"""LoRA adapters served by the cluster (``--lora-modules``): a request names an adapter as its model, over HTTP
and gRPC; its prompt is computed on a prefill worker and decoded on a decode worker with that adapter, and
its blocks are prefix-cache hits for its own adapter's requests only."""

from __future__ import annotations

import asyncio
import dataclasses
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import pytest
import torch
from test_lora import ALL_PROJECTIONS, peft_adapter
from test_peer_copy import SECRET, handle_of
from test_pool_engine import GREEDY, _generate
from transformers import LlamaForCausalLM

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from loadtest.config import BenchConfig
from loadtest.plan import build_workload
from loadtest.runner import run_benchmark
from services.cli import build_parser
from services.config import configs_from_args
from services.engine_loop import EngineLoop
from services.messages import PrefixFetch
from services.peer_copy import PrefixCopier
from services.pool_link import PoolLink
from tidepool.v1 import serving_pb2, serving_pb2_grpc

PROMPT = [(7 * i + 3) % 200 + 10 for i in range(40)]  # two full blocks of 16, and 8 tokens
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(serving_model_dir, tmp_path_factory) -> dict[str, str]:
    hf = LlamaForCausalLM.from_pretrained(serving_model_dir, dtype=torch.float32)
    out = tmp_path_factory.mktemp("adapters")
    peft_adapter(hf, out / "crab", ALL_PROJECTIONS, rank=8, seed=1, lora_alpha=16)
    peft_adapter(hf, out / "kelp", ["q_proj", "v_proj"], rank=4, seed=2)
    peft_adapter(hf, out / "clam", ALL_PROJECTIONS, rank=4, seed=3)  # loaded while serving
    return {"crab": str(out / "crab"), "kelp": str(out / "kelp"), "clam": str(out / "clam")}


def served(adapters: dict[str, str]) -> dict[str, str]:
    """The adapters the server starts with (clam is loaded while it serves)."""
    return {name: path for name, path in adapters.items() if name != "clam"}


@pytest.fixture(scope="module")
def lora_server(start_server, adapters):
    """Two prefill workers (a repeated prompt may land on the other one: its blocks come from the pool or a
    peer, under the adapter's salt) and one decode worker, KV handed over by gRPC. One adapter slot a worker
    for up to three adapters: they take turns (concurrent requests of two adapters wait for each other on
    the prefill workers, and on the decode worker once their KV has arrived)."""
    server = start_server(prefill=2, decode=1, kv_transport="grpc",
                          engine_options={"lora_modules": served(adapters), "max_loras": 1, "max_cpu_loras": 3},
                          gateway_options={"allow_runtime_lora_updating": True})
    yield server
    server.stop()


def engine_texts(model_dir, adapters: dict[str, str]) -> dict[str | None, str]:
    """Each adapter's (and the base model's) greedy answer to PROMPT from one in-process engine."""
    engine = Engine(EngineConfig(model=str(model_dir), num_blocks=64, lora_modules=adapters))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for lora in (None, *adapters):
        engine.add_request(str(lora), PROMPT, params, lora=lora)
    texts: dict[str | None, str] = {}
    while engine.has_unfinished():
        for out in engine.step():
            key = None if out.request_id == "None" else out.request_id
            texts[key] = texts.get(key, "") + out.text
    return texts


@pytest.mark.timeout(300)
def test_each_adapter_answers_as_the_engine_runs_it_and_hits_only_its_own_blocks(lora_server, serving_model_dir,
                                                                                   adapters):
    client = openai.OpenAI(base_url=f"{lora_server.http_url}/v1", api_key="none", max_retries=0, timeout=120)
    base = lora_server.model_id
    listed = {m.id: m.model_extra["parent"] for m in client.models.list().data}
    assert listed == {base: None, "crab": base, "kelp": base}

    def complete(model: str):
        return client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                                         extra_body={"ignore_eos": True})

    want = engine_texts(serving_model_dir, served(adapters))
    assert len(set(want.values())) == 3  # each adapter answers differently
    answers = {model: complete(model) for model in (base, "crab", "kelp")}
    assert {m: a.choices[0].text for m, a in answers.items()} == {base: want[None], "crab": want["crab"],
                                                                   "kelp": want["kelp"]}
    # The same prompt under each adapter is computed apart: no adapter's blocks were another's hits.
    assert [a.usage.prompt_tokens_details.cached_tokens for a in answers.values()] == [0, 0, 0]
    for _ in range(2):  # whichever prefill worker takes it: its own cache, the pool or the other worker
        again = complete("crab")
        assert again.choices[0].text == want["crab"] and again.usage.prompt_tokens_details.cached_tokens == 32
    # at once: the two adapters take turns in each worker's one slot, and every answer is still its own
    with ThreadPoolExecutor(6) as pool:
        texts = list(pool.map(lambda model: complete(model).choices[0].text, ["crab", "kelp", base] * 2))
    assert texts == [want["crab"], want["kelp"], want[None]] * 2

    # gRPC names the adapter the same way
    stub = serving_pb2_grpc.ServingStub(grpc.insecure_channel(lora_server.grpc_target))
    chunks = list(stub.Complete(serving_pb2.CompleteRequest(
        model="kelp", prompt_token_ids=PROMPT, sampling=serving_pb2.SamplingOptions(
            max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)), timeout=120))
    assert "".join(c.text for c in chunks) == want["kelp"]
    # /metrics exports vLLM's lora_requests_info, max_lora being the workers' adapter slots
    info = [line for line in httpx.get(f"{lora_server.http_url}/metrics").text.splitlines()
            if line.startswith("tidepool_lora_requests_info{")]
    assert len(info) == 1 and 'max_lora="1"' in info[0]
    lora = httpx.get(f"{lora_server.http_url}/v1/cluster/status").json()["lora"]  # what `tidepool status` shows
    assert (lora["adapters"], lora["slots"]) == (["crab", "kelp"], 1)


@pytest.mark.redis
@pytest.mark.timeout(120)
def test_an_adapters_blocks_reach_other_workers_under_its_salt_only(serving_model_dir, adapters, redis_url):
    """A peer copy and a pool read carry an adapter's blocks to another worker's engine, where the adapter's
    request hits them and answers as a cold run does; the base model's and another adapter's find none."""

    async def run() -> None:
        aio = asyncio.get_running_loop()
        loops = [EngineLoop(Engine(EngineConfig(model=str(serving_model_dir), num_blocks=64,
                                                lora_modules=served(adapters),
                                                enable_block_events=True)), aio) for _ in range(3)]
        holder = PrefixCopier(loops[0].engine, loops[0], SECRET, host=None)
        taker = PrefixCopier(loops[1].engine, loops[1], SECRET, host="127.0.0.1")
        link, reader = (PoolLink(redis_url, f"lora-{i}", loops[i].engine, redis_max_bytes=16 << 20) for i in (0, 2))
        crab, kelp, base = (loops[1].engine.prefix_salt(lora) for lora in ("crab", "kelp", None))
        try:
            cold, _ = await _generate(loops[0], "cold", PROMPT, GREEDY, lora="crab")
            await link.store_prefix(loops[0], PROMPT, 0, crab)
            await link.wait_shared()
            assert (await reader.read_prefix(PROMPT, 0, kelp)).tensor is None
            assert (await reader.read_prefix(PROMPT, 0, base)).tensor is None
            pooled = await reader.read_prefix(PROMPT, 0, crab)
            assert pooled.blocks == 2
            base_copy = await taker.take(PROMPT, PrefixFetch("a", 2, 0.0, handle_of(holder), base), 0, 10.0, base)
            assert base_copy.tensor is None  # the holder has no base-model blocks of this prompt
            copied = await taker.take(PROMPT, PrefixFetch("a", 2, 0.0, handle_of(holder), crab), 0, 10.0, crab)
            assert copied.blocks == 2
            for loop, fetched in ((loops[1], copied), (loops[2], pooled)):
                assert await loop.acall(loop.engine.insert_cached_blocks, PROMPT, fetched.tensor, 0, crab) == 2
                assert (await _generate(loop, "kelp", PROMPT, GREEDY, lora="kelp"))[1] == 0  # computed
                assert await _generate(loop, "warm", PROMPT, GREEDY, lora="crab") == (cold, 32)
        finally:
            link.close()
            reader.close()
            for loop in loops:
                loop.stop()

    asyncio.run(run())


@pytest.mark.timeout(120)
def test_a_model_that_is_neither_the_base_nor_an_adapter_is_a_404(lora_server):
    client = openai.OpenAI(base_url=f"{lora_server.http_url}/v1", api_key="none", max_retries=0, timeout=60)
    with pytest.raises(openai.NotFoundError, match="shrimp"):
        client.completions.create(model="shrimp", prompt="tide", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("shrimp")
    assert client.models.retrieve("crab").model_extra["parent"] == lora_server.model_id
    stub = serving_pb2_grpc.ServingStub(grpc.insecure_channel(lora_server.grpc_target))
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Complete(serving_pb2.CompleteRequest(model="shrimp", prompt="tide"), timeout=60))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.timeout(180)
def test_an_adapter_loaded_while_serving_answers_on_every_worker_until_it_is_unloaded(lora_server, adapters,
                                                                                         serving_model_dir):
    url, client = lora_server.http_url, openai.OpenAI(base_url=f"{lora_server.http_url}/v1", api_key="none",
                                                       max_retries=0, timeout=120)
    engine_config = lora_server.server.cluster.config.engine  # what workers started from now on load

    def complete(model: str) -> str:
        return client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                                         extra_body={"ignore_eos": True}).choices[0].text

    loaded = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "clam", "lora_path": adapters["clam"]})
    assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'clam' added successfully.")
    assert "clam" in {m.id for m in client.models.list().data} and "clam" in engine_config.lora_modules
    want = engine_texts(serving_model_dir, {"clam": adapters["clam"]})["clam"]
    assert [complete("clam") for _ in range(2)] == [want, want]  # round the prefill workers
    again = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "clam", "lora_path": adapters["crab"]})
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    base = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": lora_server.model_id,
                                                            "lora_path": adapters["crab"]})
    assert base.status_code == 400 and "the base model's name" in base.json()["error"]["message"]
    bad = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "oyster", "lora_path": "/no/such/dir"})
    assert bad.status_code == 400 and "adapter_config.json not found" in bad.json()["error"]["message"]
    full = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "oyster", "lora_path": adapters["clam"]})
    assert full.status_code == 400 and "as many as --max-cpu-loras 3 allows" in full.json()["error"]["message"]
    assert "oyster" not in engine_config.lora_modules and "oyster" not in {m.id for m in client.models.list().data}

    unloaded = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "clam"})
    assert (unloaded.status_code, unloaded.text) == (200, "Success: LoRA adapter 'clam' removed successfully.")
    with pytest.raises(openai.NotFoundError):
        complete("clam")
    missing = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "clam"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "lora_adapter_not_found"
    assert "clam" not in engine_config.lora_modules and complete("crab")  # the others still serve


@pytest.mark.timeout(180)
def test_the_load_test_spreads_its_requests_over_the_adapters(lora_server, tmp_path):
    """``tidepool bench --lora-modules``: each request names one of the adapters, chosen by the seed, and all of
    them are served."""
    config = BenchConfig(base_url=lora_server.http_url, num_prompts=8, input_len=24, output_len=3,
                         lora_modules=["crab", "kelp"], progress=False, print_table=False)
    chosen = [spec.model for spec in build_workload(config, None).specs]
    assert set(chosen) == {"crab", "kelp"} and chosen == [s.model for s in build_workload(config, None).specs]
    result = run_benchmark(config)
    assert result["completed"] == 8, result["error_samples"]
    with pytest.raises(ValueError, match="not chat"):
        build_workload(dataclasses.replace(config, workload="chat", endpoint="chat"), None)


def test_the_flag_takes_name_dir_pairs_and_refuses_a_name_given_twice(tmp_path):
    parse = build_parser().parse_args
    cluster = configs_from_args(parse(["serve", "--lora-modules", f"crab={tmp_path}", "kelp=rel/dir"]))[0]
    assert cluster.engine.lora_modules["crab"] == str(tmp_path)
    assert cluster.engine.lora_modules["kelp"].endswith("/rel/dir") and cluster.engine.lora_modules["kelp"][0] == "/"
    with pytest.raises(ValueError, match="names each adapter once"):
        configs_from_args(parse(["serve", "--lora-modules", f"crab={tmp_path}", f"crab={tmp_path}"]))
    with pytest.raises(SystemExit):
        parse(["serve", "--lora-modules", "crab"])
    assert configs_from_args(parse(["serve", "--allow-runtime-lora-updating"]))[1].allow_runtime_lora_updating
    assert not configs_from_args(parse(["serve"]))[1].allow_runtime_lora_updating
    # the adapter slots: one per --lora-modules adapter, at least one when adapters may be loaded while serving
    slots = [configs_from_args(parse(["serve", *flags]))[0].engine for flags in (
        [], ["--lora-modules", f"crab={tmp_path}"], ["--allow-runtime-lora-updating"],
        ["--allow-runtime-lora-updating", "--max-loras", "4", "--max-lora-rank", "64", "--max-cpu-loras", "32"])]
    assert [(e.max_loras, e.max_lora_rank, e.max_cpu_loras) for e in slots] == [
        (None, None, None), (None, None, None), (1, None, None), (4, 64, 32)]
    with pytest.raises(ValueError, match="max_loras must be at least 1 to serve lora_modules"):
        configs_from_args(parse(["serve", "--lora-modules", f"crab={tmp_path}", "--max-loras", "0"]))
    with pytest.raises(ValueError, match="max_cpu_loras must be at least max_loras"):
        configs_from_args(parse(["serve", "--max-loras", "4", "--max-cpu-loras", "2"]))


@pytest.mark.timeout(120)
def test_without_the_flag_adapters_cannot_be_loaded_while_serving(live_server, adapters):
    response = httpx.post(f"{live_server.http_url}/v1/load_lora_adapter",
                          json={"lora_name": "clam", "lora_path": adapters["clam"]})
    assert response.status_code == 404 and "clam" not in live_server.dispatcher.loras
