"""What the server holds for its whole life: one model, its point source, the scheduler and the metrics."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from kvsieve.serve.contexts import CONTEXT_SCOPES
from kvsieve.serve.points import PointSource
from kvsieve.serve.reading import DEFAULT_READ_TIMEOUT
from kvsieve.serve.scheduler import Scheduler
from kvsieve.serve.server_metrics import Metrics

__all__ = ["ServerState"]


@dataclass
class ServerState:
    model: object
    tokenizer: object
    model_name: str  # the id clients send and /v1/models lists (a bundled model's canonical name)
    points: PointSource
    scheduler: Scheduler
    context_length: int  # prompt + generated tokens the model may hold
    max_tokens_limit: int = 2048  # the most tokens one request may generate
    default_max_tokens: int = 256  # when the request names none (capped by what the context leaves)
    max_body_bytes: int = 4 << 20  # a larger request body is refused (413) before it is read
    metrics: Metrics = field(default_factory=Metrics)
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    read_timeout: float = DEFAULT_READ_TIMEOUT  # seconds a request's head, then its body, may take to arrive (408)
    context_scope: str = "shared"  # stored contexts reused by every client, or only by the client's API key

    def __post_init__(self) -> None:
        if self.context_scope not in CONTEXT_SCOPES:
            raise ValueError(f"context_scope {self.context_scope!r} is not one of {', '.join(CONTEXT_SCOPES)}")
        for name in ("context_length", "max_tokens_limit", "default_max_tokens", "max_body_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        timeout = self.read_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not (math.isfinite(timeout)
                                                                                     and timeout > 0):
            raise ValueError(f"read_timeout must be a finite number of seconds > 0, got {timeout!r}")
