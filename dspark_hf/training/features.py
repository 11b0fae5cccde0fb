"""The target's features a draft trains on: cached on disk, or recomputed per batch (online).

A training sequence needs the target's hidden states of the draft's ``target_layer_ids`` (the
context the draft reads) and its final hidden state (whose LM-head projection is the distribution
the draft learns). Two ways to have them, chosen by ``--features``:

* ``cached``: computed once per sequence and stored, ``(layers + 1) x hidden`` values per token in
  16 bits (float16 when the values leave it headroom, else bfloat16: :func:`choose_feature_dtype`). SmolLM2-135M (hidden 576, 3 layers) costs 4.6 KB per token; a target of hidden
  4,096 with 5 tapped layers ~49 KB, so 10,000 answers of 300 tokens need ~150 GB.
* ``online``: no disk; every training sequence costs one more target forward when the step draws it.

Both give the draft the same numbers: an online item is computed by the same function, one sequence
per forward as for the cache, and rounded to the same dtype, so a seed trains the identical
draft either way (tests/test_train_pipeline.py). Every value is checked when it is written: an inf or
NaN stops the run naming the layer and the fix, instead of training on it. ``auto`` caches when the estimate fits under
``--max-feature-cache-gb`` and the free disk, else goes online; it logs both costs.

The cache is a folder of chunks, one per answer shard of records (``chunk-NNNNN-<hash>.pt``). The
hash covers the chunk's tokens and the layers, so a chunk is reused exactly when it would be
recomputed the same; each chunk is written by one process through a temporary file and a rename, so
several processes can build one cache and a killed run resumes at the first missing chunk.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedModel
from transformers.utils import logging

from ..model.configuration_dspark import hidden_state_indices
from .distributed import Ranks, atomic_torch_save
from .draft_vocab_training import add_target_lse, ensure_target_lse
from .run_clock import budget_time

logger = logging.get_logger(__name__)

FEATURE_FORMAT = 1
FEATURE_MODES = ("auto", "cached", "online")


FEATURE_DTYPES = ("auto", "bfloat16", "float16", "float32")
# A float16 cache is chosen only when the probe's largest value, times this, still fits float16: text
# the probe did not see can push a residual stream higher (SmolLM2-135M reaches 22,500 of 65,504).
FLOAT16_HEADROOM = 2.0


def feature_dtype(target: PreTrainedModel) -> torch.dtype:
    """The stored features' dtype when nothing was decided from values (:func:`choose_feature_dtype`):
    float16 for a float16 target (its activations are float16 already), bfloat16 otherwise (it holds
    float32's range, which real families' residual streams use)."""
    return torch.float16 if target.dtype == torch.float16 else torch.bfloat16


@torch.no_grad()
def choose_feature_dtype(target: PreTrainedModel, records: list[dict], layer_ids: list[int], max_seq_len: int,
                         requested: str = "auto", probe_records: int = 4) -> tuple[torch.dtype, str]:
    """(dtype of the feature cache, why): ``requested`` unless ``auto``; ``auto`` keeps a float16
    target's float16 and otherwise probes the first ``probe_records`` records: float16 (the finer
    16-bit type) when the largest stored value times :data:`FLOAT16_HEADROOM` fits it, else bfloat16.
    A value the probe missed is caught when it is written (:func:`target_features`)."""
    if requested not in FEATURE_DTYPES:
        raise ValueError(f"--feature-dtype {requested!r} is not one of {', '.join(FEATURE_DTYPES)}.")
    if requested != "auto":
        return getattr(torch, requested), f"--feature-dtype {requested}"
    if target.dtype == torch.float16:
        return torch.float16, "the target computes in float16"
    if target.dtype == torch.bfloat16:
        return torch.bfloat16, "the target computes in bfloat16"
    largest = 0.0
    for record in records[:probe_records]:
        context, final = target_features(target, record_ids(record, max_seq_len), layer_ids, dtype=target.dtype)
        largest = max(largest, float(context.abs().max()), float(final.abs().max()))
    limit = torch.finfo(torch.float16).max
    if largest * FLOAT16_HEADROOM <= limit:
        return torch.float16, f"the largest probed value, {largest:,.0f}, leaves float16 {FLOAT16_HEADROOM:g}x headroom"
    return torch.bfloat16, f"the largest probed value, {largest:,.0f}, is too close to or beyond float16's {limit:,.0f}"


class NonFiniteFeatureError(ValueError):
    """A target feature is inf or NaN: in the target itself, or after rounding to the cache's dtype."""


def _check_finite(values: torch.Tensor, stored: torch.Tensor, where: str, dtype: torch.dtype) -> None:
    """Raises :class:`NonFiniteFeatureError` naming ``where`` when ``values`` or their stored copy is not finite."""
    if not bool(torch.isfinite(values).all()):
        raise NonFiniteFeatureError(
            f"The target's {where} holds inf or NaN in {values.dtype} itself: the target overflows. Load it in "
            "float32 (--dtype float32).")
    if not bool(torch.isfinite(stored).all()):
        largest = float(values.abs().max())
        raise NonFiniteFeatureError(
            f"The target's {where} reaches {largest:,.0f}, beyond {dtype}'s range, so its stored feature is inf. "
            "Store features in bfloat16 (--feature-dtype bfloat16, or the default auto on a fresh --feature-dir).")


@torch.no_grad()
def target_features(target: PreTrainedModel, input_ids: torch.LongTensor, layer_ids: list[int], *,
                    dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = "cpu"):
    """(context features (L, m*d), final hidden (L, d)) of one sequence, in ``dtype`` on ``device``
    (None: the target's device). Raises :class:`NonFiniteFeatureError`, naming the layer and the
    fix, when a value is not finite in the target or in ``dtype``."""
    out = target.base_model(input_ids=input_ids[None].to(target.device), output_hidden_states=True)
    hidden = out.hidden_states
    parts = []
    for layer_id, index in zip(layer_ids, hidden_state_indices(layer_ids)):
        stored = hidden[index][0].to(dtype)
        _check_finite(hidden[index][0], stored, f"layer {layer_id} output (hidden_states[{index}])", dtype)
        parts.append(stored)
    final = out.last_hidden_state[0]
    final_stored = final.to(dtype)
    _check_finite(final, final_stored, "final hidden state (after its last norm)", dtype)
    device = target.device if device is None else device
    return torch.cat(parts, dim=-1).to(device), final_stored.to(device)


def record_ids(record: dict, max_seq_len: int) -> torch.LongTensor:
    """Prompt and answer tokens of a record, cut to ``max_seq_len``."""
    return torch.tensor((record["prompt_ids"] + record["answer_ids"])[:max_seq_len], dtype=torch.long)


def make_item(target: PreTrainedModel, record: dict, layer_ids: list[int], max_seq_len: int, *,
              dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = "cpu") -> dict:
    """One training item: ``ids``, ``answer_start``, ``context`` and ``final`` features."""
    ids = record_ids(record, max_seq_len)
    context, final = target_features(target, ids, layer_ids, dtype=dtype, device=device)
    return {"ids": ids, "answer_start": len(record["prompt_ids"]), "context": context, "final": final}


def build_feature_cache(target: PreTrainedModel, records: list[dict], layer_ids: list[int], path: Path,
                        max_seq_len: int, with_target_lse: bool = False) -> list[dict]:
    """Sequences with their target features, cached in one file at ``path`` (recomputed if missing).

    The single-file cache of one process (the pipeline uses chunked :func:`build_feature_chunks`).
    ``with_target_lse`` (a reduced draft vocabulary) also stores the target's log-normaliser per
    position (``target_lse``), adding it to an existing cache that lacks it."""
    if path.exists():
        # memory-mapped: runs trained side by side on one cache share its pages instead of a copy each
        cached = torch.load(path, weights_only=True, mmap=True)
        if cached["layer_ids"] == list(layer_ids) and len(cached["items"]) == len(records):
            if with_target_lse:
                ensure_target_lse(cached["items"], target.get_output_embeddings(), path, layer_ids)
            return cached["items"]
    items = [make_item(target, record, layer_ids, max_seq_len)
             for record in tqdm(records, desc="Target features", unit="seq")]
    if with_target_lse:
        add_target_lse(items, target.get_output_embeddings())
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"layer_ids": list(layer_ids), "items": items}, path)
    return items


# ------------------------------------------------------------------------------ sources of items
class FeatureSource:
    """Training items by index. ``shape`` and ``token_ids`` are cheap (no target forward), so every
    process can draw the same anchors for the whole global batch; ``item`` gives the features."""

    def __len__(self) -> int:
        raise NotImplementedError

    def shape(self, index: int) -> tuple[int, int]:
        """(sequence length, answer start) of item ``index``."""
        raise NotImplementedError

    def token_ids(self, index: int) -> torch.LongTensor:
        raise NotImplementedError

    def item(self, index: int) -> dict:
        raise NotImplementedError

    def items(self, indices: Sequence[int] | None = None) -> list[dict]:
        return [self.item(i) for i in (range(len(self)) if indices is None else indices)]

    def subset(self, indices: Sequence[int]) -> "FeatureSource":
        return _Subset(self, list(indices))


class ListFeatures(FeatureSource):
    """Items already in memory (or memory-mapped): a cache, or a list built by a caller."""

    def __init__(self, items: list[dict]):
        self._items = items

    def __len__(self) -> int:
        return len(self._items)

    def shape(self, index: int) -> tuple[int, int]:
        item = self._items[index]
        return item["ids"].numel(), item["answer_start"]

    def token_ids(self, index: int) -> torch.LongTensor:
        return self._items[index]["ids"]

    def item(self, index: int) -> dict:
        return self._items[index]


class OnlineFeatures(FeatureSource):
    """Items computed from ``records`` when asked, with the target (no disk).

    ``head`` (the target's logits, :func:`~dspark_hf.training.target_loading.target_head`) adds the
    log-normaliser a reduced draft vocabulary needs, computed as the cache computes it.
    """

    def __init__(self, target: PreTrainedModel, records: list[dict], layer_ids: list[int], max_seq_len: int, *,
                 head: nn.Module | None = None, dtype: torch.dtype | None = None):
        self.target, self.records, self.layer_ids, self.max_seq_len = target, records, list(layer_ids), max_seq_len
        self.head, self.dtype = head, dtype or feature_dtype(target)

    def __len__(self) -> int:
        return len(self.records)

    def shape(self, index: int) -> tuple[int, int]:
        record = self.records[index]
        return min(len(record["prompt_ids"]) + len(record["answer_ids"]), self.max_seq_len), len(record["prompt_ids"])

    def token_ids(self, index: int) -> torch.LongTensor:
        return record_ids(self.records[index], self.max_seq_len)

    def item(self, index: int) -> dict:
        # kept on the target's device: nothing is stored, and the draft reads it there
        item = make_item(self.target, self.records[index], self.layer_ids, self.max_seq_len, dtype=self.dtype,
                         device=None)
        if self.head is not None:
            add_target_lse([item], self.head, show_progress=False)
        return item


class _Subset(FeatureSource):
    def __init__(self, source: FeatureSource, indices: list[int]):
        self.source, self.indices = source, indices

    def __len__(self) -> int:
        return len(self.indices)

    def shape(self, index: int) -> tuple[int, int]:
        return self.source.shape(self.indices[index])

    def token_ids(self, index: int) -> torch.LongTensor:
        return self.source.token_ids(self.indices[index])

    def item(self, index: int) -> dict:
        return self.source.item(self.indices[index])


def as_feature_source(items) -> FeatureSource:
    """``items`` as a :class:`FeatureSource` (a list of cache items is wrapped)."""
    return items if isinstance(items, FeatureSource) else ListFeatures(list(items))


# ------------------------------------------------------------------------------ the chunked cache
def _chunks(records: list[dict], chunk_size: int) -> list[list[dict]]:
    return [records[start : start + chunk_size] for start in range(0, len(records), chunk_size)]


def chunk_hash(records: list[dict], layer_ids: list[int], max_seq_len: int, dtype: torch.dtype) -> str:
    """What a chunk's features depend on besides the target: its tokens, the layers, the cut, the dtype."""
    digest = hashlib.sha256(json.dumps([FEATURE_FORMAT, list(layer_ids), max_seq_len, str(dtype)]).encode())
    for record in records:
        digest.update(json.dumps([record["prompt_ids"], record["answer_ids"]]).encode())
    return digest.hexdigest()[:16]


def chunk_paths(folder: Path, records: list[dict], layer_ids: list[int], max_seq_len: int, chunk_size: int,
                dtype: torch.dtype) -> list[Path]:
    """The file of every chunk of ``records`` (existing or not)."""
    return [Path(folder) / f"chunk-{k:05d}-{chunk_hash(chunk, layer_ids, max_seq_len, dtype)}.pt"
            for k, chunk in enumerate(_chunks(records, chunk_size))]


def _lse_path(path: Path) -> Path:
    return path.with_suffix(".lse.pt")


def build_feature_chunks(target: PreTrainedModel, records: list[dict], layer_ids: list[int], folder: str | Path,
                         max_seq_len: int, chunk_size: int, *, ranks: Ranks | None = None, head: nn.Module | None = None,
                         dtype: torch.dtype | None = None, show_progress: bool = True,
                         deadline: float | None = None) -> list[Path]:
    """Computes this process's missing chunks of the feature cache of ``records`` in ``folder``.

    Chunk ``k`` holds records ``[k * chunk_size, (k + 1) * chunk_size)`` and belongs to process
    ``k mod world_size``. With ``head`` each chunk also gets its target log-normalisers in a
    companion ``.lse.pt`` file (made on demand, so switching to a reduced vocabulary keeps the
    features). ``dtype`` (default :func:`feature_dtype`) is the stored dtype; a value it cannot hold
    stops the run (:class:`NonFiniteFeatureError`). ``deadline`` (a ``budget_time()`` value) stops
    after the chunk that ends past it. Every process waits for the others before returning the paths
    of the chunks that exist (all of them unless the deadline cut the stage).
    """
    ranks = ranks or Ranks()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dtype = dtype or feature_dtype(target)
    paths = chunk_paths(folder, records, layer_ids, max_seq_len, chunk_size, dtype)
    chunks = _chunks(records, chunk_size)
    mine = [k for k in ranks.share(len(chunks))
            if not paths[k].exists() or (head is not None and not _lse_path(paths[k]).exists())]
    progress = tqdm(total=sum(len(chunks[k]) for k in mine), desc="Target features", unit="seq",
                    disable=not (show_progress and ranks.is_main))
    for k in mine:
        path = paths[k]
        if not path.exists():
            for stale in folder.glob(f"chunk-{k:05d}-*.pt"):  # chunk k of other records: never read again
                if ".tmp" not in stale.name:  # (another run's file being written is left alone)
                    stale.unlink(missing_ok=True)
            items = [make_item(target, record, layer_ids, max_seq_len, dtype=dtype) for record in chunks[k]]
            atomic_torch_save({"format": FEATURE_FORMAT, "layer_ids": list(layer_ids), "items": items}, path)
        if head is not None and not _lse_path(path).exists():
            items = torch.load(path, weights_only=True, mmap=True)["items"]
            add_target_lse(items, head, show_progress=False)  # the chunk bar above counts this work
            atomic_torch_save([item["target_lse"] for item in items], _lse_path(path))
        progress.update(len(chunks[k]))
        if deadline is not None and budget_time() >= deadline:
            logger.warning(f"Features: the stage's time share is spent after chunk {k}; training uses the chunks "
                           "written so far (the rest are made by a later run).")
            break
    progress.close()
    ranks.barrier()
    return [path for path in paths if path.exists() and (head is None or _lse_path(path).exists())]


def load_feature_chunks(paths: list[Path], *, with_target_lse: bool = False) -> ListFeatures:
    """The items of a chunked cache, memory-mapped (processes on one machine share the pages)."""
    items = []
    for path in paths:
        chunk = torch.load(path, weights_only=True, mmap=True)["items"]
        if with_target_lse:
            for item, lse in zip(chunk, torch.load(_lse_path(path), weights_only=True, mmap=True)):
                item["target_lse"] = lse
        items.extend(chunk)
    return ListFeatures(items)


# ------------------------------------------------------------------------------ costs and choice
def bytes_per_token(num_layers: int, hidden_size: int, dtype_bytes: int = 2, with_target_lse: bool = False) -> int:
    """Disk per cached token: the tapped layers and the final hidden state, the token id, the normaliser."""
    return (num_layers + 1) * hidden_size * dtype_bytes + 8 + (4 if with_target_lse else 0)


def cache_estimate(records: list[dict], layer_ids: list[int], hidden_size: int, max_seq_len: int, *,
                   with_target_lse: bool = False) -> dict:
    """Tokens and bytes the feature cache of ``records`` takes."""
    tokens = sum(min(len(r["prompt_ids"]) + len(r["answer_ids"]), max_seq_len) for r in records)
    per_token = bytes_per_token(len(layer_ids), hidden_size, with_target_lse=with_target_lse)
    return {"tokens": tokens, "bytes_per_token": per_token, "bytes": tokens * per_token}


@torch.no_grad()
def forward_seconds_per_token(target: PreTrainedModel, records: list[dict], layer_ids: list[int],
                              max_seq_len: int, samples: int = 2, head: torch.nn.Module | None = None) -> float:
    """Measured seconds per token of what the cache does for a record, on the first ``samples`` records
    (one warm-up): the feature forward, writing the record to disk and, with ``head`` (a reduced draft
    vocabulary), the target's log-normalisers, which the cache stores beside the features."""
    chosen = records[: max(1, samples)]
    make_item(target, chosen[0], layer_ids, max_seq_len)  # warm-up: first-call allocations and kernels
    with tempfile.TemporaryDirectory() as folder:
        start, tokens = time.perf_counter(), 0
        for index, record in enumerate(chosen):
            item = make_item(target, record, layer_ids, max_seq_len)
            atomic_torch_save({"items": [item]}, Path(folder) / f"{index}.pt")
            if head is not None:
                add_target_lse([item], head, show_progress=False)
            tokens += item["ids"].numel()
        return (time.perf_counter() - start) / max(tokens, 1)


def free_disk_bytes(folder: str | Path) -> int:
    """Free bytes on the file system that holds (or will hold) ``folder``."""
    path = Path(folder).resolve()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def choose_feature_mode(mode: str, needed_bytes: int, budget_bytes: float, free_bytes: int) -> tuple[str, str]:
    """(``cached`` or ``online``, why). ``auto`` caches when the bytes still to write fit under the
    budget and under the free disk with a 10% margin."""
    if mode not in FEATURE_MODES:
        raise ValueError(f"--features {mode!r} is not one of {', '.join(FEATURE_MODES)}.")
    if mode != "auto":
        return mode, f"--features {mode}"
    if needed_bytes > budget_bytes:
        return "online", f"the cache ({needed_bytes / 1e9:.2f} GB) exceeds --max-feature-cache-gb ({budget_bytes / 1e9:g} GB)"
    if needed_bytes > 0.9 * free_bytes:
        return "online", f"the cache ({needed_bytes / 1e9:.2f} GB) does not fit the free disk ({free_bytes / 1e9:.1f} GB)"
    return "cached", (f"the cache ({needed_bytes / 1e9:.2f} GB) fits --max-feature-cache-gb ({budget_bytes / 1e9:g} GB) "
                      f"and the free disk ({free_bytes / 1e9:.1f} GB)")


__all__ = ["FEATURE_DTYPES", "FEATURE_MODES", "FLOAT16_HEADROOM", "FeatureSource", "ListFeatures",
           "NonFiniteFeatureError", "OnlineFeatures", "as_feature_source", "build_feature_cache", "build_feature_chunks",
           "bytes_per_token", "cache_estimate", "choose_feature_dtype", "choose_feature_mode", "chunk_paths",
           "feature_dtype", "forward_seconds_per_token", "free_disk_bytes", "load_feature_chunks", "make_item",
           "record_ids", "target_features"]
