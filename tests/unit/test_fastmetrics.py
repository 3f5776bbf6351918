"""The lock-free histogram renders exactly what prometheus_client's own Histogram does."""

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from seawall.fastmetrics import FastHistogram

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0)


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            if not s.name.endswith("_created"):
                out[(s.name, tuple(sorted(s.labels.items())))] = round(s.value, 9)
    return out


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b"]), st.sampled_from([*BUCKETS, 0.0, 0.003, 0.07, 2.0, 30.0])
        )
    )
)
def test_same_exposition_as_prometheus_client(observations: list[tuple[str, float]]) -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    fast = FastHistogram("itl_seconds", "doc", ["model"], BUCKETS, ours)
    slow = Histogram("itl_seconds", "doc", ["model"], buckets=BUCKETS, registry=theirs)
    for model, value in observations:
        fast.labels(model).observe(value)
        slow.labels(model).observe(value)
    assert samples(ours) == samples(theirs)
