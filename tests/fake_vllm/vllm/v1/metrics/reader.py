from dataclasses import dataclass


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Vector(Metric):
    values: list[int]


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int]


# Process-global, like Prometheus' REGISTRY: counters keep growing across LLM instances.
REGISTRY: dict[str, int | list[int]] = {}


def get_metrics_snapshot() -> list[Metric]:
    out: list[Metric] = []
    for name, value in REGISTRY.items():
        labels = {"model_name": "fake", "engine": "0"}
        if isinstance(value, list):
            out.append(Vector(name=name, labels=labels, values=list(value)))
        else:
            out.append(Counter(name=name, labels=labels, value=int(value)))
    return out
