"""A checkpoint must store each tensor in the kind of dtype its parameter or buffer has.

``from_pretrained`` casts every floating-point tensor to the dtype the draft is loaded in (a bf16
file loaded with ``dtype=torch.float32`` is normal), but it also copies an ``int8`` tensor into a
float parameter, or a float tensor into an integer buffer such as ``draft_vocab_ids``, without a
word: a quantised or mis-saved file would load with wrong values and quietly draft worse (or
propose the wrong ids). :func:`check_checkpoint_dtypes` reads the stored dtypes (safetensors
headers, a ``.bin`` file memory-mapped, or the ``state_dict`` passed in) and raises ``ValueError``
naming every tensor stored as integer/bool where the draft expects floating point, or the reverse.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import torch

__all__ = ["check_checkpoint_dtypes", "dtype_kind_mismatches", "stored_dtype_kinds"]

_DOWNLOAD_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "proxies")
# safetensors dtype names by kind (the header's strings, read without loading any tensor).
_SAFETENSORS_FLOAT = ("F", "BF")  # F64, F32, F16, BF16, F8_E4M3, F8_E5M2, ...
_SAFETENSORS_INTEGER = ("I", "U")  # I64, I32, I16, I8, U8, ...


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_floating_point:
        return "floating point"
    if dtype.is_complex:
        return "complex"
    return "integer"


def _safetensors_kind(name: str) -> str:
    if name == "BOOL":
        return "bool"
    if name.startswith(_SAFETENSORS_FLOAT):
        return "floating point"
    if name.startswith(_SAFETENSORS_INTEGER):
        return "integer"
    return "complex" if name.startswith("C") else name


def _resolve(path: Any, filename: str, kwargs: dict) -> str | None:
    """Local path of ``filename`` in a folder or an already downloaded Hub repo, else ``None``."""
    subfolder = kwargs.get("subfolder") or ""
    if os.path.isdir(path):
        file = Path(path) / subfolder / filename
        return str(file) if file.is_file() else None
    from transformers.utils import cached_file

    try:
        options = {k: kwargs[k] for k in _DOWNLOAD_KWARGS if kwargs.get(k) is not None}
        return cached_file(str(path), filename, subfolder=subfolder, _raise_exceptions_for_missing_entries=False,
                           **options)
    except (OSError, ValueError):
        return None


def _weight_files(path: Any, kwargs: dict) -> list[str]:
    """The checkpoint's weight files: safetensors first (one file or shards), else ``.bin``."""
    for single, index in (("model.safetensors", "model.safetensors.index.json"),
                          ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        file = _resolve(path, single, kwargs)
        if file is not None:
            return [file]
        index_file = _resolve(path, index, kwargs)
        if index_file is not None:
            shards = sorted(set(json.loads(Path(index_file).read_text(encoding="utf-8"))["weight_map"].values()))
            return [f for f in (_resolve(path, shard, kwargs) for shard in shards) if f is not None]
    return []


def stored_dtype_kinds(path: Any, kwargs: dict) -> dict[str, str]:
    """Tensor name -> dtype kind (``"floating point"``, ``"integer"``, ``"bool"``) as stored: from
    ``kwargs["state_dict"]`` when given, else from the weight files of ``path`` (folder or Hub id)."""
    state_dict = kwargs.get("state_dict")
    if state_dict is not None:
        return {name: _kind(tensor.dtype) for name, tensor in state_dict.items() if isinstance(tensor, torch.Tensor)}
    if path is None:
        return {}
    kinds: dict[str, str] = {}
    for file in _weight_files(path, kwargs):
        if file.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(file, framework="pt") as handle:
                for name in handle.keys():
                    kinds[name] = _safetensors_kind(handle.get_slice(name).get_dtype())
        else:
            try:  # memory-mapped: no tensor data is read
                state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
            except (RuntimeError, OSError, ValueError, pickle.UnpicklingError):
                continue  # a legacy (non-zip) file cannot be mapped; transformers has loaded it already
            kinds.update((name, _kind(tensor.dtype)) for name, tensor in state.items()
                         if isinstance(tensor, torch.Tensor))
    return kinds


def dtype_kind_mismatches(model: torch.nn.Module, stored: dict[str, str]) -> list[str]:
    """``"name: stored <kind>, expected <kind>"`` for every stored tensor of another kind than the
    model's parameter or buffer of that name (a name with a leading prefix such as ``model.`` is
    matched without it; names the model does not have are left to the key check)."""
    expected = {name: _kind(tensor.dtype) for name, tensor in
                [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]}
    problems = []
    for name, kind in sorted(stored.items()):
        wanted = expected.get(name, expected.get(name.split(".", 1)[-1]))
        if wanted is not None and kind != wanted:
            problems.append(f"{name!r}: stored as {kind}, the draft expects {wanted}")
    return problems


def check_checkpoint_dtypes(model: torch.nn.Module, path: Any, kwargs: dict) -> None:
    """Raises ``ValueError`` when the checkpoint at ``path`` (or ``kwargs["state_dict"]``) stores a
    tensor as integer/bool where ``model`` has floating point, or the reverse; see the module docstring."""
    problems = dtype_kind_mismatches(model, stored_dtype_kinds(path, kwargs))
    if problems:
        raise ValueError(
            f"Checkpoint {path!s} stores {len(problems)} tensor(s) in the wrong kind of dtype: {'; '.join(problems)}. "
            "Loading would convert the values silently (a quantised or mis-saved file); re-save the draft from "
            "its full-precision weights (floating-point tensors in any float dtype load fine)."
        )
