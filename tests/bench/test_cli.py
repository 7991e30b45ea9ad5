"""`tokenspeed bench` end to end against the mock server: a sweep writing JSON, JSONL and PNG; plot, export, replay."""

from __future__ import annotations

import json

import pytest

from tokenspeed.bench.mock_server import MockConfig, MockServer
from tokenspeed.bench.record import RequestRecord
from tokenspeed.bench.workloads import build
from tokenspeed.cli import main

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def server():
    with MockServer(MockConfig(step_s=0.0005, batch_slowdown=0.2)) as url:
        yield url


def test_sweep_writes_json_jsonl_png(server, tmp_path, capsys):
    argv = ["bench", "--base-url", server, "--workload", "swe-smith-like", "--scale", "0.01", "--concurrency",
            "1,2,4", "--num-gpus", "2", "--result-dir", str(tmp_path), "--result-name", "swl", "--no-progress",
            "--history", "live"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("Serving Benchmark Result") == 3 and "out tok/s/GPU" in out
    pool = build("swe-smith-like", scale=0.01).sessions
    sweep = json.loads((tmp_path / "swl.json").read_text())
    assert [p["concurrency"] for p in sweep["points"]] == [1, 2, 4]
    for conc, n_sessions in ((1, 4), (2, 8), (4, 8)):  # workloads.md's (P, N_sessions)
        doc = json.loads((tmp_path / f"swl-c{conc}.json").read_text())
        s = doc["summary"]
        assert s["requests"] == s["completed"] == sum(len(x.root.turns) for x in pool[:n_sessions])
        assert s["num_gpus"] == 2 and s["output_tok_s_per_gpu"] == pytest.approx(s["output_tok_s"] / 2)
        assert abs(s["server_cache_hit"] - s["ideal_cache_hit"]) < 0.05 and s["server_cache_hit_metrics"] is not None
        assert s["ttft_first_turn"]["count"] == n_sessions and s["valid"]
        assert doc["workload"]["name"] == "swe-smith-like" and doc["timeline"]["t_s"]
        records = [RequestRecord.from_json(line) for line in (tmp_path / f"swl-c{conc}.jsonl").read_text().splitlines()]
        assert sum(r.phase == "scored" for r in records) == s["requests"]
        assert {r.session for r in records if r.phase == "warmup"} == {68, 69}  # 2 warmup sessions at offset 68
    for png in ("swl-frontier.png", "swl-throughput.png"):
        assert (tmp_path / png).read_bytes()[:8] == PNG

    # several result files overlaid as several curves
    cmp = tmp_path / "cmp.png"
    assert main(["bench", "--plot", str(tmp_path / "swl.json"), str(tmp_path / "swl-c2.json"), "--output", str(cmp),
                 "--interpolate-at", "100"]) == 0
    assert cmp.read_bytes()[:8] == PNG


def test_dry_run_export_and_trace_replay(server, tmp_path, capsys):
    agentic = tmp_path / "agentx.jsonl"
    assert main(["bench", "--workload", "agentx-like", "--scale", "0.005", "--pool-size", "3", "--export-trace",
                 str(agentic), "--dry-run"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["sessions"] == 3 and stats["requests"] == len(agentic.read_text().splitlines())
    assert 0.8 < stats["ideal_hit_replay"]["root"] < 1  # lower than at scale 1: blocks of 64 tokens
    trace = tmp_path / "swl.jsonl"
    assert main(["bench", "--scale", "0.01", "--pool-size", "3", "--swl-shared-prefix", "2048", "--export-trace",
                 str(trace), "--dry-run"]) == 0
    capsys.readouterr()
    argv = ["bench", "--base-url", server, "--trace", str(trace), "--concurrency", "2", "--warmup", "none",
            "--result-dir", str(tmp_path), "--result-name", "rep", "--no-progress"]
    assert main(argv) == 0
    s = json.loads((tmp_path / "rep-c2.json").read_text())["summary"]
    assert s["requests"] == s["completed"] == len(trace.read_text().splitlines())
    assert abs(s["server_cache_hit"] - s["ideal_cache_hit"]) < 0.05


def test_errors_exit_2(tmp_path, capsys):
    assert main(["bench", "--base-url", "http://127.0.0.1:9", "--scale", "0.01", "--result-dir", str(tmp_path),
                 "--no-progress"]) == 2
    assert "error" in capsys.readouterr().err
    assert main(["bench", "--trace", str(tmp_path / "missing.jsonl"), "--dry-run"]) == 2
    with pytest.raises(SystemExit):
        main(["bench", "--concurrency", "0"])
