"""A reduced draft vocabulary (dspark_hf.model.draft_vocab): checkpoint round trip and broken checkpoints,
lossless drafting (greedy and sampled, with a power check), the exact TV identity of the training
loss, the CUDA op's path (kernels emulated on CPU), Hub export and a remote-code load, training."""

import json
import math
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

import dspark_hf
from dspark_hf import DSparkConfig, DSparkDraftModel, FixedLengthPolicy, PrefixScheduler
from dspark_hf import engine_hooks
from dspark_hf.model.draft_vocab import check_draft_vocab_ids, gathered_head, scatter_to_vocab
from dspark_hf.training.draft_vocab_training import (
    coverage,
    coverage_table,
    reduced_vocab_loss,
    select_draft_vocab,
    target_subset_logits,
    token_counts,
)
from dspark_hf.hub import export, render_model_card
from dspark_hf.decoding import sampling
from dspark_hf.decoding.sampling import serial_sample
from dspark_hf.training.trainer import (
    TrainingConfig,
    build_feature_cache,
    draft_block_outputs,
    dspark_loss,
    position_weights,
    serial_logits_teacher_forced,
    step_loss,
    train,
)
from cuda_op_fakes import pretend_cuda_op_is_built
from hub_helpers import PROMPT, assert_same_drafting, drafting_signature, install_in_hub_cache, run_isolated
from test_checkpoints import V, deepspec_state_dict, write_deepspec_folder
from tiny_models import bigram_target, markov_draft, random_target

IDS = [0, 2, 3, 5, 7, 8, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47]  # 17 of the 48 tokens (test_checkpoints.V)


def _target():
    return random_target("qwen3", vocab_size=V, hidden_size=32, num_layers=4, context_scale=0.3)


def _reduced_draft(target, ids=IDS, head_type="vanilla", seed=5, **kwargs):
    """A reduced draft with a non-zero Markov head and confidence head (fresh ones are zeros)."""
    draft = DSparkDraftModel.from_target(target, block_size=4, markov_rank=8, markov_head_type=head_type,
                                         draft_vocab_ids=ids, **kwargs)
    torch.manual_seed(seed)
    torch.nn.init.normal_(draft.markov_head.markov_w2.weight, std=0.5)
    torch.nn.init.normal_(draft.confidence_head.proj.weight, std=0.2)
    return draft.eval()


# ------------------------------------------------------------------------------ checkpoint format
def test_round_trip_keeps_the_ids_and_the_drafting(tmp_path):
    target = _target()
    draft = _reduced_draft(target)
    assert draft.config.draft_vocab_size == len(IDS) and draft.draft_vocab_ids.tolist() == IDS
    assert tuple(draft.markov_head.markov_w2.weight.shape) == (len(IDS), 8)
    assert tuple(draft.markov_head.markov_w1.weight.shape) == (V, 8)  # the previous token may be any token
    expected = drafting_signature(draft, target)
    outside = [t for t in range(V) if t not in IDS]
    assert all(math.isinf(row[t]) and row[t] < 0 for row in expected["logits"] for t in outside)
    assert set(expected["greedy"] + expected["sampled"]) <= set(IDS)
    draft.save_pretrained(tmp_path / "draft")
    assert json.loads((tmp_path / "draft" / "config.json").read_text())["draft_vocab_size"] == len(IDS)
    saved = load_file(str(tmp_path / "draft" / "model.safetensors"))
    assert saved["draft_vocab_ids"].dtype == torch.int64 and saved["draft_vocab_ids"].tolist() == IDS
    reloaded = DSparkDraftModel.from_pretrained(tmp_path / "draft")
    assert torch.equal(reloaded.draft_vocab_ids, draft.draft_vocab_ids)
    assert_same_drafting(drafting_signature(reloaded, target), expected, atol=0)
    assert reloaded.draft_vocab_logits(torch.randn(2, 32)).shape == (2, len(IDS))


def test_full_vocabulary_drafts_have_neither_field_nor_tensor(tmp_path):
    target = _target()
    draft = DSparkDraftModel.from_target(target, block_size=4, markov_rank=8)
    assert draft.draft_vocab_ids is None and "draft_vocab_ids" not in draft.state_dict()
    draft.save_pretrained(tmp_path / "ours")
    assert json.loads((tmp_path / "ours" / "config.json").read_text()).get("draft_vocab_size") is None
    # a DeepSpec checkpoint loads exactly as before: every key, nothing added
    sd = write_deepspec_folder(tmp_path / "deepspec")
    loaded = DSparkDraftModel.from_pretrained(tmp_path / "deepspec")
    assert loaded.config.draft_vocab_size is None and loaded.draft_vocab_ids is None
    assert set(loaded.state_dict()) == set(deepspec_state_dict())
    for key, value in sd.items():
        assert torch.equal(loaded.state_dict()[key], value), key


def _broken_copy(tmp_path, name, change_weights=None, change_config=None):
    source = tmp_path / "good"
    if not source.exists():
        _reduced_draft(_target()).save_pretrained(source)
    folder = tmp_path / name
    shutil.copytree(source, folder)
    weights = load_file(str(folder / "model.safetensors"))
    if change_weights:
        change_weights(weights)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    if change_config:
        change_config(config)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


BROKEN = {
    "ids missing": (lambda w: w.pop("draft_vocab_ids"), None, "sets draft_vocab_size=17 but the weights have no"),
    "wrong shape": (lambda w: w.update(draft_vocab_ids=torch.arange(5)), None, r"shape \(5,\) but config.json sets"),
    "out of range": (lambda w: w.update(draft_vocab_ids=torch.arange(17) + 40), None, r"outside the vocabulary \[0, 48\)"),
    "unsorted": (lambda w: w.update(draft_vocab_ids=torch.arange(17).flip(0)), None, "sorted with no repeats"),
    "repeated": (lambda w: w.update(draft_vocab_ids=torch.tensor([0] * 2 + list(range(2, 17)))), None,
                 "sorted with no repeats"),
    "config field missing": (None, lambda c: c.pop("draft_vocab_size"), "config.json has no draft_vocab_size"),
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_broken_reduced_checkpoints_are_refused_with_the_reason(tmp_path, name):
    change_weights, change_config, message = BROKEN[name]
    folder = _broken_copy(tmp_path, name.replace(" ", "_"), change_weights, change_config)
    with pytest.raises(ValueError, match=message) as err:
        DSparkDraftModel.from_pretrained(folder)
    assert "broken reduced draft vocabulary" in str(err.value) and "Re-save" in str(err.value)


def test_config_and_constructor_checks():
    with pytest.raises(ValueError, match=r"draft_vocab_size 60 must lie in \[1, vocab_size=48\]"):
        DSparkConfig(vocab_size=48, hidden_size=32, num_attention_heads=4, draft_vocab_size=60)
    with pytest.raises(ValueError, match="draft_vocab_size must be an int or None"):
        DSparkConfig(vocab_size=48, hidden_size=32, num_attention_heads=4, draft_vocab_size=True)
    target = _target()
    with pytest.raises(ValueError, match="sorted with no repeats"):
        DSparkDraftModel.from_target(target, draft_vocab_ids=[1, 1, 2])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        DSparkDraftModel.from_target(target, draft_vocab_ids=[1, 48])
    unsorted = DSparkDraftModel.from_target(target, markov_rank=4, draft_vocab_ids=[9, 3, 5])
    assert unsorted.draft_vocab_ids.tolist() == [3, 5, 9]
    check_draft_vocab_ids(None, 48, None)  # a full-vocabulary draft


# ------------------------------------------------------------------------------ lossless drafting
def test_greedy_generation_with_a_reduced_draft_equals_the_target():
    table = torch.log_softmax(torch.randn(12, 12, generator=torch.Generator().manual_seed(3)) * 3, -1)
    target = bigram_target(table)
    greedy_next = table.argmax(-1)
    ids = sorted(set(range(0, 12, 2)) | {int(greedy_next[0])})
    assert set(greedy_next.tolist()) - set(ids), "some greedy token must lie outside the draft vocabulary"
    draft = markov_draft(target, table + 0.3 * torch.randn(12, 12, generator=torch.Generator().manual_seed(4)),
                         block_size=4, draft_vocab_ids=ids)
    draft.generation_config.dspark_verify_policy = FixedLengthPolicy(4)
    prompts = torch.tensor([[1, 4], [3, 7], [0, 5], [11, 9]])
    accepted = 0
    for prompt in prompts:
        plain = target.generate(prompt[None], max_new_tokens=30, do_sample=False)
        assisted = target.generate(prompt[None], max_new_tokens=30, do_sample=False, assistant_model=draft)
        assert torch.equal(assisted, plain)
        accepted += sum(r.accepted for r in draft.last_generation_stats.rounds)
    assert accepted > 0  # the draft was used, and its tokens accepted


@pytest.mark.parametrize("markov", [True, False])
def test_greedy_loop_over_the_draft_columns_equals_the_whole_vocabulary_loop(markov):
    # Greedy without processors the loop draws over the N draft columns (column_vocab_ids); handed
    # whole-vocabulary logits it draws over V. Tokens and logits must agree, ties included: the
    # base logits are rounded to whole numbers so most rows tie, and the first maximum wins in
    # target-id order only if the columns map back in order.
    target = _target()
    draft = _reduced_draft(target)
    if not markov:  # (the confidence head reads the Markov head's W1)
        draft.markov_head = draft.confidence_head = None
    draft.bind_target(target)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 4, 32, generator=gen)
    anchors = torch.tensor([1, 2, 40])
    columns = torch.randint(-2, 3, (3, 4, len(IDS)), generator=gen).float()  # N-wide, full of ties
    whole = scatter_to_vocab(columns, torch.tensor(IDS), V, float("-inf"))
    ties = (columns == columns.amax(-1, keepdim=True)).sum(-1)
    assert (ties > 1).float().mean() > 0.5
    offers = []
    with torch.no_grad():
        narrow = serial_sample(draft, columns, hidden, anchors, do_sample=False)
        wide = serial_sample(draft, whole, hidden, anchors, do_sample=False)
        assert torch.equal(narrow.tokens, wide.tokens) and torch.equal(narrow.logits, wide.logits)
        assert set(narrow.tokens.flatten().tolist()) <= set(IDS)
        if not markov:  # the loop draws the first maximum of each row, in target-id order
            assert torch.equal(narrow.tokens, whole.argmax(-1))
        # One request through the admitted loop (LM head run inside it, over the N columns) against
        # the same loop drawing whole-vocabulary rows (draft.base_logits passed in).
        admitted = serial_sample(draft, None, hidden[:1], anchors[:1], do_sample=False,
                                 admission=lambda c: offers.append(c) or len(offers) <= 3)
        offers.clear()
        reference = serial_sample(draft, draft.base_logits(hidden[:1]), hidden[:1], anchors[:1], do_sample=False,
                                  admission=lambda c: offers.append(c) or len(offers) <= 3)
    assert admitted.num_admitted == reference.num_admitted == 3
    assert torch.equal(admitted.tokens, reference.tokens) and torch.equal(admitted.logits, reference.logits)
    assert admitted.logits.shape[-1] == V


def _recorded_draws(monkeypatch):
    """The probability rows the serial loop draws from, as it draws them."""
    rows, real = [], sampling.draw_categorical
    monkeypatch.setattr(sampling, "draw_categorical", lambda probs, generator=None: rows.append(probs.clone())
                        or real(probs, generator))
    return rows


@pytest.mark.parametrize("temperature", [None, 0.7])
def test_sampled_loop_with_exact_probabilities_draws_over_the_columns_and_returns_q(monkeypatch, temperature):
    # A caller that verifies with the loop's own q (exact_probabilities) lets a sampled loop over a
    # reduced draft draw over its N columns (temperature is the only processor allowed there); q is
    # then the very rows drawn from, zero outside the subset, and the softmax of the logits handed
    # over only up to rounding. Without the promise, or with top-k, rows stay vocabulary-wide.
    target = _target()
    draft = _reduced_draft(target)
    draft.bind_target(target)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 4, 32, generator=gen)
    anchors = torch.tensor([1, 2, 40])
    columns = torch.randn(3, 4, len(IDS), generator=gen) * 2
    processors = LogitsProcessorList([TemperatureLogitsWarper(temperature)] if temperature else [])
    drawn = _recorded_draws(monkeypatch)
    outside = torch.ones(V, dtype=torch.bool)
    outside[IDS] = False
    with torch.no_grad():
        sample = serial_sample(draft, columns, hidden, anchors, do_sample=True, logits_processor=processors,
                               prefix_ids=anchors[:, None], exact_probabilities=True)
        q = sample.probabilities
        assert len(drawn) == 4 and all(rows.shape == (3, len(IDS)) for rows in drawn)
        assert q.shape == (3, 4, V) and torch.all(q[..., outside] == 0)
        assert torch.equal(q[..., IDS], torch.stack(drawn, dim=1))
        torch.testing.assert_close(q, torch.softmax(sample.logits, -1), rtol=1e-5, atol=1e-7)
        assert set(sample.tokens.flatten().tolist()) <= set(IDS)
        assert torch.all(q.gather(-1, sample.tokens[..., None]) > 0)
        # One request through the admitted loop (its LM head over the N columns, run inside it).
        drawn.clear()
        offers = []
        admitted = serial_sample(draft, None, hidden[:1], anchors[:1], do_sample=True, logits_processor=processors,
                                 prefix_ids=anchors[:1, None], exact_probabilities=True,
                                 admission=lambda c: offers.append(c) or len(offers) <= 3)
        assert admitted.num_admitted == 3 and admitted.probabilities.shape == (1, 3, V)
        assert torch.equal(admitted.probabilities[..., IDS], torch.stack(drawn, dim=1))
        assert torch.all(admitted.probabilities[..., outside] == 0)
        # The former name answers as before: sampling without the promise stays vocabulary-wide.
        assert sampling.greedy_vocab_ids(draft, True, None) is None
        assert torch.equal(sampling.greedy_vocab_ids(draft, False, None), draft.draft_vocab_ids)
        for kwargs in ({}, {"logits_processor": LogitsProcessorList([TopKLogitsWarper(5)])}):
            drawn.clear()
            whole = serial_sample(draft, columns, hidden, anchors, do_sample=True, prefix_ids=anchors[:, None],
                                  exact_probabilities="logits_processor" in kwargs, **kwargs)
            assert all(rows.shape == (3, V) for rows in drawn)
            assert (whole.probabilities is None) == ("logits_processor" not in kwargs)


def test_reduced_head_is_prepared_the_way_an_engine_prepared_the_full_head(monkeypatch):
    """The packing hook (dspark_hf.engine_hooks.pack_like): the gathered rows of a head an engine prepared go to
    that engine to be prepared alike. A fake engine here; the CPU engine's packing is tested with it
    (cpu_engine/tests/test_cpu_engine_hooks.py)."""

    class Prepared(torch.nn.Linear):
        pass

    handed = []

    def pack_like(source, module):
        if isinstance(source, Prepared):
            handed.append(module)
            module.__class__ = Prepared
        return module

    monkeypatch.setattr(engine_hooks, "_ENGINES", {"fake": engine_hooks.EngineHooks(pack_like=pack_like)})
    target = _target()
    draft = _reduced_draft(target)
    draft.bind_target(target)
    hidden = torch.randn(1, 5, target.config.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        stock = draft.draft_vocab_logits(hidden)
        cache = draft._draft_vocab_caches[0]
        assert type(gathered_head(target.lm_head, draft.draft_vocab_ids, cache)) is torch.nn.Linear and not handed
        target.lm_head.__class__ = Prepared  # as an engine's preparation changes the head's class in place
        rows = gathered_head(target.lm_head, draft.draft_vocab_ids, cache)
        assert type(rows) is Prepared and handed == [rows]  # re-gathered because the head changed
        torch.testing.assert_close(draft.draft_vocab_logits(hidden), stock)


def test_under_autocast_the_frozen_rows_are_cast_once_and_the_target_logits_stay_exact(monkeypatch):
    """Training in bfloat16: the draft's gathered head is cast once (not at every call, and not through an engine's
    float32-only packing), while the target's logits for the loss keep the head's float32."""

    class Prepared(torch.nn.Linear):
        pass

    monkeypatch.setattr(engine_hooks, "_ENGINES", {"fake": engine_hooks.EngineHooks(
        pack_like=lambda source, module: (setattr(module, "__class__", Prepared) or module)
        if isinstance(source, Prepared) else module)})
    target = _target()
    target.lm_head.__class__ = Prepared
    target.requires_grad_(False)  # a frozen head, as in training
    draft = _reduced_draft(target)
    draft.bind_target(target)
    hidden = torch.randn(1, 5, target.config.hidden_size, generator=torch.Generator().manual_seed(2))
    cache = draft._draft_vocab_caches[0]
    exact = draft.draft_vocab_logits(hidden)
    assert exact.dtype == torch.float32 and type(cache.value) is Prepared
    with torch.autocast("cpu", dtype=torch.bfloat16):
        first = draft.draft_vocab_logits(hidden)
        cast = cache.value
        again = draft.draft_vocab_logits(hidden)
        target_rows = target_subset_logits(draft, target.lm_head, hidden)
        with torch.autocast("cpu", enabled=False):
            target_exact = target_subset_logits(draft, target.lm_head, hidden)
    assert cache.value is cast  # one cast for both calls
    assert type(cast) is torch.nn.Linear and cast.weight.dtype == torch.bfloat16
    assert first.dtype == again.dtype == torch.bfloat16 and torch.equal(first, again)
    torch.testing.assert_close(first.float(), exact, atol=0.05, rtol=0.02)
    assert target_rows.dtype == torch.bfloat16 and target_exact.dtype == torch.float32
    torch.testing.assert_close(target_exact, exact)  # the target's head, outside autocast: the float32 logits


def _reduced_chi_square_draft(ids):
    from test_lossless_sampling import CONFIDENCE_LOGITS, DRAFT_PROBS, _log

    def factory(target):
        return markov_draft(target, _log(DRAFT_PROBS), block_size=3, confidence_logits=CONFIDENCE_LOGITS,
                            draft_vocab_ids=ids)

    return factory


def test_sampling_with_a_reduced_draft_follows_the_target_and_a_misreported_q_is_caught(monkeypatch):
    """The target gives token 2 probability 0.1-0.3 after every token; the draft vocabulary lacks it,
    so only the residual distribution can produce it. The power check reports a draft distribution
    renormalised over the whole vocabulary (mass outside the subset) while drawing inside it: the
    chi-square test must then fail."""
    from test_lossless_sampling import SPS, _chi_square_p_value

    factory = _reduced_chi_square_draft([0, 1, 3])
    p_value, scheduled = _chi_square_p_value(PrefixScheduler(SPS), draft_factory=factory)
    assert sum(scheduled[1:]) > 0, "the scheduler never verified a drafted token"
    assert p_value > 1e-3, f"a reduced draft deviates from the target distribution (p={p_value:.2e})"

    real = dspark_hf.decoding.candidate_generator.serial_sample

    def misreported(*args, **kwargs):
        sample = real(*args, **kwargs)
        # what a wrong renormalisation reports: a finite logit outside the subset, 1 below the row's maximum
        row_max = sample.logits.amax(-1, keepdim=True)
        sample.logits = torch.where(torch.isinf(sample.logits), row_max - 1.0, sample.logits)
        if sample.probabilities is not None:  # (none when nothing was admitted) what the verification reads
            sample.probabilities = torch.softmax(sample.logits, -1)
        return sample

    monkeypatch.setattr(dspark_hf.decoding.candidate_generator, "serial_sample", misreported)
    p_value, _ = _chi_square_p_value(PrefixScheduler(SPS), draft_factory=factory)
    assert p_value < 1e-5, f"the test failed to detect a misreported draft distribution (p={p_value:.2e})"


# ------------------------------------------------------------------------------ exact training loss
def test_cached_normaliser_tv_equals_the_full_vocabulary_distance():
    gen = torch.Generator().manual_seed(0)
    vocab, ids = 300, torch.tensor(sorted(torch.randperm(300, generator=gen)[:40].tolist()))
    target_logits = 2.5 * torch.randn(6, 3, vocab, generator=gen, dtype=torch.float64)
    draft_subset = 2.5 * torch.randn(6, 3, ids.numel(), generator=gen, dtype=torch.float64)
    labels = torch.randint(vocab, (6, 3), generator=gen)
    labels[0] = ids[:3]  # some labels inside the subset, most outside
    lse = torch.logsumexp(target_logits, -1)
    reduced = reduced_vocab_loss(draft_subset, target_logits[..., ids], lse, labels, ids, None,
                                 weights=position_weights(3), ce_weight=0.0, tv_weight=1.0, conf_weight=0.0)
    draft_full = scatter_to_vocab(draft_subset, ids, vocab, float("-inf"))
    q, p = torch.softmax(draft_full, -1), torch.softmax(target_logits, -1)
    l1 = (q - p).abs().sum(-1)
    assert torch.allclose(reduced["tv"].double(), l1.mean(), atol=1e-6)
    assert torch.allclose(reduced["loss"].double(), (l1 * position_weights(3).double()).sum(-1).mean(), atol=1e-5)
    # the full-vocabulary loss's CE is infinite for labels outside (q = 0): only its accuracy is comparable
    full = dspark_loss(draft_full, target_logits, labels, None)
    assert torch.equal(reduced["accuracy"], full["accuracy"])
    inside = torch.isin(labels, ids)
    assert abs(reduced["label_outside_share"].item() - (1 - inside.float().mean().item())) < 1e-6
    # cross-entropy: exact where the label is inside, skipped (not infinite) outside
    with_ce = reduced_vocab_loss(draft_subset, target_logits[..., ids], lse, labels, ids, None,
                                 weights=position_weights(3), ce_weight=1.0, tv_weight=0.0, conf_weight=0.0)
    expected = -torch.log_softmax(draft_full, -1).gather(-1, labels[..., None]).squeeze(-1)[inside].mean()
    assert math.isfinite(with_ce["ce"].item()) and abs(with_ce["ce"].item() - expected.item()) < 1e-5
    # to the target's distribution: -sum over the subset of p_t log q (the mass outside is the TV term's)
    soft = reduced_vocab_loss(draft_subset, target_logits[..., ids], lse, labels, ids, None,
                              weights=position_weights(3), ce_weight=1.0, tv_weight=0.0, conf_weight=0.0,
                              ce_target="distribution")
    p_subset = torch.softmax(target_logits, -1)[..., ids]
    expected_soft = -(p_subset * torch.log_softmax(draft_subset, -1)).sum(-1)
    assert abs(soft["ce"].item() - expected_soft.mean().item()) < 1e-5
    assert abs(soft["label_outside_share"].item() - with_ce["label_outside_share"].item()) < 1e-9


def test_vocabulary_choice_and_coverage():
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 2])
    assert select_draft_vocab(counts, 3).tolist() == [2, 3, 5]
    assert select_draft_vocab(counts, 3, required_ids=[6]).tolist() == [2, 3, 6]  # ties: the lower id first
    with pytest.raises(ValueError, match="smaller than the 2 special ids"):
        select_draft_vocab(counts, 1, required_ids=[0, 1])
    train_items = [{"prompt_ids": [7, 7], "answer_ids": [1, 1, 2, 3]}]
    held_out = [{"ids": torch.tensor([7, 1, 4]), "answer_start": 1}]
    rows = coverage_table(train_items, held_out, vocab_size=8, sizes=[1, 2, 8])
    assert [r["size"] for r in rows] == [1, 2, 8]
    assert [round(r["held_out_coverage"], 3) for r in rows] == [0.5, 0.5, 1.0]
    assert coverage(torch.tensor([1]), token_counts(torch.tensor([1, 1]), 8).nonzero().flatten()) == 1.0


# ------------------------------------------------------------------------------ CUDA op path (emulated)
@pytest.fixture
def op_on_cpu(monkeypatch):
    """Runs serial_sample's CUDA-op path on CPU: the device test and the build are stubbed and the
    operator is the PyTorch emulation of the kernels (tests/test_cuda_op_cpu.py), fed the op's own
    arguments (so the padded W2 that serial_sample_cuda builds is what it reads)."""
    from test_cuda_op_cpu import emulated_op

    calls = []

    def run_op(U, H, x0, w1, w2, gate_w, gate_b, conf_w, conf_b, conf_t, uniforms, temperature, fused):
        calls.append({"w2": w2, "U": U})
        markov = None if w1 is None else SimpleNamespace(
            markov_w1=SimpleNamespace(weight=w1), markov_w2=SimpleNamespace(weight=w2),
            head_type="gated" if gate_w is not None else "vanilla",
            gate_proj=SimpleNamespace(weight=gate_w, bias=gate_b))
        confidence = None if conf_w is None else SimpleNamespace(
            proj=SimpleNamespace(weight=conf_w, bias=conf_b), with_markov=conf_w.shape[1] > H.shape[-1])
        heads = SimpleNamespace(markov_head=markov, confidence_head=confidence, config=SimpleNamespace(
            confidence_temperatures=None if conf_t is None else conf_t.tolist()))
        out = emulated_op(heads, U, H, x0, do_sample=uniforms is not None, temperature=temperature,
                          uniforms=uniforms, fused_max_rows=fused)
        return out.tokens, out.logits, out.confidences if out.confidences is not None else torch.empty(0)

    pretend_cuda_op_is_built(monkeypatch, "_run_op", run_op)
    return calls


@pytest.mark.parametrize("head_type", ["vanilla", "gated"])
def test_cuda_op_path_with_a_reduced_draft_equals_the_eager_path(op_on_cpu, head_type):
    target = _target()
    draft = _reduced_draft(target, head_type=head_type)
    draft.bind_target(target)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 4, 32, generator=gen)
    anchors = torch.tensor([1, 2, 40])  # 1 and 40 are outside the draft vocabulary: W1 reads any token
    uniforms = torch.rand(3, 4, generator=gen)
    warper = LogitsProcessorList([TemperatureLogitsWarper(0.8)])
    with torch.no_grad():
        base = draft.base_logits(hidden)
        for do_sample in (False, True):
            kwargs = dict(do_sample=do_sample, uniforms=uniforms, logits_processor=warper,
                          prefix_ids=anchors[:, None])
            op = serial_sample(draft, base, hidden, anchors, backend="cuda", **kwargs)
            eager = serial_sample(draft, base, hidden, anchors, backend="reference", **kwargs)
            assert torch.equal(op.tokens, eager.tokens) and set(op.tokens.flatten().tolist()) <= set(IDS)
            torch.testing.assert_close(op.logits, eager.logits, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(op.confidences, eager.confidences)
    w2 = op_on_cpu[0]["w2"]
    assert tuple(w2.shape) == (V, 8)  # the kernels read a vocabulary-wide W2 ...
    assert torch.equal(w2[IDS], draft.markov_head.markov_w2.weight)
    assert not w2[[t for t in range(V) if t not in IDS]].any()  # ... with zero rows outside the subset
    assert op_on_cpu[1]["w2"] is w2  # built once and cached


# ------------------------------------------------------------------------------ Hub export
def test_export_keeps_the_field_and_refuses_the_deepspec_layout(tmp_path):
    target = _target()
    draft = _reduced_draft(target)
    folder = export(draft, tmp_path / "hf", target=target)
    assert json.loads((folder / "config.json").read_text())["draft_vocab_size"] == len(IDS)
    assert load_file(str(folder / "model.safetensors"))["draft_vocab_ids"].tolist() == IDS
    card = render_model_card(folder)
    assert f"| Draft vocabulary | {len(IDS)} of the {V} target tokens" in card
    assert "Draft vocabulary" not in render_model_card(export(DSparkDraftModel.from_target(target), tmp_path / "full"))
    with pytest.raises(ValueError, match="reduced draft vocabulary.*format='hf'"):
        export(draft, tmp_path / "deepspec", format="deepspec", target=target)


def test_remote_code_load_of_an_exported_reduced_draft(tmp_path):
    target = _target()
    draft = _reduced_draft(target)
    expected = drafting_signature(draft, target)
    folder = export(draft, tmp_path / "draft", target=target)
    target.save_pretrained(tmp_path / "target")
    cache = tmp_path / "hf_home" / "hub"
    install_in_hub_cache(folder, "org/reduced-draft", cache)
    install_in_hub_cache(tmp_path / "target", "org/tiny-target", cache)
    report = run_isolated(
        f"""
        import torch
        from transformers import AutoModel, AutoModelForCausalLM
        draft = AutoModel.from_pretrained("org/reduced-draft", trust_remote_code=True)
        import dspark_hf
        from hub_helpers import drafting_signature, PROMPT
        target = AutoModelForCausalLM.from_pretrained("org/tiny-target")
        report = {{"ids": draft.draft_vocab_ids.tolist(), "signature": drafting_signature(draft, target)}}
        prompt = torch.tensor([PROMPT])
        draft.generation_config.dspark_verify_policy = dspark_hf.FixedLengthPolicy(4)
        plain = target.generate(prompt, max_new_tokens=20, do_sample=False)
        report["same"] = torch.equal(target.generate(prompt, max_new_tokens=20, do_sample=False,
                                                     assistant_model=draft), plain)
        """,
        tmp_path / "hf_home",
    )
    assert report["ids"] == IDS and report["same"]
    assert_same_drafting(report["signature"], expected)


# ------------------------------------------------------------------------------ training
def test_training_with_a_reduced_vocabulary(tmp_path):
    table = torch.log(torch.softmax(torch.randn(12, 12, generator=torch.Generator().manual_seed(0)) * 3, -1))
    target = bigram_target(table, eos_token_id=11)
    gen = torch.Generator().manual_seed(1)
    records = []
    for _ in range(6):
        prompt = torch.randint(0, 12, (1, 4), generator=gen)
        out = target.generate(prompt, max_new_tokens=40, do_sample=True, top_k=None, min_new_tokens=40)
        records.append({"prompt_ids": prompt[0].tolist(), "answer_ids": out[0, 4:].tolist()})
    cfg = TrainingConfig(block_size=3, markov_rank=12, max_steps=30, warmup_steps=5, log_every=10,
                         save_every=100, sequences_per_step=2, anchors_per_sequence=8, mask_token_id=10,
                         learning_rate=3e-3, target_layer_ids=[0], draft_vocab_size=8)
    path = tmp_path / "features.pt"
    items = build_feature_cache(target, records, cfg.target_layer_ids, path, 512)
    assert "target_lse" not in items[0]
    items = build_feature_cache(target, records, cfg.target_layer_ids, path, 512, with_target_lse=True)
    reloaded = torch.load(path, weights_only=True)["items"]  # re-saved with the normaliser
    head = target.get_output_embeddings()
    for item in reloaded:
        assert item["target_lse"].dtype == torch.float32 and item["target_lse"].shape == item["ids"].shape
        torch.testing.assert_close(item["target_lse"], torch.logsumexp(head(item["final"].float()), -1))
    draft = train(target, items, cfg, tmp_path / "draft")
    ids = draft.draft_vocab_ids.tolist()
    assert len(ids) == 8 and {10, 11} <= set(ids)  # the mask token and EOS are always in
    log = [json.loads(line) for line in (tmp_path / "draft" / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == 3 and all(0.0 <= r["label_outside_share"] < 0.5 for r in log)
    saved = DSparkDraftModel.from_pretrained(tmp_path / "draft")
    assert saved.draft_vocab_ids.tolist() == ids
    # the step loss equals the full-vocabulary loss of the same draft with q = 0 outside the subset
    saved.bind_target(target)
    item, anchors = items[0], torch.tensor([4, 9, 20])
    with torch.no_grad():
        reduced = step_loss(saved, head, item, anchors, cfg)
        base, hidden, previous, labels = draft_block_outputs(saved, item, anchors)
        subset, confidence = serial_logits_teacher_forced(saved, base, hidden, previous)
        assert subset.shape[-1] == 8
        final = item["final"].float()[anchors[:, None] + torch.arange(3)]
        full = dspark_loss(scatter_to_vocab(subset, saved.draft_vocab_ids, 12, float("-inf")), head(final), labels,
                           confidence, ce_weight=0.0)
    assert abs(reduced["tv"].item() - full["tv"].item()) < 1e-5
    assert torch.allclose(reduced["acceptance"], full["acceptance"], atol=1e-5)
    assert torch.equal(reduced["accuracy"], full["accuracy"])
