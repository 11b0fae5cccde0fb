"""Exact stopping for decoding loops that append several tokens per step.

Plain ``generate`` checks its stopping criteria after every token. A speculative round appends a
whole accepted block at once, and transformers' assisted loop checks the criteria only on the
block's end, so a stop string or custom criterion that fires inside the block is missed. The
helpers here find, for each row, the first new position at which the call's criteria fire, so the
caller can cut there and return exactly what plain ``generate`` would have returned.

Criteria are evaluated on every prefix ``sequence[:L]`` the plain loop would have seen: a
criterion that is a function of the sequence (and scores) gives the same answer as with plain
generate. ``MaxTimeCriteria`` is a clock, not a position: it is checked once per step on the whole
sequence, as transformers' loop does, and never cuts a step's tokens.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    MaxTimeCriteria,
    StoppingCriteria,
    StopStringCriteria,
)
from transformers.generation.streamers import BaseStreamer


def positional_criteria(criteria, generation_config: GenerationConfig) -> list[StoppingCriteria]:
    """The criteria a multi-token step must check at every new position.

    Left out: ``MaxTimeCriteria`` (a clock) and the EOS and max-length criteria that the DSpark
    loops (transformers' assisted loop and the batched one) already enforce inside each step,
    since both cut at ``generation_config``'s EOS ids and ``max_length``. An empty list means the
    loop needs no per-position check, so the common call (EOS and length only) costs nothing.
    """
    eos = generation_config._eos_token_tensor
    eos_ids = set(eos.flatten().tolist()) if eos is not None else set()
    kept = []
    for criterion in criteria or []:
        kind = type(criterion)
        if kind is MaxTimeCriteria:
            continue
        if kind is MaxLengthCriteria and criterion.max_length >= generation_config.max_length:
            continue
        if kind is EosTokenCriteria and set(criterion.eos_token_id.flatten().tolist()) <= eos_ids:
            continue
        kept.append(criterion)
    return kept


def _as_row_flags(result, rows: int) -> torch.Tensor:
    """A criterion's answer as ``rows`` booleans (criteria may return a bool or a (rows,) tensor)."""
    flags = torch.as_tensor(result).to(dtype=torch.bool, device="cpu").flatten()
    return flags.expand(rows) if flags.numel() == 1 else flags


def first_stops(criteria: list[StoppingCriteria], sequences: list[torch.Tensor], starts: list[int],
                scores: tuple[torch.Tensor, ...] | None = None, prompt_len: int = 0,
                filler: int = 0) -> list[int | None]:
    """For each row ``r``: the smallest length ``L`` with ``starts[r] < L <= len(sequences[r])`` at
    which any criterion fires on ``sequences[r][:L]``, or None.

    ``sequences`` are 1-D token tensors (each row's whole sequence, prompt included, as the plain
    loop would pass it). ``scores``, when given (batch 1 with ``output_scores``), holds one entry
    per generated token; a prefix of length ``L`` sees the first ``L - prompt_len`` of them.
    Criteria are checked in increasing ``L`` and never past a row's earliest stop found so far:
    at most one call per new position for a generic criterion, one call in all for stop strings.
    Rows with nothing to check get ``starts[r] == len(sequences[r])``.
    """
    rows = len(sequences)
    limits = [seq.shape[-1] for seq in sequences]  # last length still to check per row
    found: list[int | None] = [None] * rows

    def record(r: int, length: int) -> None:
        found[r] = length
        limits[r] = length - 1

    for criterion in sorted(criteria, key=lambda c: type(c) not in (MaxLengthCriteria, EosTokenCriteria,
                                                                    StopStringCriteria)):
        kind = type(criterion)
        if kind is MaxLengthCriteria:
            for r in range(rows):
                length = max(starts[r] + 1, criterion.max_length)
                if length <= limits[r]:
                    record(r, length)
        elif kind is EosTokenCriteria:
            for r in range(rows):
                new = sequences[r][starts[r]: limits[r]]
                hits = torch.isin(new, criterion.eos_token_id.to(new.device)).nonzero()
                if hits.numel():
                    record(r, starts[r] + int(hits[0, 0]) + 1)
        elif kind is StopStringCriteria:
            _stop_strings(criterion, sequences, starts, limits, record)
        else:
            _generic(criterion, sequences, starts, limits, record, scores, prompt_len, filler)
    return found


def _stop_strings(criterion: StopStringCriteria, sequences, starts, limits, record) -> None:
    """StopStringCriteria reads only the last ``maximum_token_len`` tokens, so every (row, prefix)
    becomes one window row of a single batched call."""
    width = criterion.maximum_token_len
    windows, owners = [], []
    for r, seq in enumerate(sequences):
        for length in range(starts[r] + 1, limits[r] + 1):
            # Windows of a prefix shorter than `width` would differ in length: such prefixes (a
            # prompt shorter than the longest stop string) are checked alone.
            windows.append(seq[max(0, length - width): length])
            owners.append((r, length))
    if not windows:
        return
    full = [i for i, w in enumerate(windows) if w.shape[0] == width]
    fired = torch.zeros(len(windows), dtype=torch.bool)
    if full:
        fired[full] = _as_row_flags(criterion(torch.stack([windows[i] for i in full]), None), len(full))
    for i, w in enumerate(windows):
        if w.shape[0] != width:
            fired[i] = bool(_as_row_flags(criterion(w[None], None), 1)[0])
    for i in fired.nonzero().flatten().tolist():
        r, length = owners[i]
        if length <= limits[r]:  # owners are in increasing length per row: the first hit wins
            record(r, length)


def _generic(criterion: StoppingCriteria, sequences, starts, limits, record, scores, prompt_len, filler) -> None:
    """Any other criterion: one call per prefix length over the whole batch, row r at index r as in
    plain generate (rows with nothing to check at that length are passed along, their answer unused;
    a row shorter than the length is padded with ``filler``)."""
    rows = len(sequences)
    active = [r for r in range(rows) if starts[r] < limits[r]]
    if not active:
        return
    for length in range(min(starts[r] for r in active) + 1, max(limits[r] for r in active) + 1):
        need = [r for r in range(rows) if starts[r] < length <= limits[r]]
        if not need:
            continue
        batch = torch.stack([seq[:length] if seq.shape[0] >= length
                             else torch.cat([seq, seq.new_full((length - seq.shape[0],), filler)])
                             for seq in sequences])
        prefix_scores = scores[: length - prompt_len] if scores is not None else None
        flags = _as_row_flags(criterion(batch, prefix_scores), rows)
        for r in need:
            if flags[r]:
                record(r, length)


class DeferredStreamer(BaseStreamer):
    """Holds a step's tokens until its stop check has run, then passes on only those before the stop."""

    def __init__(self, streamer: BaseStreamer):
        self.streamer = streamer
        self.pending: list[torch.Tensor] = []
        self.stopped = False  # after the stop (synced_gpus keeps the loop running) nothing more is sent

    def put(self, value: torch.Tensor) -> None:
        if not self.stopped:
            self.pending.append(value)

    def flush(self, drop: int = 0, stop: bool = False) -> None:
        """Sends the held tokens less the last ``drop`` (those past a stop)."""
        if self.pending:
            tokens = torch.cat([t.reshape(1, -1) for t in self.pending], dim=-1)
            self.pending = []
            keep = tokens.shape[-1] - drop
            if keep > 0:
                self.streamer.put(tokens[:, :keep])
        self.stopped = self.stopped or stop

    def end(self) -> None:
        self.flush()
        self.streamer.end()


class ExactStopping(StoppingCriteria):
    """Stands in for a batch-1 call's stopping criteria inside transformers' assisted loop.

    Called once per round on the whole sequence: it runs the criteria the loop would run
    (``MaxTimeCriteria`` included) on that sequence, and the positional ones on every prefix the
    round added. On a stop inside the round it records ``stop_length`` and ends the loop; the
    caller then cuts the output there (:func:`cut_output`). A :class:`DeferredStreamer`, if given,
    receives the round's tokens only up to the stop.
    """

    def __init__(self, criteria, positional: list[StoppingCriteria], prompt_len: int,
                 streamer: DeferredStreamer | None = None):
        positional_ids = {id(c) for c in positional}
        self.whole = [c for c in criteria if id(c) not in positional_ids]
        self.positional = positional
        self.prompt_len = prompt_len
        self.checked = prompt_len
        self.stop_length: int | None = None
        self.streamer = streamer

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        length = input_ids.shape[1]
        done = False
        for criterion in self.whole:
            done = bool(_as_row_flags(criterion(input_ids, scores, **kwargs), 1).any()) or done
        if self.stop_length is None and length > self.checked:
            stop = first_stops(self.positional, [input_ids[0]], [self.checked], scores, self.prompt_len)[0]
            if stop is not None:
                self.stop_length, done = stop, True
        if self.streamer is not None and not self.streamer.stopped:
            stopped = self.stop_length is not None
            self.streamer.flush(drop=length - self.stop_length if stopped else 0, stop=stopped)
        self.checked = length
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


def cut_output(output, stop_length: int, prompt_len: int):
    """Cuts ``generate``'s result (a tensor or a ``GenerateDecoderOnlyOutput``) to ``stop_length``
    tokens: the sequence, the per-token tuples (scores, logits, attentions, hidden states) and
    the returned cache, which then holds all but the last token, as after plain generate."""
    if isinstance(output, torch.Tensor):
        return output[:, :stop_length]
    removed = output.sequences.shape[1] - stop_length
    if removed <= 0:
        return output
    output.sequences = output.sequences[:, :stop_length]
    for name in ("scores", "logits", "attentions", "hidden_states"):
        value = getattr(output, name, None)
        if value is not None:
            setattr(output, name, value[: stop_length - prompt_len])
    cache = getattr(output, "cache", None)
    if cache is not None and hasattr(cache, "crop"):
        cache.crop(-removed)
    return output


__all__ = ["DeferredStreamer", "ExactStopping", "cut_output", "first_stops", "positional_criteria"]
