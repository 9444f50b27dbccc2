"""`broker bench` runs every scenario next to its baseline and writes what it measured.

The figures are not asserted (speed is judged from the benchmark's report, never by a timed
test); what is asserted is that each scenario ran, or says why it did not, and the outputs exist.
"""
import json
import os
import subprocess
import sys

import pytest

from bench.cpu import GROUPS

AGAINST_PGMQ = {"send_batch to a local service", "send to a local service", "local receive, 1 reader",
                "local receive, 4 readers"}
SCENARIOS = {"local send, broker.send_batch", "local send, broker.send", *AGAINST_PGMQ,
             *{f"{name} vs pgmq" for name in AGAINST_PGMQ}, "cross-node transfer",
             "cross-node transfer vs a numbered relay over HTTP", "cross-node transfer, traced",
             "cross-node transfer, resend window",
             "cross-node latency (p50; p99 in details)", "REST send, then receive + complete",
             "RabbitMQ publish + consume", "Spark ingest",
             "Spark ingest --follow, a batch from commit to dataset", "cross-node at scale (min of the curve)",
             "send_batch to a local service, 10 a conversation vs pgmq",
             "send_batch to a local service vs the least a local send writes",
             "the least a local send writes vs pgmq",
             "activated procedure vs run_activation"}
# pgmq's SQL, when the machine has it (the bench never ships it): measured beside ours, else skipped.
PGMQ_SQL = os.environ.get("BROKER_BENCH_PGMQ_SQL")


def _bench(output, *options):
    """The bench on an embedded PostgreSQL of its own, with the durable settings it requires (the tests' own
    server runs with fsync off)."""
    environment = {name: value for name, value in os.environ.items() if name != "BROKER_DATABASE_URL"}
    return subprocess.run([sys.executable, "-m", "bench", "--output", str(output / "results"), *options],
                          capture_output=True, text=True, timeout=900,
                          env={**environment, "COLUMNS": "200"})


@pytest.mark.slow
@pytest.mark.timeout(900)  # as long as the bench itself may take: a loaded machine doubles its 90 s
def test_quick_run_measures_every_scenario_and_writes_table_json_and_charts(tmp_path):
    result = _bench(tmp_path, "--quick", "--repetitions", "1")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    document = json.loads((tmp_path / "results" / "results.json").read_text())
    assert document["environment"]["fsync"] == "on"
    scenarios = {scenario["scenario"]: scenario for scenario in document["scenarios"]}
    assert set(scenarios) == SCENARIOS
    for name, scenario in scenarios.items():
        if scenario["skipped"]:
            assert (name == "RabbitMQ publish + consume" and "5672" in scenario["skipped"]) or \
                (name.endswith(" vs pgmq") and "--pgmq-sql" in scenario["skipped"] and not PGMQ_SQL), name
            continue
        assert all(value > 0 for value in scenario["measured"]["values"]), name
        if scenario["baseline"]:
            assert scenario["ratio"] > 0, name
    assert scenarios["REST send, then receive + complete"]["details"]["error_count"] == 0
    assert scenarios["REST send, then receive + complete"]["details"]["bare_fastapi_insert_msgs_per_s"] > 0
    written = scenarios["local send, broker.send_batch"]["details"]["wal_bytes_per_message"]
    assert set(written) >= {"bare", "batch remote", "batch local", "batch local grouped", "least local"}
    assert all(bytes_per_message > 0 for bytes_per_message in written.values())
    assert scenarios["cross-node transfer, traced"]["details"]["spans_exported"] > 0
    cpu_us = scenarios["cross-node transfer"]["details"]["cpu_us_per_message"]
    assert set(cpu_us) == {*GROUPS, "all"}
    assert all(cpu_us[group] > 0 for group in ("sender's backend", "A's relay-lane backends", "B's accepting backends",
                                               "relay (Python)", "API (Python)"))
    for baseline in ("bare_relay", "numbered_relay_over_http"):
        baseline_cpu_us = scenarios["cross-node transfer"]["details"][f"{baseline}_cpu_us_per_message"]
        assert set(baseline_cpu_us) == {*GROUPS, "all"} and baseline_cpu_us["all"] > 0  # a quick run's: a few ticks
    assert set(scenarios["cross-node transfer"]["details"]["wal_bytes_per_message"]) == {
        "broker", "bare relay", "numbered relay over HTTP"}
    assert len(scenarios["cross-node at scale (min of the curve)"]["series"]["scale"]) == 5
    table = (tmp_path / "results" / "results.md").read_text()
    assert all(name in table for name in SCENARIOS)
    assert "| local send, broker.send_batch |" in result.stdout
    for chart in ("throughput.png", "latency.png", "scale.png"):
        assert (tmp_path / "results" / chart).read_bytes().startswith(b"\x89PNG"), chart


@pytest.mark.slow
def test_soak_reports_throughput_dead_tuples_memory_and_the_retained_log_over_time(tmp_path):
    result = _bench(tmp_path, "--soak", "0.25", "--soak-rate", "500", "--soak-window", "5")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (soak,) = json.loads((tmp_path / "results" / "results.json").read_text())["scenarios"]
    samples = soak["series"]["soak"]
    assert len(samples) >= 10
    assert any(sample["holding"] for sample in samples) and not samples[-1]["holding"]
    assert all(sample["relay_rss_mb"] > 0 and sample["api_rss_mb"] > 0 for sample in samples)
    assert samples[-1]["delivered"] > samples[0]["delivered"]
    assert all(sample["log_rows"] >= 0 and sample["log_mb"] > 0 for sample in samples)
    assert soak["details"]["resend_window_s"] == 5 and soak["details"]["log_rows_peak"] > 0
    assert (tmp_path / "results" / "soak.png").read_bytes().startswith(b"\x89PNG")
