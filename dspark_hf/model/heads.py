"""DSpark's two small heads on top of the parallel backbone, and the confidence arithmetic.

* :class:`MarkovHead`: the serial sampling bias ``B_k`` from the previously drawn token (paper
  eqs. 5 and 6), added to the backbone's base logits position by position.
* :class:`ConfidenceHead`: ``c_k``, the probability that draft position ``k`` is accepted given
  that positions ``1..k-1`` were, read from the hidden state and the PREVIOUS token only.

The confidence of a position is computed the same way everywhere (the serial loop, the CUDA op's
dispatch, calibration and training): :func:`confidence_logits` forms the head's input, and
:func:`calibrated_confidences` applies the per-position temperatures of Sequential Temperature
Scaling and the sigmoid.
"""

from __future__ import annotations

import torch
from torch import nn

from .configuration_dspark import DSparkConfig

__all__ = ["ConfidenceHead", "MarkovHead", "calibrated_confidences", "confidence_logits"]


class MarkovHead(nn.Module):
    """Serial sampling bias ``B_k`` from the previously drawn token (paper eqs. 5 and 6).

    * ``vanilla``: ``B = W2(W1[x_{k-1}])``.
    * ``gated``: ``B = W2(sigmoid(gate_proj([h_k; W1[x_{k-1}]])) * W1[x_{k-1}])``.
    * ``rnn``: ``z = [s_{k-1}; W1[x_{k-1}]; h_k]``, one projection split into gate g, candidate c and
      output o; ``s_k = sigmoid(g) * s_{k-1} + (1 - sigmoid(g)) * tanh(c)``, ``B = W2(tanh(o))``.
    """

    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.head_type = config.markov_head_type
        self.rank = config.markov_rank
        self.markov_w1 = nn.Embedding(config.vocab_size, config.markov_rank)
        # N-wide for a reduced draft vocabulary (dspark_hf.model.draft_vocab); W1 reads any previous token
        self.markov_w2 = nn.Linear(config.markov_rank, config.draft_vocab_size or config.vocab_size, bias=False)
        if self.head_type == "gated":
            self.gate_proj = nn.Linear(config.hidden_size + config.markov_rank, config.markov_rank)
        elif self.head_type == "rnn":
            self.joint_proj = nn.Linear(2 * config.markov_rank + config.hidden_size, 3 * config.markov_rank)

    def initial_state(self, batch_size: int, device, dtype) -> torch.Tensor | None:
        if self.head_type != "rnn":
            return None
        return torch.zeros(batch_size, self.rank, device=device, dtype=dtype)

    def step(
        self, prev_tokens: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Bias over the vocabulary for one position. prev_tokens (R,), hidden (R, d) -> (R, V), new state."""
        return self.bias_from_feature(self.markov_w1(prev_tokens), hidden, state)

    def bias_from_feature(
        self, feature: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`step` from the previous token's feature ``W1[x_{k-1}]`` (R, rank), already looked up."""
        if self.head_type == "vanilla":
            return self.markov_w2(feature), state
        if self.head_type == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, feature], dim=-1)))
            return self.markov_w2(gate * feature), state
        gate, candidate, output = self.joint_proj(torch.cat([state, feature, hidden], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1 - gate) * torch.tanh(candidate)
        return self.markov_w2(torch.tanh(output)), state


class ConfidenceHead(nn.Module):
    """``c_k = sigmoid((w . [h_k; W1[x_{k-1}]] + b) / T_k)``: P(position k accepted | 1..k-1 accepted).

    It reads the PREVIOUS token only, so ``c_k`` is known before ``x_k`` is drawn; that is what keeps
    the prefix scheduler lossless.
    """

    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.with_markov = config.confidence_head_with_markov
        in_features = config.hidden_size + (config.markov_rank if self.with_markov else 0)
        self.proj = nn.Linear(in_features, 1)

    def logits(self, hidden: torch.Tensor, prev_features: torch.Tensor | None) -> torch.Tensor:
        """hidden (R, gamma, d), prev_features (R, gamma, r) or None -> confidence logits (R, gamma)."""
        if self.with_markov:
            hidden = torch.cat([hidden, prev_features], dim=-1)
        return self.proj(hidden).squeeze(-1)


def confidence_logits(draft: nn.Module, hidden_states: torch.Tensor, previous_tokens: torch.LongTensor,
                      previous_features: torch.Tensor | None = None) -> torch.Tensor:
    """Uncalibrated confidence logits of ``draft`` (its ``confidence_head``, and its
    ``markov_head`` when the confidence head reads the Markov feature ``W1[x_{k-1}]``).

    Args:
        draft: a DSpark draft with a confidence head.
        hidden_states: final-normed hidden states of the positions, (R, n, d).
        previous_tokens: the token before each position, (R, n): the anchor for the first block
            position, then the drawn tokens. Position ``k`` never sees its own token.
        previous_features: ``W1[previous_tokens]`` (R, n, rank) when the caller has looked them up already.

    Returns:
        (R, n) logits, in the head's dtype.
    """
    head = draft.confidence_head
    if not head.with_markov:
        previous_features = None
    elif previous_features is None:
        previous_features = draft.markov_head.markov_w1(previous_tokens)
    return head.logits(hidden_states, previous_features)


def calibrated_confidences(logits: torch.Tensor, temperatures: torch.Tensor | None) -> torch.Tensor:
    """``c_k = sigmoid(logit_k / T_k)`` in float32: the confidences a verify policy reads.

    Args:
        logits: confidence logits whose last dimension runs over block positions, (..., n).
        temperatures: the per-position temperatures ``T_1..T_n`` from Sequential Temperature
            Scaling (``DSparkConfig.confidence_temperatures`` as a tensor, sliced to the same
            positions), or ``None`` for an uncalibrated draft.
    """
    logits = logits.float()
    if temperatures is not None:
        logits = logits / temperatures
    return torch.sigmoid(logits)
