"""End to end: `tokenmill bench` against a real `tokenmill serve` on a tiny model."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tokenmill.cli import main
from tokenmill.utils.proc import ServiceProcess, free_port

SHAPE = ["--turns", "3", "--first-turn-tokens", "96", "--new-tokens", "24", "--output-tokens", "6",
         "--shared-prompt-tokens", "32", "--tool-think-median", "0.02", "--user-turn-prob", "0.0", "--no-progress"]


@pytest.fixture(scope="module")
def agentic_run(tiny_server: ServiceProcess, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bench-out") / "tokenmill"
    rc = main(["bench", "--base-url", tiny_server.base_url, "--concurrency", "1,2", "--sessions", "3",
               "--flush-cache", "--label", "tokenmill-tiny", "--out", str(out), *SHAPE])
    assert rc == 0
    return out


def test_all_files_written(agentic_run: Path) -> None:
    for name in ("results.json", "results.csv", "requests.jsonl", "pareto.png", "ttft_cdf.png"):
        f = agentic_run / name
        assert f.exists() and f.stat().st_size > 0, name
    assert (agentic_run / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads((agentic_run / "results.json").read_text())
    assert doc["endpoint"]["label"] == "tokenmill-tiny" and doc["endpoint"]["model"] == "tiny"
    assert doc["workload"]["kind"] == "agentic" and doc["workload"]["first_turn_tokens"] == 96
    assert [r["concurrency"] for r in doc["runs"]] == [1, 2]
    with open(agentic_run / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["concurrency"]) for r in rows] == [1, 2]
    for r in doc["runs"]:
        assert r["valid"] and r["errors"] == 0
        assert r["num_requests"] == 3 * 3                    # 3 sessions x 3 turns
        assert r["output_tokens"] == r["planned_output_tokens"] == 9 * 6   # ignore_eos honoured
        for key in ("ttft_p99_s", "itl_p50_s", "tpot_mean_s", "e2e_latency_p90_s", "output_tokens_per_s_per_user",
                    "output_tokens_per_s_per_user_by_concurrency", "input_tokens_per_s", "total_tokens_per_s",
                    "total_tokens_per_s_per_device", "littles_law_concurrency"):
            assert r[key] is not None and r[key] > 0, key
        assert r["littles_law_concurrency"] <= r["concurrency"] * 1.05
        assert len(r["ttft_samples_s"]) == r["num_ok"]


def test_measured_chr_positive_and_at_most_theoretical(agentic_run: Path) -> None:
    doc = json.loads((agentic_run / "results.json").read_text())
    for r in doc["runs"]:
        assert r["flushed_before"] is True
        assert 0 < r["cache_hit_rate"] <= r["cache_hit_rate_theoretical"] <= 1
    # per request: the server's prompt length is exactly the planned closed-loop length
    reqs = [json.loads(line) for line in (agentic_run / "requests.jsonl").read_text().splitlines()]
    by_turn = {}
    for q in reqs:
        if q["branch"] == 0:
            by_turn.setdefault(q["turn"], set()).add(q["prompt_tokens"])
    assert by_turn == {0: {128}, 1: {128 + 6 + 24}, 2: {128 + 2 * (6 + 24)}}


def test_session_header_reaches_server(agentic_run: Path, tiny_server: ServiceProcess) -> None:
    doc = json.loads((agentic_run / "results.json").read_text())
    assert all(r["session_header_echo_rate"] == 1.0 for r in doc["runs"])
    reqs = [json.loads(line) for line in (agentic_run / "requests.jsonl").read_text().splitlines()]
    sessions = {q["session_id"] for q in reqs}
    assert len(sessions) == 6                                # fresh sessions per level
    log = tiny_server.log_tail(10**7)
    for sid in sessions:
        assert f"session={sid} " in log, sid


def test_compare_two_runs(agentic_run: Path, tiny_server: ServiceProcess, tmp_path: Path,
                          capsys: pytest.CaptureFixture[str]) -> None:
    other = tmp_path / "nosession"
    rc = main(["bench", "--base-url", tiny_server.base_url + "/v1", "--concurrency", "2", "--sessions", "2",
               "--no-session-header", "--prompt-format", "text", "--label", "text-format", "--out", str(other), *SHAPE])
    assert rc == 0
    run = json.loads((other / "results.json").read_text())["runs"][0]
    assert run["session_header_echo_rate"] is None and run["valid"]
    assert 0 < run["cache_hit_rate"] <= run["cache_hit_rate_theoretical"]
    capsys.readouterr()
    chart = tmp_path / "cmp.png"
    assert main(["bench", "compare", str(agentic_run), str(other), "--out", str(chart)]) == 0
    text = capsys.readouterr().out
    assert "baseline: tokenmill-tiny" in text and "text-format" in text
    assert "output_tokens_per_s" in text and "1.00x" in text
    assert chart.exists() and chart.stat().st_size > 0


def test_trace_replay_against_server(tiny_server: ServiceProcess, tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    lines = [{"timestamp": 0, "input_length": 1024, "output_length": 64, "hash_ids": [0, 1]},
             {"timestamp": 10, "input_length": 1500, "output_length": 64, "hash_ids": [0, 1, 2]},
             {"timestamp": 20, "input_length": 2048, "output_length": 64, "hash_ids": [0, 1, 2, 3]},
             {"timestamp": 30, "input_length": 900, "output_length": 64, "hash_ids": [0, 7]}]
    trace.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "trace-out"
    rc = main(["bench", "--base-url", tiny_server.base_url, "--workload", "trace", "--trace", str(trace),
               "--block-tokens", "32", "--time-scale", "10", "--concurrency", "1", "--flush-cache",
               "--no-progress", "--out", str(out)])
    assert rc == 0
    run = json.loads((out / "results.json").read_text())["runs"][0]
    assert run["num_requests"] == 4 and run["valid"]
    assert run["prompt_tokens"] == 64 + (64 + 30) + 128 + (32 + 24)   # tails 476 -> 30, 388 -> 24
    assert run["output_tokens"] == 4 * 4                  # 64 * 32 / 512
    assert 0 < run["cache_hit_rate"] <= run["cache_hit_rate_theoretical"]


def test_unreachable_server_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "--base-url", f"http://127.0.0.1:{free_port()}", "--concurrency", "1", "--no-progress",
               "--timeout", "5"])
    assert rc == 2
    assert "cannot list models" in capsys.readouterr().err


def test_bad_arguments_are_clear_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--workload", "trace", "--no-progress"]) == 2
    assert "--trace" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--concurrency", "0,2"])
    assert main(["bench", "compare", "/nonexistent-dir"]) == 2
    assert "cannot read" in capsys.readouterr().err
