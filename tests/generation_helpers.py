"""Small pieces several generation tests share (no models here; see ``tiny_models`` for those).

* :func:`left_pad` - a batch of token-id lists as left-padded ``input_ids`` and ``attention_mask``.
* :class:`CollectingStreamer` - a streamer that records every token it is given, then ``"END"``.
* :func:`offered_count` - how many drafted positions a verify policy's incremental offer accepts.
"""

from __future__ import annotations

import torch
from transformers.generation.streamers import BaseStreamer


def left_pad(prompts: list[list[int]], pad_token_id: int) -> tuple[torch.LongTensor, torch.LongTensor]:
    """``prompts`` right-aligned in one ``(rows, longest)`` tensor, padded on the left with
    ``pad_token_id``, and the attention mask that is 1 on the prompt tokens only."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


class CollectingStreamer(BaseStreamer):
    """Records the tokens ``generate`` streams (the prompt first, as transformers does) in ``tokens``,
    and ``"END"`` when the stream ends, so a test can compare the stream with the output."""

    def __init__(self):
        self.tokens = []

    def put(self, value):
        self.tokens.extend(value.reshape(-1).tolist())

    def end(self):
        self.tokens.append("END")


def offered_count(policy, confidences: list[float]) -> int:
    """How many leading positions ``policy`` admits when offered ``confidences`` one at a time through
    ``policy.start_round()``, stopping at the first refusal (what ``admit`` must agree with)."""
    offer = policy.start_round()
    keep = 0
    for confidence in confidences:
        if not offer(confidence):
            break
        keep += 1
    return keep
