"""`tidepool status`: the table it prints from a cluster status, and its one-line error when nothing answers."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from router.loads import WorkerLoad
from router.worker_speed import WorkerSpeeds
from services.cluster_status import lora_summary, worker_rows
from services.local_redis import free_port
from services.status import add_status_parser, render_status

STATUS = {
    "model": "tiny",
    "policy": "tidepool",
    "kv_transport": "grpc",
    "redis": {"url": "redis://:***@10.0.0.10:6380/0", "up": True, "indexed_blocks": 4096},
    "router": {"policy": "tidepool", "rejections": 3},
    "workers": [
        {"id": "prefill-0", "role": "prefill", "alive": True, "node": "10.0.0.11", "device": "cuda",
         "waiting": 2, "running": 1, "free_blocks": 750, "total_blocks": 1000, "prefill_time_ratio": 1.8,
         "decode_time_ratio": 1.0, "report_age_s": 0.031},
        {"id": "decode-0", "role": "decode", "alive": True, "node": "10.0.0.21", "device": "cuda",
         "waiting": 0, "running": 12, "free_blocks": 600, "total_blocks": 1000},
        {"id": "decode-1", "role": "decode", "alive": False, "node": "10.0.0.22", "device": "cuda",
         "waiting": None, "running": None, "free_blocks": None, "total_blocks": 1000},
    ],
}


def _rows(text: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split() for line in text.splitlines() if line.split()[:1]
            and line.split()[0] in {w["id"] for w in STATUS["workers"]}}


@pytest.mark.timeout(60)
def test_table_shows_each_worker_role_node_device_queue_kv_blocks_step_times_and_report_age():
    rows = _rows(render_status(STATUS))
    assert rows["prefill-0"] == ["prefill-0", "prefill", "10.0.0.11", "cuda", "2/1", "250/1000", "(25%)",
                                 "1.80/1.00", "0.03s", "alive"]
    # an older gateway's rows have no step times nor report ages
    assert rows["decode-0"] == ["decode-0", "decode", "10.0.0.21", "cuda", "0/12", "400/1000", "(40%)", "-", "-",
                                "alive"]


@pytest.mark.timeout(60)
def test_decode_row_counts_reservations_waiting_for_blocks_as_waiting_and_shows_a_drain():
    """A decode worker queues no prefills; what waits for it is leases waiting for free blocks."""
    def worker(wid: str, role: str) -> SimpleNamespace:
        return SimpleNamespace(worker_id=wid, role=role, info=SimpleNamespace(node="n", device="cpu"))
    dispatcher = SimpleNamespace(
        workers={"p": worker("p", "prefill"), "d": worker("d", "decode")},
        loads={"p": WorkerLoad("p", "prefill", queued_prefills=[(100, 0), (50, 16)], total_blocks=64),
               "d": WorkerLoad("d", "decode", num_running=3, free_blocks=2, total_blocks=64,
                               waiting_leases=2, waiting_lease_blocks=20)},
        draining={"d"}, conductor=SimpleNamespace(prefill_speeds=WorkerSpeeds(warmup=1), decode_speeds=WorkerSpeeds()),
        report_age_s={"p": 0.2}.get)
    dispatcher.conductor.prefill_speeds.observe("p", predicted_s=0.5, measured_s=1.0)
    rows = {row["id"]: row for row in worker_rows(dispatcher)}
    assert (rows["p"]["prefill_time_ratio"], rows["p"]["decode_time_ratio"], rows["d"]["prefill_time_ratio"]) == (
        2.0, 1.0, 1.0)
    assert (rows["p"]["waiting"], rows["p"]["waiting_leases"], rows["p"]["draining"]) == (2, 0, False)
    assert (rows["p"]["report_age_s"], rows["d"]["report_age_s"]) == (0.2, None)
    assert (rows["d"]["waiting"], rows["d"]["waiting_leases"], rows["d"]["running"]) == (2, 2, 3)
    table = render_status({"workers": list(rows.values())}).splitlines()
    assert rows["d"]["draining"] and next(line for line in table if line.startswith("d ")).endswith(" draining")


@pytest.mark.timeout(60)
def test_lora_adapters_slots_and_running_adapters_are_shown():
    dispatcher = SimpleNamespace(loras={"kelp": "kelp@1", "crab": "crab@2"}, loads={
        "p": WorkerLoad("p", "prefill", max_loras=3, running_loras=("kelp",)),
        "d": WorkerLoad("d", "decode", max_loras=3, running_loras=("crab", "kelp")),
        "gone": WorkerLoad("gone", "decode", alive=False, running_loras=("clam",))})
    lora = lora_summary(dispatcher)
    assert lora == {"adapters": ["crab", "kelp"], "slots": 3, "running": ["crab", "kelp"]}
    assert "lora    adapters crab, kelp   3 slots a worker   running crab, kelp" in render_status({**STATUS, "lora": lora})
    assert "lora" not in render_status(STATUS)
    assert lora_summary(SimpleNamespace(loras={}, loads={"p": WorkerLoad("p", "prefill")})) is None


@pytest.mark.timeout(60)
def test_dead_worker_is_marked_dead_not_healthy():
    text = render_status(STATUS)
    dead = _rows(text)["decode-1"]
    assert dead[-1] == "DEAD" and "alive" not in dead
    assert "3 workers: 2 alive, 1 dead" in text


@pytest.mark.timeout(60)
def test_redis_and_router_state_are_shown():
    text = render_status(STATUS)
    assert "redis://:***@10.0.0.10:6380/0   up   4096 indexed blocks" in text
    assert "router  policy tidepool   3 rejections" in text
    down = render_status({**STATUS, "redis": {**STATUS["redis"], "up": False}})
    assert "DOWN" in down.splitlines()[1]


@pytest.mark.timeout(60)
def test_connection_refused_is_one_line_and_exit_1(capsys):
    parser = argparse.ArgumentParser(prog="tidepool")
    add_status_parser(parser.add_subparsers(dest="command", required=True))
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    args = parser.parse_args(["status", "--url", url])
    assert args.func(args) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("tidepool status: cannot connect to " + url)
