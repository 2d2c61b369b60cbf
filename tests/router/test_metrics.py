"""The router's metrics: a replica's queue read off its page, and the decision counters."""

from __future__ import annotations

import subprocess
import sys

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.router.metrics import RouterMetrics, queue_length
from kvserve.router.policy import Decision, Replica

PAGE = """# TYPE kvserve:num_requests_running gauge
kvserve:num_requests_running{model_name="m"} 2.0
# TYPE kvserve:num_requests_waiting gauge
kvserve:num_requests_waiting{model_name="m"} 3.0
# TYPE kvserve:prompt_tokens_total counter
kvserve:prompt_tokens_total{model_name="m"} 7.0
"""


def test_a_replicas_queue_is_its_requests_running_and_waiting() -> None:
    assert queue_length(list(text_string_to_metric_families(PAGE))) == 5
    assert queue_length([]) == 0


def test_a_decision_counts_its_request_prefix_hits_and_reason() -> None:
    metrics = RouterMetrics()
    replica = Replica("http://a:1")
    metrics.count(Decision(replica, "prefix", matched_chunks=3))
    metrics.set_health(replica.url, False)
    text = generate_latest(metrics.registry).decode()
    assert 'kvserve_router:requests_total{replica="http://a:1"} 1.0' in text
    assert 'kvserve_router:prefix_hit_chunks_total{replica="http://a:1"} 3.0' in text
    assert 'kvserve_router:decisions_total{reason="prefix"} 1.0' in text
    assert 'kvserve_router:replica_healthy{replica="http://a:1"} 0.0' in text


def test_the_page_has_no_created_series_as_the_servers_has_none() -> None:
    # a process of its own: prometheus_client's switch is global, and a server's metrics in this one may have set it
    script = ("from prometheus_client import generate_latest\n"
              "from kvserve.router.metrics import RouterMetrics\n"
              "from kvserve.router.policy import Decision, Replica\n"
              "metrics = RouterMetrics()\n"
              "metrics.count(Decision(Replica('http://a:1'), 'prefix', matched_chunks=3))\n"
              "print(generate_latest(metrics.registry).decode())\n")
    page = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert 'kvserve_router:requests_total{replica="http://a:1"} 1.0' in page
    assert "_created" not in page
