"""``--max-time`` as the whole command's budget: measure the target first, then plan every stage.

Before any answer is generated, :func:`measure_target` times what the stages are made of on this
machine: a batch of answers (the prefill and one decode step of ``--generation-batch-size`` rows),
one decode step of a single row (what the final measurement runs) and a feature forward per token.
:func:`plan_stages` then splits the budget:

* **data**: :data:`DATA_SHARE` of what is left after loading. Of that, ``1 - text_share`` buys the
  target's own answers (generation and features; the number of prompts is what fits at the measured
  cost) and ``text_share`` buys teacher-forced texts, which cost only their feature forward: the
  target's distribution at every position of an existing text;
* **training**: what the other stages leave, with the learning-rate schedule sized to the steps that
  fit (the trainer measures its own step time and sets ``max_steps``);
* **calibration** and the **final measurement**: fixed shares, the measurement's prompts and lengths
  sized to fit its share.

Each stage gets a deadline (its planned end, counted from the command's start), so a stage that
finishes early hands its time to the next and one that runs long is cut where its work can stop
cleanly (between answer shards, feature chunks, training steps, measured prompts). The plan and the
actual seconds go to ``stages.json`` and the model card. The shares are this project's choice, not
measured optima: see docs/training.md.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel

DATA_SHARE = 0.40  # answers, texts and their features
DEFAULT_TEXT_SHARE = 0.8  # of the data time spent on teacher-forced texts rather than answers (measured: docs/training.md)
CALIBRATION_SHARE = 0.02
MEASUREMENT_SHARE = 0.10
MARGIN_SHARE = 0.03  # saving the draft, the card and exports, and a stage that overruns its deadline
MEASURED_PER_SOURCE = 12  # held-out prompts measured per prompt source, at most
MEASUREMENT_SLACK = 1.25  # planned over estimated prompt time (SmolLM2, 45-min run: 69 s taken for 64 s estimated)
# preparing the draft for the CPU, warm-ups and generate's own overhead, whatever the prompts (a tiny test
# target's measurement of 3 prompts x 16 tokens took 31 s with another job on the 2 cores)
MEASUREMENT_FIXED_SECONDS = 30.0
MEASURE_NEW_TOKENS = 8  # decode steps timed one by one per measurement (after one untimed warm-up step)


@dataclass
class TargetCosts:
    """What the target costs on this machine, measured by :func:`measure_target`.

    Attributes:
        batch_rows: rows of the timed answers batch (``--generation-batch-size``).
        batch_prefill_seconds: the forward over that batch's prompts.
        batch_step_seconds: one decode step of that batch.
        row_step_seconds: one decode step of a single row.
        feature_seconds_per_token: a feature forward (all hidden states), per token.
    """

    batch_rows: int
    batch_prefill_seconds: float
    batch_step_seconds: float
    row_step_seconds: float
    feature_seconds_per_token: float

    def answer_seconds(self, max_new_tokens: int) -> float:
        """Seconds per prompt answered in full batches of ``max_new_tokens`` (an upper bound: answers that
        end at EOS cost less)."""
        return (self.batch_prefill_seconds + max_new_tokens * self.batch_step_seconds) / self.batch_rows


@dataclass
class StagePlan:
    """How ``--max-time`` is spent: prompts to answer and planned seconds per stage (from the command's start)."""

    max_time: float
    prompts: int
    seconds: dict[str, float]
    costs: TargetCosts
    measurement_prompts: int
    measurement_new_tokens: int
    notes: list[str] = field(default_factory=list)
    texts: int = 0  # teacher-forced texts featurised beside the answers (``--text-share``)

    def deadline(self, started: float, stage: str) -> float:
        """The :func:`~dspark_hf.training.run_clock.budget_time` by which ``stage`` must end: the planned ends of it and every stage before it."""
        order = list(self.seconds)
        return started + sum(self.seconds[s] for s in order[: order.index(stage) + 1])

    def describe(self) -> str:
        """The plan as the command prints it."""
        c = self.costs
        lines = [f"Plan for --max-time {self.max_time / 60:.1f} min (measured on this machine: an answers batch of "
                 f"{c.batch_rows} rows {c.batch_prefill_seconds:.2f} s prefill + {c.batch_step_seconds * 1e3:.0f} ms "
                 f"per step, one row {c.row_step_seconds * 1e3:.0f} ms per step, features "
                 f"{c.feature_seconds_per_token * 1e3:.2f} ms per token):"]
        for stage, seconds in self.seconds.items():
            what = {"answers": f"{self.prompts} prompts",
                    "features": f"the answers and {self.texts} teacher-forced texts" if self.texts else "",
                    "measurement": f"{self.measurement_prompts} held-out prompts x {self.measurement_new_tokens} "
                                   "tokens, greedy: target, DSpark, prompt lookup"}.get(stage, "")
            lines.append(f"  {stage:<12} {seconds / 60:6.1f} min  {what}".rstrip())
        return "\n".join(lines + [f"  note: {note}" for note in self.notes])

    def as_json(self) -> dict:
        return {"max_time_seconds": self.max_time, "prompts": self.prompts, "texts": self.texts,
                "planned_seconds": {k: round(v, 1) for k, v in self.seconds.items()},
                "measurement_prompts": self.measurement_prompts,
                "measurement_new_tokens": self.measurement_new_tokens, "costs": asdict(self.costs), "notes": self.notes}


def _time_decode(target: PreTrainedModel, rows: list[list[int]], steps: int = MEASURE_NEW_TOKENS) -> tuple[float, float]:
    """(prefill seconds, median seconds per decode step) of ``rows`` (equal lengths) in one batch, with the
    KV cache as ``generate`` uses it. Steps are timed one by one: a difference of two whole generations
    leaves the prefill's noise in the step."""
    ids = torch.tensor(rows, dtype=torch.long, device=target.device)
    mask = torch.ones_like(ids)

    def prefill():
        return target(input_ids=ids, attention_mask=mask, cache=DynamicCache(config=target.config), use_cache=True,
                      logits_to_keep=1)

    prefill()  # warm-up: first-call allocations, kernel choice
    start = time.perf_counter()
    out = prefill()
    prefill_seconds = time.perf_counter() - start
    cache, attention = out.cache, mask  # updated in place by every step
    token = out.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(steps + 1):  # the first step is a warm-up of the one-token shape
        attention = torch.cat([attention, torch.ones_like(token)], dim=1)
        start = time.perf_counter()
        out = target(input_ids=token, attention_mask=attention, cache=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        times.append(time.perf_counter() - start)
    return prefill_seconds, statistics.median(times[1:])


@torch.no_grad()
def measure_target(target: PreTrainedModel, prompt_ids: list[int], *, batch_rows: int,
                   feature_seconds_per_token) -> TargetCosts:
    """Times the target on ``prompt_ids`` (a typical context): an answers batch of ``batch_rows`` copies,
    one row, and a feature forward (``feature_seconds_per_token``: a callable returning it)."""
    batch_prefill, batch_step = _time_decode(target, [prompt_ids] * batch_rows)
    _, row_step = _time_decode(target, [prompt_ids])
    return TargetCosts(batch_rows=batch_rows, batch_prefill_seconds=batch_prefill, batch_step_seconds=batch_step,
                       row_step_seconds=row_step, feature_seconds_per_token=feature_seconds_per_token())


def plan_stages(max_time: float, elapsed: float, costs: TargetCosts, *, max_new_tokens: int, mean_prompt_tokens: float,
                min_prompts: int, max_prompts: int, shard_size: int, text_share: float = 0.0,
                mean_text_tokens: float = 0.0, max_texts: int = 0, held_out: int = 32, sources: int = 3) -> StagePlan:
    """Splits ``max_time`` (seconds from the command's start, ``elapsed`` already spent loading and measuring).

    Prompts: as many whole shards as ``1 - text_share`` of the data share buys at the measured cost
    (answers plus the features of prompt and answer), at least ``min_prompts`` (enough to hold some
    out and train), at most ``max_prompts`` (what the plan holds). Texts: what the rest of the data
    share buys at ``mean_text_tokens`` feature-forward tokens each, at most ``max_texts`` less the prompts
    (the texts skip every prompt the target answers, and some prompts come from the same pool; fewer may
    qualify, which the texts stage logs). The measurement gets what ``held_out`` answers' prompts (at most
    :data:`MEASURED_PER_SOURCE` of each of ``sources``) cost, within :data:`MEASUREMENT_SHARE`. Raises
    ``ValueError`` when even ``min_prompts`` do not fit, naming the budget that would.
    """
    if not 0.0 <= text_share < 1.0:
        raise ValueError(f"--text-share {text_share}: give a fraction of the data time from 0 (answers only) to "
                         "below 1 (the held-out answers are always the target's own).")
    left = max_time - elapsed
    per_prompt = costs.answer_seconds(max_new_tokens) + (
        (mean_prompt_tokens + max_new_tokens) * costs.feature_seconds_per_token)
    data = DATA_SHARE * left
    fits = int(data * (1.0 - text_share) // per_prompt)
    prompts = min(max_prompts, max(min_prompts, fits // shard_size * shard_size or fits))
    notes = []
    needed = elapsed + min_prompts * per_prompt / DATA_SHARE
    if int(data // per_prompt) < min_prompts:
        raise ValueError(
            f"--max-time {max_time / 60:.0f} min is too short for this target on this machine: {min_prompts} prompts "
            f"(the fewest that leave some to train on after --held-out) take {min_prompts * per_prompt / 60:.1f} min "
            f"to answer and featurise at the measured {per_prompt:.1f} s each. Give at least --max-time "
            f"{math.ceil(needed / 60)}m, fewer --max-new-tokens, or --corpus with answers made earlier.")
    if prompts < fits // shard_size * shard_size:
        notes.append(f"the prompt plan holds only {max_prompts} prompts; the unused data time goes to training")
    answers = prompts * costs.answer_seconds(max_new_tokens)
    features = prompts * (mean_prompt_tokens + max_new_tokens) * costs.feature_seconds_per_token
    texts = 0
    if text_share and mean_text_tokens > 0:
        per_text = mean_text_tokens * costs.feature_seconds_per_token
        texts = max(0, min(max_texts - prompts, int((data - answers - features) // per_text)))
        features += texts * per_text
    # three methods run each prompt; the target alone at the row step, the others faster: 2.5 row-runs per prompt
    new_tokens = 64 if max_new_tokens >= 64 else max_new_tokens
    per_measured = 2.5 * new_tokens * costs.row_step_seconds
    measurement_prompts = max(1, min(MEASURED_PER_SOURCE, int(MEASUREMENT_SHARE * left // per_measured)))
    # The measurement is the last stage, so time it leaves unused is lost: plan what its prompts cost (at
    # most the held-out answers, with slack for preparing the draft), within its share, and train instead.
    measured = min(held_out, measurement_prompts * max(1, sources))
    measurement = min(MEASUREMENT_SHARE * left, MEASUREMENT_FIXED_SECONDS + MEASUREMENT_SLACK * measured * per_measured)
    calibration = CALIBRATION_SHARE * left
    training = left - answers - features - calibration - measurement - MARGIN_SHARE * left
    seconds = {"setup": elapsed, "answers": answers, "features": features, "training": training,
               "calibration": calibration, "measurement": measurement}
    return StagePlan(max_time, prompts, seconds, costs, measurement_prompts, new_tokens, notes, texts)


__all__ = ["CALIBRATION_SHARE", "DATA_SHARE", "DEFAULT_TEXT_SHARE", "MARGIN_SHARE", "MEASUREMENT_FIXED_SECONDS",
           "MEASUREMENT_SHARE", "MEASUREMENT_SLACK", "MEASURED_PER_SOURCE", "StagePlan", "TargetCosts",
           "measure_target", "plan_stages"]
