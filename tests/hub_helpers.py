"""Test helpers for the Hub tests: a local huggingface_hub cache laid out as a download leaves it,
isolated interpreter runs, a drafting signature for round trips, and an independent reference of
z-lab's DFlash drafting.

:func:`install_in_hub_cache` copies a folder into ``<cache>/models--org--name`` the way
``snapshot_download`` stores it: each file once in ``blobs/`` (named by its sha256 for
safetensors, the git blob sha1 otherwise), ``snapshots/<commit>/<path>`` as relative symlinks to
those blobs, and ``refs/main`` holding the commit hash. With ``HF_HUB_OFFLINE=1`` and
``HF_HUB_CACHE`` pointing there, ``from_pretrained("org/name")`` resolves without network.

:func:`run_isolated` runs a Python snippet in a fresh interpreter whose Hugging Face directories
(``HF_HOME``, ``HF_HUB_CACHE``, ``HF_MODULES_CACHE``) are set before anything is imported, as they
must be: huggingface_hub and transformers read them at import time.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
import torch.nn.functional as F

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent


def _blob_name(data: bytes, path: str) -> str:
    if path.endswith(".safetensors"):  # LFS files: the blob is named by the sha256 of the content
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git object id


def install_in_hub_cache(folder: str | os.PathLike, repo_id: str, cache_dir: str | os.PathLike) -> str:
    """Stores ``folder`` as the ``main`` revision of model repo ``repo_id``; returns the commit hash."""
    folder, cache_dir = Path(folder), Path(cache_dir)
    files = sorted(p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    tree = hashlib.sha1()
    contents = {}
    for path in files:
        rel = path.relative_to(folder).as_posix()
        data = path.read_bytes()
        contents[rel] = data
        tree.update(rel.encode() + b"\0" + hashlib.sha1(data).digest())
    commit = tree.hexdigest()
    repo_dir = cache_dir / ("models--" + repo_id.replace("/", "--"))
    (repo_dir / "blobs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs").mkdir(exist_ok=True)
    snapshot = repo_dir / "snapshots" / commit
    for rel, data in contents.items():
        blob = repo_dir / "blobs" / _blob_name(data, rel)
        if not blob.exists():
            blob.write_bytes(data)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo_dir / "refs" / "main").write_text(commit)  # huggingface_hub writes it without a newline
    return commit


def isolated_env(hf_home: str | os.PathLike) -> dict[str, str]:
    """Environment for an offline run with every Hugging Face directory under ``hf_home``."""
    hf_home = Path(hf_home)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    env.update(
        HF_HOME=str(hf_home),
        HF_HUB_CACHE=str(hf_home / "hub"),
        HF_MODULES_CACHE=str(hf_home / "modules"),
        HF_HUB_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(TESTS_DIR), str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    return env


def run_isolated(code: str, hf_home: str | os.PathLike, timeout: float = 300) -> dict:
    """Runs ``code`` in a fresh interpreter (see :func:`isolated_env`); the code stores what it wants
    to report in a dict named ``report``, which is returned. Fails with the child's output on error."""
    script = textwrap.dedent(code) + "\nimport json as _json, sys as _sys\n_sys.stdout.write('\\n@@REPORT@@' + _json.dumps(report))\n"
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=isolated_env(hf_home),
        cwd=str(TESTS_DIR),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0 or "@@REPORT@@" not in proc.stdout:
        raise AssertionError(f"isolated run failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return json.loads(proc.stdout.rsplit("@@REPORT@@", 1)[1])


# ------------------------------------------------------------------------------ drafting checks
PROMPT = [3, 7, 11, 2, 9, 14, 5]


@torch.no_grad()
def drafting_signature(draft, target, prompt=PROMPT, seed=1234) -> dict:
    """One draft round on a fixed context: greedy tokens, sampled tokens (seeded), base logits and
    confidences, as plain lists (comparable across processes)."""
    from dspark_hf import serial_sample

    draft.bind_target(target)
    ids = torch.tensor([prompt])
    out = target(ids, output_hidden_states=True)
    features = torch.cat([out.hidden_states[i + 1] for i in draft.config.target_layer_ids], dim=-1)
    cache = draft.new_cache()
    draft.add_context(cache, features[:, :-1], torch.arange(ids.shape[1] - 1).unsqueeze(0))
    gamma = draft.config.block_size
    block = torch.full((1, gamma), draft.config.mask_token_id)
    block[0, 0] = ids[0, -1]
    block_out = draft(block, torch.arange(ids.shape[1] - 1, ids.shape[1] - 1 + gamma).unsqueeze(0), cache)
    anchor = ids[:, -1]
    greedy = serial_sample(draft, block_out.logits, block_out.hidden_states, anchor, do_sample=False)
    sampled = serial_sample(draft, block_out.logits, block_out.hidden_states, anchor, do_sample=True,
                            generator=torch.Generator().manual_seed(seed))
    return {
        "greedy": greedy.tokens[0].tolist(),
        "sampled": sampled.tokens[0].tolist(),
        "logits": block_out.logits[0].float().tolist(),
        "confidences": None if greedy.confidences is None else greedy.confidences[0].tolist(),
    }


def assert_same_drafting(a: dict, b: dict, atol: float = 1e-5) -> None:
    assert a["greedy"] == b["greedy"] and a["sampled"] == b["sampled"]
    assert torch.allclose(torch.tensor(a["logits"]), torch.tensor(b["logits"]), atol=atol)
    assert (a["confidences"] is None) == (b["confidences"] is None)
    if a["confidences"] is not None:
        assert torch.allclose(torch.tensor(a["confidences"]), torch.tensor(b["confidences"]), atol=atol)


# ----------------------------------------------------- z-lab DFlash drafting, written from the facts
# Written here from the published description of z-lab's DFlash drafter (no code copied): context =
# hidden_norm(fc(concatenated target hidden states of target_layer_ids, index l + 1)); each layer
# attends from the block to [context; block] with per-head q/k RMSNorm, RoPE at absolute positions,
# no causal mask; final norm; the target's LM head; the block is [anchor, MASK * (B - 1)] and the
# outputs at the B - 1 mask positions are the drafts, each for its own position.
def _rms(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


@torch.no_grad()
def zlab_reference_logits(state, config, target, features, block_ids, start) -> torch.Tensor:
    """Draft logits at the mask positions of ``block_ids`` (B,) placed at ``start..start+B-1``,
    given context ``features`` (n, m*d) of the tokens at positions ``0..n-1`` (n == start)."""
    eps, heads, kv_heads = config["rms_norm_eps"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config["head_dim"]
    theta = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta", 10000.0))
    n, size = features.shape[0], block_ids.shape[0]
    ctx = _rms(features @ state["fc.weight"].T, state["hidden_norm.weight"], eps)
    x = target.get_input_embeddings().weight[block_ids]
    positions = torch.arange(n + size, dtype=torch.float32)
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.cat([positions[:, None] * inv_freq] * 2, dim=-1)
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    for i in range(config["num_hidden_layers"]):
        w = {k[len(f"layers.{i}."):]: v for k, v in state.items() if k.startswith(f"layers.{i}.")}
        h = _rms(x, w["input_layernorm.weight"], eps)
        q = _rms((h @ w["self_attn.q_proj.weight"].T).view(size, heads, head_dim), w["self_attn.q_norm.weight"], eps)
        both = torch.cat([ctx, h])
        k = _rms((both @ w["self_attn.k_proj.weight"].T).view(n + size, kv_heads, head_dim),
                 w["self_attn.k_norm.weight"], eps)
        v = (both @ w["self_attn.v_proj.weight"].T).view(n + size, kv_heads, head_dim)
        q, k = _rotate(q, cos[n:], sin[n:]), _rotate(k, cos, sin)
        k, v = k.repeat_interleave(heads // kv_heads, dim=1), v.repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / head_dim**0.5
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(size, heads * head_dim)
        x = x + attn @ w["self_attn.o_proj.weight"].T
        h = _rms(x, w["post_attention_layernorm.weight"], eps)
        x = x + (F.silu(h @ w["mlp.gate_proj.weight"].T) * (h @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T
    x = _rms(x, state["norm.weight"], eps)
    return target.get_output_embeddings()(x)[1:]


@torch.no_grad()
def zlab_reference_greedy(state, config, target, prompt, max_new_tokens):
    """z-lab's greedy draft-and-verify loop (full recomputation, no caches), stopped before the
    rounds where the block no longer fits. Returns the per-round draft logits and accepted counts."""
    block_size = config["block_size"]
    mask_id = config["dflash_config"]["mask_token_id"]
    layer_ids = config["dflash_config"]["target_layer_ids"]
    max_length = len(prompt) + max_new_tokens
    seq = list(prompt)
    out = target(torch.tensor([seq]), output_hidden_states=True)
    seq.append(int(out.logits[0, -1].argmax()))
    rounds = []
    while max_length - (len(seq) - 1) >= block_size + 1:
        start = len(seq) - 1
        out = target(torch.tensor([seq[:-1]]), output_hidden_states=True)
        features = torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1)
        block = torch.tensor([seq[-1]] + [mask_id] * (block_size - 1))
        logits = zlab_reference_logits(state, config, target, features, block, start)
        drafts = logits.argmax(-1).tolist()
        verify = target(torch.tensor([seq + drafts])).logits[0, start:].argmax(-1).tolist()
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == verify[accepted]:
            accepted += 1
        seq += drafts[:accepted] + [verify[accepted]]
        rounds.append((logits, accepted))
    return rounds
