"""Serving-benchmark scenarios: the workloads of the Qwen3-Coder EAGLE3 benchmark, scalable for CPU.

A scenario fixes how many prompts, their input length (for random-token prompts; conversation
prompts keep their own length), the output length, the arrival process (request rate in req/s,
`inf` = all at once; otherwise Poisson arrivals as sglang.bench_serving) and the client's
concurrency cap.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True)
class Scenario:
    name: str
    num_prompts: int
    input_len: int
    output_len: int
    request_rate: float = math.inf  # req/s; inf sends all requests at once
    max_concurrency: int | None = None  # None: no cap

    def __post_init__(self):
        for key in ("num_prompts", "input_len", "output_len"):
            if getattr(self, key) < 1:
                raise ValueError(f"scenario {self.name}: {key} must be >= 1, got {getattr(self, key)}")
        if not self.request_rate > 0:
            raise ValueError(f"scenario {self.name}: request_rate must be > 0 (inf for all at once)")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"scenario {self.name}: max_concurrency must be >= 1 or None")

    def scaled(self, num_prompts: int | None = None, input_len: int | None = None,
               output_len: int | None = None, request_rate: float | None = None,
               max_concurrency: int | None = None) -> "Scenario":
        """The same scenario with some sizes overridden (None keeps the preset's value), e.g. a
        CPU-sized `chat`: SCENARIOS["chat"].scaled(num_prompts=8, output_len=32)."""
        changes = {k: v for k, v in dict(num_prompts=num_prompts, input_len=input_len,
                                         output_len=output_len, request_rate=request_rate,
                                         max_concurrency=max_concurrency).items() if v is not None}
        return replace(self, **changes)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["request_rate"] = "inf" if math.isinf(self.request_rate) else self.request_rate
        return d


SCENARIOS = {
    "code": Scenario("code", num_prompts=128, input_len=512, output_len=1024,
                     request_rate=math.inf, max_concurrency=64),
    "chat": Scenario("chat", num_prompts=128, input_len=256, output_len=256,
                     request_rate=8.0, max_concurrency=32),
    "completion": Scenario("completion", num_prompts=256, input_len=1024, output_len=128,
                           request_rate=math.inf, max_concurrency=128),
}


def get_scenario(name: str) -> Scenario:
    try:
        return SCENARIOS[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name!r}; known: {sorted(SCENARIOS)}") from None
