"""The shipped example `deploy/prometheus/prometheus.yml`, adapted for a test.

Its scrape jobs find pods through the Kubernetes API. Debian's Prometheus (2.42) is
built without the Kubernetes service discovery (`field kubernetes_sd_configs not found
in type config.ScrapeConfig`), and no cluster runs here, so tests swap the discovery
stanza for another one and keep everything else the operator would run: job names,
`metric_relabel_configs`, rule files, intervals.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from tests.support.procs import REPO

SHIPPED = REPO / "deploy" / "prometheus" / "prometheus.yml"


def shipped() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(SHIPPED.read_text())
    return doc


def with_file_sd(doc: dict[str, Any], file: str) -> dict[str, Any]:
    """The same config with file discovery where it had Kubernetes discovery (for
    `promtool check config`: the relabel rules are checked as written)."""
    out = copy.deepcopy(doc)
    for job in out["scrape_configs"]:
        if job.pop("kubernetes_sd_configs", None) is not None:
            job["file_sd_configs"] = [{"files": [file]}]
        _without_cluster_secret(job)
    return out


def _without_cluster_secret(job: dict[str, Any]) -> None:
    """The gateway job's scrape credential is a file from a cluster Secret, which does not
    exist here (promtool checks that it does); the test gateways run without tenants, so
    their /metrics is public."""
    job.pop("authorization", None)


def with_static_targets(
    doc: dict[str, Any], targets: dict[str, list[tuple[str, str]]]
) -> dict[str, Any]:
    """The same config scraping loopback targets: job -> [(host:port, metrics_path)].

    The `relabel_configs` select pods by Kubernetes metadata a static target lacks, so
    they go; the `metric_relabel_configs`, which decide the names Prometheus stores, stay.
    A job with two paths becomes one job per path, under the same job name label.
    """
    out = copy.deepcopy(doc)
    jobs = []
    for job in out["scrape_configs"]:
        job.pop("kubernetes_sd_configs", None)
        job.pop("relabel_configs", None)
        _without_cluster_secret(job)
        paths: dict[str, list[str]] = {}
        for address, path in targets.get(job["job_name"], []):
            paths.setdefault(path, []).append(address)
        for i, (path, addresses) in enumerate(sorted(paths.items())):
            copy_ = copy.deepcopy(job)
            copy_["metrics_path"] = path
            copy_["static_configs"] = [{"targets": addresses}]
            if i:
                # Prometheus wants unique job names; relabel the copy back to the name.
                name = copy_["job_name"]
                copy_["job_name"] = f"{name}-{i}"
                copy_["relabel_configs"] = [{"target_label": "job", "replacement": name}]
            jobs.append(copy_)
    out["scrape_configs"] = jobs
    return out
