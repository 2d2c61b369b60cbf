"""The router's metrics: a replica's queue read off its page, and the decision counters."""

from __future__ import annotations

import subprocess
import sys

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.router.metrics import QUEUE_METRICS, RouterMetrics, queue_length
from kvserve.router.policy import Decision, Replica

PAGE = """# TYPE kvserve:num_requests_running gauge
kvserve:num_requests_running{model_name="m"} 2.0
# TYPE kvserve:num_requests_waiting gauge
kvserve:num_requests_waiting{model_name="m"} 3.0
# TYPE kvserve:prompt_tokens_total counter
kvserve:prompt_tokens_total{model_name="m"} 7.0
"""


def test_a_replicas_queue_is_its_requests_running_and_waiting() -> None:
    """Read off the page's lines, not its parse (three quarters of an idle router's CPU); the same number."""
    families = {f.name: f for f in text_string_to_metric_families(PAGE)}
    assert queue_length(PAGE) == 5 == sum(families[name].samples[0].value for name in QUEUE_METRICS)
    assert queue_length(PAGE.replace("{model_name=\"m\"}", "") + "kvserve:num_requests_running_x 9\n") == 5


@pytest.mark.parametrize("page", ["<html>502 Bad Gateway</html>", PAGE.replace(" 3.0", " NaN"),
                                  PAGE.replace(" 2.0", " +Inf"), PAGE.replace(" 2.0", " two")])
def test_a_page_without_a_readable_queue_is_refused(page: str) -> None:
    with pytest.raises(ValueError):
        queue_length(page)


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
