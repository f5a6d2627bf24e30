"""StreamingLLM: Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024,
arXiv:2309.17453.

Signal: position only. Keeps a few initial "attention sink" tokens and the most recent tokens.
"""

import torch

from kvsieve.policy import Policy
from kvsieve.selection import Selection
from kvsieve.signals import Signals


class StreamingLLM(Policy):
    name = "streaming_llm"
    uses_window = False

    def __init__(self, sink: int = 4, **kwargs) -> None:
        self.sink = sink
        super().__init__(**kwargs)

    def default_selection(self) -> Selection:
        return Selection(sink=self.sink)

    def score(self, signals: Signals) -> torch.Tensor:
        return signals.positions.float()
