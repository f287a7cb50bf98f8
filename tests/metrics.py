"""Prometheus samples scraped from a running service's /metrics page."""

from __future__ import annotations

import re
import urllib.request


def scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def value(samples: dict[str, float], pattern: str) -> float:
    """Sum of the samples whose 'name{labels}' matches the regex."""
    return sum(v for k, v in samples.items() if re.fullmatch(pattern, k))


def requests(samples: dict[str, float], model: str, api: str, outcome: str) -> float:
    """berth_gateway_requests_total of one model, API and outcome."""
    labels = "".join(
        f'(?=.*{k}="{v}")'
        for k, v in (("model", model), ("api", api), ("outcome", outcome))
    )
    return value(samples, rf"berth_gateway_requests_total\{{{labels}.*\}}")
