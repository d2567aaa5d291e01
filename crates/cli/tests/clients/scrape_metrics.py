"""Scrapes a node's /metrics and parses it with Prometheus's own OpenMetrics parser.

Usage: scrape_metrics.py URL
Prints one JSON object: {"content_type": ..., "samples": {"name{label=value,...}": value}}.
A parse error (the text is not valid OpenMetrics) fails with the parser's message.
"""

import json
import sys
import urllib.request

from prometheus_client.openmetrics.parser import text_string_to_metric_families


def main():
    url = sys.argv[1]
    with urllib.request.urlopen(url, timeout=10) as response:
        content_type = response.headers.get("Content-Type", "")
        text = response.read().decode("utf-8")
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    print(json.dumps({"content_type": content_type, "samples": samples}))


if __name__ == "__main__":
    main()
