"""`tidepool profile` against a live server: GET /v1/cluster/profile returns the measured engine steps and
KV transfers, the command writes a profile that `tidepool simulate --profile` accepts, and the fitted
prefill model predicts a later, live prefill within a generous factor."""

from __future__ import annotations

import json

import httpx
import numpy as np
import openai
import pytest
from live_helpers import wait_until

from router.profile import Profile
from services.cli import main as tidepool
from services.profile_cli import PROFILE_PATH, calibration_prompts


def _samples(server) -> dict:
    response = httpx.get(server.http_url + PROFILE_PATH, timeout=30)
    assert response.status_code == 200
    return response.json()


def _trace(path, n: int = 20) -> str:
    """Short prompts sharing a 512-token prefix: fits the small model's KV capacity."""
    rows = [{"timestamp": 100 * i, "input_length": 600 + 10 * i, "output_length": 8, "hash_ids": [0, 1000 + i]}
            for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.timeout(30)
def test_calibration_prompts_share_three_quarters_of_each_length():
    groups = calibration_prompts([64, 256], repeats=2)
    assert [len(g) for g in groups] == [3, 3]
    for (first, *rest), n in zip(groups, (64, 256), strict=True):
        assert all(len(p) == n and p[: 3 * n // 4] == first[: 3 * n // 4] and p != first for p in rest)
    assert calibration_prompts([64, 256], repeats=2) == groups  # the same seed, the same prompts


@pytest.fixture(scope="module")
def live_server(start_server):
    """Its own small server: the samples it measured are this module's alone. Layer-wise hand-offs, the
    default: their link time leaves out the sender's waits for layers still being computed."""
    server = start_server(prefill=1, decode=1)
    yield server
    server.stop()


@pytest.mark.timeout(600)
def test_profile_of_a_live_server_feeds_the_simulator_and_predicts_live_prefills(live_server, tmp_path, capsys):
    out = tmp_path / "profile.json"
    # 24 tokens: the two prompts sent at once decode together though their prefills end apart (with 6, a loaded
    # machine once ended the first's decode before the second's handoff, and no step was batched)
    assert tidepool(["profile", "--url", live_server.http_url, "--calibrate", "--lengths", "32,128,512",
                     "--repeats", "2", "--max-tokens", "24", "--out", str(out)]) == 0
    samples = _samples(live_server)
    # the calibration ran prefills with cache hits, batched decode steps and prefill -> decode hand-offs
    steps = np.array(samples["prefill_steps"])
    assert len(steps) and (steps[:, 0] > steps[:, 1] * (steps[:, 1] + 1) / 2).any()  # chunks on a cached prefix
    assert any(batch > 1 for batch, _, _ in samples["decode_steps"])
    assert any(src.startswith("prefill") and dst.startswith("decode") for src, dst, _, _ in samples["transfers"])
    # each worker's steps against the refit models: the prefill worker's prefills, the decode worker's decode steps
    speeds = samples["worker_speeds"]
    assert any(w.startswith("prefill") for w in speeds["prefill"])
    assert [w.split("-")[0] for w in speeds["decode"]] == ["decode"]
    assert all(0 < f < 20 for kind in speeds.values() for f in kind.values())
    profile = Profile.load(out)
    assert profile.kv_bytes_per_token == samples["kv_bytes_per_token"] and profile.decode_kv_tokens > 0
    assert "prefill steps" in capsys.readouterr().out

    assert tidepool(["simulate", "--trace", _trace(tmp_path / "t.jsonl"), "--profile", str(out), "--prefill", "1",
                     "--decode", "1", "--policy", "tidepool", "--ttft-slo-s", "60", "--tbt-slo-ms", "5000"]) == 0
    assert "measured-" in capsys.readouterr().out

    # A prompt of a new length, after the profile was written: its measured prefill steps against the model.
    before = len(samples["prefill_steps"])
    client = openai.OpenAI(base_url=f"{live_server.http_url}/v1", api_key="none", max_retries=0, timeout=120)
    client.completions.create(model=client.models.list().data[0].id, prompt=[20 + i % 200 for i in range(300)],
                              max_tokens=2, temperature=0.0)
    # the dispatcher reads the worker's steps with its next load report
    assert wait_until(lambda: len(_samples(live_server)["prefill_steps"]) > before, 30)
    new = np.array(_samples(live_server)["prefill_steps"][before:])
    predicted, measured = float(np.sum(new[:, :3] @ profile.prefill.coef)), float(np.sum(new[:, 3]))
    assert measured / 5 < predicted < measured * 5
