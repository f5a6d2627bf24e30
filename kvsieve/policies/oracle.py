"""Oracle reference line (never a policy for real use): keeps what the answer depends on.

Signal: the sample's answer spans (needle sentences, chain statements, ...) mapped to token
positions by the harness, plus the chat-template/instruction tokens before the context and a few
sinks; the rest of the budget goes to the most recent tokens. It answers whether the model or the
policies are the limit at a given budget.
"""

from __future__ import annotations

import torch

from kvsieve.policy import Policy
from kvsieve.selection import Selection
from kvsieve.signals import Signals


class Oracle(Policy):
    name = "oracle"
    uses_window = False
    is_reference = True
    needs_spans = True

    def __init__(self, important_positions: list[int] | None = None, sink: int = 4, **kwargs) -> None:
        self.important_positions = sorted(set(important_positions or []))
        self.sink = sink
        super().__init__(**kwargs)

    def default_selection(self) -> Selection:
        return Selection(sink=self.sink)

    def score(self, signals: Signals) -> torch.Tensor:
        positions = signals.positions
        scores = positions.float() / (positions.amax().float() + 1)  # recent first, in [0, 1)
        if self.important_positions:
            wanted = torch.tensor(self.important_positions, device=positions.device)
            important = torch.isin(positions, wanted)
            scores = scores + 2.0 * important  # answer spans before anything recent
        return scores
