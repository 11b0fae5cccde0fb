"""Training pieces: the loss on a hand-computed case, anchors, the block mask, loss going down,
and Sequential Temperature Scaling on synthetic data with known miscalibration."""

import dataclasses
import json
import math

import pytest
import torch

from dspark_hf import DSparkDraftModel
from dspark_hf.training.calibration import per_position_ece, sequential_temperature_scaling
from dspark_hf.training.trainer import (
    TrainingConfig,
    block_attention_mask,
    build_feature_cache,
    dspark_loss,
    make_draft,
    sample_anchors,
    step_loss,
    train,
)
from tiny_models import bigram_target


def test_loss_matches_hand_computation():
    # one block, gamma = 2, vocabulary of 2
    draft_logits = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0]]])  # p_d = (.5,.5), (.75,.25)
    target_logits = torch.tensor([[[math.log(4.0), 0.0], [0.0, 0.0]]])  # p_t = (.8,.2), (.5,.5)
    labels = torch.tensor([[0, 1]])
    conf_logits = torch.tensor([[0.0, math.log(4.0)]])  # c = 0.5, 0.8
    out = dspark_loss(draft_logits, target_logits, labels, conf_logits)
    ce = [-math.log(0.5), -math.log(0.25)]
    tv = [0.6, 0.5]  # |.5-.8| + |.5-.2| ; |.75-.5| + |.25-.5|
    acc = [0.7, 0.75]  # 1 - tv/2
    bce = [-(a * math.log(c) + (1 - a) * math.log(1 - c)) for a, c in zip(acc, [0.5, 0.8])]
    w = [1.0, math.exp(-1 / 2)]
    expected = sum(w[k] * (0.1 * ce[k] + 0.9 * tv[k] + 1.0 * bce[k]) for k in range(2))
    assert abs(out["loss"].item() - expected) < 1e-5
    assert abs(out["tv"].item() - 0.55) < 1e-6
    assert torch.allclose(out["acceptance"], torch.tensor(acc))
    assert out["accuracy"].tolist() == [1.0, 0.0]  # argmax is 0 at both positions (a tie picks 0); labels 0, 1
    # without a confidence head the BCE term disappears
    no_conf = dspark_loss(draft_logits, target_logits, labels, None)
    assert abs(no_conf["loss"].item() - sum(w[k] * (0.1 * ce[k] + 0.9 * tv[k]) for k in range(2))) < 1e-5

    # cross-entropy to the target's distribution instead of the label: -sum p_t log p_d
    soft = dspark_loss(draft_logits, target_logits, labels, None, ce_target="distribution")
    soft_ce = [-(0.8 * math.log(0.5) + 0.2 * math.log(0.5)), -(0.5 * math.log(0.75) + 0.5 * math.log(0.25))]
    assert abs(soft["ce"].item() - sum(soft_ce) / 2) < 1e-6
    assert abs(soft["loss"].item() - sum(w[k] * (0.1 * soft_ce[k] + 0.9 * tv[k]) for k in range(2))) < 1e-5
    with pytest.raises(ValueError, match="ce_target='distrib'.*'label'.*'distribution'"):
        dspark_loss(draft_logits, target_logits, labels, None, ce_target="distrib")

def test_anchor_sampling():
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        anchors = sample_anchors(seq_len=40, answer_start=10, num_anchors=8, block_size=7, generator=gen)
        assert anchors.numel() == 8
        assert anchors.tolist() == sorted(set(anchors.tolist()))
        assert anchors.min() >= 9 and anchors.max() <= 40 - 1 - 7
    few = sample_anchors(seq_len=20, answer_start=10, num_anchors=8, block_size=7, generator=gen)
    assert sorted(few.tolist()) == [9, 10, 11, 12]  # only 4 valid anchors
    assert sample_anchors(seq_len=12, answer_start=10, num_anchors=8, block_size=7, generator=gen).numel() == 0


def test_block_mask_by_hand():
    mask = block_attention_mask(torch.tensor([1, 3]), context_len=3, block_size=2)
    expected = torch.tensor([
        # ctx0 ctx1 ctx2 | b0 b0 b1 b1
        [1, 0, 0, 1, 1, 0, 0],  # block of anchor 1 sees context 0 only, and itself
        [1, 0, 0, 1, 1, 0, 0],
        [1, 1, 1, 0, 0, 1, 1],  # block of anchor 3 sees context 0..2, and itself
        [1, 1, 1, 0, 0, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(mask, expected)


def _bigram_setup(tmp_path):
    table = torch.log(torch.softmax(torch.randn(12, 12, generator=torch.Generator().manual_seed(0)) * 3, -1))
    target = bigram_target(table)
    gen = torch.Generator().manual_seed(1)
    records = []
    for _ in range(8):
        prompt = torch.randint(0, 12, (1, 4), generator=gen)
        out = target.generate(prompt, max_new_tokens=40, do_sample=True, top_k=None)
        records.append({"prompt_ids": prompt[0].tolist(), "answer_ids": out[0, 4:].tolist()})
    cfg = TrainingConfig(block_size=3, markov_rank=12, max_steps=80, warmup_steps=5, log_every=20,
                         save_every=40, sequences_per_step=2, anchors_per_sequence=8, mask_token_id=11,
                         learning_rate=3e-3)
    cfg.target_layer_ids = make_draft(target, cfg).config.target_layer_ids
    items = build_feature_cache(target, records, cfg.target_layer_ids, tmp_path / "features.pt", 512)
    return target, items, cfg


def _eval_loss(draft, target, items, cfg):
    gen = torch.Generator().manual_seed(99)
    with torch.no_grad():
        losses = []
        for item in items:
            anchors = sample_anchors(item["ids"].numel(), item["answer_start"], 8, cfg.block_size, gen)
            losses.append(step_loss(draft, target.get_output_embeddings(), item, anchors, cfg)["loss"])
    return torch.stack(losses).mean().item()


def test_training_steps_reduce_the_loss_and_resume(tmp_path):
    target, items, cfg = _bigram_setup(tmp_path)
    torch.manual_seed(cfg.seed)
    before = _eval_loss(make_draft(target, cfg).eval(), target, items, cfg)
    cfg.snapshot_every = 40
    draft = train(target, items, cfg, tmp_path / "draft")
    after = _eval_loss(draft.eval(), target, items, cfg)
    assert after < 0.7 * before, (before, after)
    # the step-40 snapshot is a loadable draft, part-way between the start and the end
    assert sorted(p.name for p in (tmp_path / "draft" / "snapshots").iterdir()) == ["step-40"]
    snapshot = DSparkDraftModel.from_pretrained(tmp_path / "draft" / "snapshots" / "step-40").eval()
    snapshot.bind_target(target)
    assert after < _eval_loss(snapshot, target, items, cfg) < before
    log = (tmp_path / "draft" / "train_log.jsonl").read_text().splitlines()
    assert len(log) == 4 and "accuracy_per_position" in log[-1]
    assert (tmp_path / "draft" / "checkpoint" / "step.json").exists()
    # resume from the step-40 checkpoint and finish the remaining steps
    cfg.max_steps = 60
    resumed = train(target, items, cfg, tmp_path / "draft", resume=True)
    assert _eval_loss(resumed.eval(), target, items, cfg) < before


def test_training_in_bfloat16_keeps_the_loss_in_float32_and_learns(tmp_path):
    from dspark_hf.training.precision import precision_context

    target, items, cfg = _bigram_setup(tmp_path)
    torch.manual_seed(cfg.seed)
    draft = make_draft(target, cfg).eval()
    anchors = sample_anchors(items[0]["ids"].numel(), items[0]["answer_start"], 8, cfg.block_size,
                             torch.Generator().manual_seed(3))
    head = target.get_output_embeddings()
    seen = []
    hook = draft.fc.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    with torch.no_grad():
        exact = step_loss(draft, head, items[0], anchors, cfg)
        with precision_context("bfloat16", torch.device("cpu")):
            rounded = step_loss(draft, head, items[0], anchors, cfg)
    hook.remove()
    assert seen == [torch.float32, torch.bfloat16]  # the matmuls ran in bfloat16 under the context
    assert rounded["loss"].dtype == torch.float32
    assert rounded["loss"].item() == pytest.approx(exact["loss"].item(), rel=0.02)
    torch.manual_seed(cfg.seed)
    before = _eval_loss(make_draft(target, cfg).eval(), target, items, cfg)
    trained = train(target, items, dataclasses.replace(cfg, precision="bfloat16"), tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16" / "training_progress.json").read_text())["precision"] == "bfloat16"
    assert _eval_loss(trained.eval(), target, items, cfg) < 0.7 * before
    assert trained.fc.weight.dtype == torch.float32  # the weights and the optimiser stay float32


def test_auto_precision_takes_bfloat16_only_where_this_machine_runs_it_clearly_faster(monkeypatch):
    import dspark_hf.training.precision as precision

    cpu = torch.device("cpu")
    assert precision.resolve_precision("bfloat16", cpu, rows=1, hidden=1, vocab=1) == ("bfloat16", "asked for")
    with pytest.raises(ValueError, match="float16.*auto, float32, bfloat16"):
        precision.resolve_precision("float16", cpu, rows=1, hidden=1, vocab=1)
    chosen, why = precision.resolve_precision("auto", cpu, rows=8, hidden=16, vocab=12)
    assert chosen == "float32" and "too little to matter" in why  # a tiny draft: the probe would be noise
    for fp32, bf16, expected in ((0.040, 0.015, "bfloat16"), (0.040, 0.035, "float32"), (0.040, 0.080, "float32")):
        times = iter([fp32, bf16])
        monkeypatch.setattr(precision, "_median_seconds", lambda fn, repeats=5: next(times))
        chosen, why = precision.resolve_precision("auto", cpu, rows=112, hidden=576, vocab=32768)
        assert chosen == expected and f"{fp32 / bf16:.2f}x" in why
    assert precision.resolve_precision("auto", torch.device("meta"), rows=1, hidden=1, vocab=1)[0] == "float32"


def test_sequential_temperature_scaling_recovers_known_miscalibration():
    gen = torch.Generator().manual_seed(0)
    true_logits = torch.randn(4000, 4, generator=gen) + 1.0
    acceptance = torch.sigmoid(true_logits)  # the real per-position acceptance
    true_temps = torch.tensor([0.5, 2.0, 1.0, 3.0])
    overconfident = true_logits / true_temps  # what an uncalibrated head outputs
    temps = sequential_temperature_scaling(overconfident, acceptance)
    assert torch.allclose(torch.tensor(temps), 1 / true_temps, rtol=0.1), temps
    before = per_position_ece(overconfident, acceptance)
    after = per_position_ece(overconfident, acceptance, temps)
    assert all(a < 0.02 for a in after) and max(before) > 0.05


def _save_perturbed_draft(target, cfg, folder, seed):
    """A draft made from ``cfg`` and saved to ``folder`` after a random nudge of every weight, so that
    its weights differ from any fresh initialisation (a warm start from it is then visible)."""
    torch.manual_seed(seed)
    saved = make_draft(target, cfg)
    with torch.no_grad():
        for p in saved.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    saved.save_pretrained(folder)
    return saved


def test_warm_start_from_a_saved_draft_copies_its_weights_and_refuses_a_mismatch(tmp_path):
    target, items, cfg = _bigram_setup(tmp_path)
    saved = _save_perturbed_draft(target, cfg, tmp_path / "v1", seed=5)
    warm = make_draft(target, dataclasses.replace(cfg, init_from_draft=str(tmp_path / "v1")))
    fresh = make_draft(target, cfg)
    for name, value in saved.state_dict().items():
        if name.startswith(("embed_tokens.", "lm_head.")):
            continue
        assert torch.equal(warm.state_dict()[name], value), name
    assert not torch.equal(fresh.fc.weight, saved.fc.weight)
    with pytest.raises(ValueError, match="markov_rank"):
        make_draft(target, dataclasses.replace(cfg, markov_rank=4, init_from_draft=str(tmp_path / "v1")))


def test_a_deeper_draft_warm_starts_from_a_shallower_one_and_starts_out_identical(tmp_path):
    target, items, cfg = _bigram_setup(tmp_path)
    saved = _save_perturbed_draft(target, cfg, tmp_path / "one-layer", seed=7)
    deeper_cfg = dataclasses.replace(cfg, num_hidden_layers=2, init_from_draft=str(tmp_path / "one-layer"))
    deeper = make_draft(target, deeper_cfg)
    assert len(deeper.layers) == 2
    for name, value in saved.layers[0].state_dict().items():
        assert torch.equal(deeper.layers[0].state_dict()[name], value), name
    added = deeper.layers[1]
    assert not torch.any(added.self_attn.o_proj.weight) and not torch.any(added.mlp.down_proj.weight)
    assert torch.any(added.self_attn.q_proj.weight)  # the rest keeps its start, so training can move it
    # the added residual block is an identity: same loss terms on the same blocks as the saved draft
    gen = torch.Generator().manual_seed(3)
    for item in items[:3]:
        anchors = sample_anchors(item["ids"].numel(), item["answer_start"], 4, cfg.block_size, gen)
        with torch.no_grad():
            mine = step_loss(deeper, target.get_output_embeddings(), item, anchors, deeper_cfg)
            theirs = step_loss(saved, target.get_output_embeddings(), item, anchors, cfg)
        for key in ("loss", "tv", "ce"):
            if key in theirs:
                torch.testing.assert_close(mine[key], theirs[key], rtol=1e-5, atol=1e-6)
    deeper.save_pretrained(tmp_path / "two-layer")
    with pytest.raises(ValueError, match="num_hidden_layers"):  # a shallower draft cannot start from it
        make_draft(target, dataclasses.replace(cfg, init_from_draft=str(tmp_path / "two-layer")))


def test_a_reduced_vocabulary_draft_warm_starts_from_a_full_one_with_its_markov_rows(tmp_path):
    target, items, cfg = _bigram_setup(tmp_path)
    saved = _save_perturbed_draft(target, cfg, tmp_path / "full", seed=6)
    ids = torch.tensor([0, 2, 3, 5, 8, 11])
    reduced_cfg = dataclasses.replace(cfg, draft_vocab_size=ids.numel(), init_from_draft=str(tmp_path / "full"))
    warm = make_draft(target, reduced_cfg, ids)
    assert torch.equal(warm.draft_vocab_ids, ids)
    assert torch.equal(warm.markov_head.markov_w2.weight, saved.markov_head.markov_w2.weight[ids])
    assert torch.equal(warm.markov_head.markov_w1.weight, saved.markov_head.markov_w1.weight)
    assert torch.equal(warm.fc.weight, saved.fc.weight)
    warm.save_pretrained(tmp_path / "reduced")
    with pytest.raises(ValueError, match="draft_vocab_size"):  # the other way round is refused
        make_draft(target, dataclasses.replace(cfg, init_from_draft=str(tmp_path / "reduced")))
