from dataclasses import dataclass, field


@dataclass
class RequestSpecDecodeMetrics:
    num_spec_tokens: int
    histogram: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    per_step_accepted: list[int] = field(default_factory=list)
    per_step_drafted: list[int] = field(default_factory=list)

    @classmethod
    def new(cls, num_spec_tokens: int) -> "RequestSpecDecodeMetrics":
        return cls(num_spec_tokens=num_spec_tokens, histogram=[0] * (num_spec_tokens + 1))

    def observe(self, num_draft_tokens: int, num_accepted: int, detailed: bool = False) -> None:
        self.histogram[num_accepted] += 1
        self.num_draft_tokens += num_draft_tokens
        if detailed:
            self.per_step_accepted.append(num_accepted)
            self.per_step_drafted.append(num_draft_tokens)
