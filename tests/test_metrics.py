"""The /metrics endpoint: a service's final counts are read by a scrape before it exits."""

from __future__ import annotations

import threading
import time
import urllib.request

from services.orchestrator import free_ports
from shared import metrics


def test_wait_for_scrape_returns_once_a_scrape_read_the_counters_after_the_work() -> None:
    port = free_ports(1)[0]
    metrics.serve(port, addr="127.0.0.1")
    finished = time.time()
    # nobody scraped since: the wait runs out (False) after its bound
    t0 = time.monotonic()
    assert metrics.wait_for_scrape(finished, timeout=0.3) is False
    assert time.monotonic() - t0 >= 0.3

    def scrape_soon() -> None:
        time.sleep(0.2)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            assert b"fedfleet_wire_bytes_total" in r.read()

    thread = threading.Thread(target=scrape_soon)
    thread.start()
    t0 = time.monotonic()
    assert metrics.wait_for_scrape(finished, timeout=30) is True  # as soon as it happened
    assert time.monotonic() - t0 < 10
    thread.join()
    # a scrape from before the work does not count; a stop event ends the wait at once
    stop = threading.Event()
    stop.set()
    assert metrics.wait_for_scrape(time.time() + 1, timeout=30, stop=stop) is False


def test_a_scrape_that_overran_its_timeout_is_not_taken_as_read() -> None:
    """Prometheus drops a scrape that overran the timeout it states in
    ``X-Prometheus-Scrape-Timeout-Seconds``: such a page must not let a lingering service exit as if
    its final counts had landed. The next scrape that fits (or one without the header) counts."""
    port = free_ports(1)[0]
    metrics.serve(port, addr="127.0.0.1")
    finished = time.time()

    def scrape(timeout_header: str | None) -> None:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
        if timeout_header is not None:
            req.add_header("X-Prometheus-Scrape-Timeout-Seconds", timeout_header)
        with urllib.request.urlopen(req, timeout=5) as r:
            assert b"fedfleet_wire_bytes_total" in r.read()

    scrape("0.000000001")  # no page is served within a nanosecond: Prometheus gave up on it
    assert metrics.wait_for_scrape(finished, timeout=0.3) is False
    scrape("not a number")  # not Prometheus's header: counted as a plain scrape
    assert metrics.wait_for_scrape(finished, timeout=5) is True
    later = time.time()
    scrape("10")  # well within its timeout
    assert metrics.wait_for_scrape(later, timeout=5) is True
