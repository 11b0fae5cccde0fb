"""Packed weights on huge pages: the same bytes in one 2 MB-aligned buffer, the same outputs bit for bit, and a
logged no-op where Linux offers no transparent huge pages."""

import logging

import pytest
import torch

import dspark_cpu.huge_pages as huge_pages
import dspark_cpu.row_block as row_block
from dspark_cpu import optimize_for_cpu
from dspark_cpu.fast_path import PackedLinear
from dspark_hf.machine import transparent_huge_pages_mode
from tiny_models import random_target

_UNAVAILABLE = huge_pages.huge_pages_unavailable_reason()
needs_huge_pages = pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"no transparent huge pages: {_UNAVAILABLE}")
_NO_KERNEL = row_block.row_block_unavailable_reason()
needs_kernel = pytest.mark.skipif(_NO_KERNEL is not None, reason=f"row-block kernel unavailable: {_NO_KERNEL}")


@pytest.mark.parametrize("setting, usable", [("always madvise [never]\n", False), ("[always] madvise never\n", True),
                                             ("always [madvise] never\n", True)])
def test_the_kernel_setting_decides(setting, usable, tmp_path, monkeypatch):
    if huge_pages._madvise() is None:
        pytest.skip("no madvise in this C library")
    monkeypatch.setattr(huge_pages.sys, "platform", "linux")
    path = tmp_path / "enabled"
    path.write_text(setting)
    monkeypatch.setattr(huge_pages, "_THP_SETTING", path)
    reason = huge_pages.huge_pages_unavailable_reason()
    assert (reason is None) == usable
    assert transparent_huge_pages_mode(path) == setting.split("[")[1].split("]")[0]
    if not usable:
        assert "off" in reason and "[never]" in reason


def test_a_missing_setting_or_another_system_is_a_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(huge_pages, "_THP_SETTING", tmp_path / "absent")
    monkeypatch.setattr(huge_pages.sys, "platform", "linux")
    assert "cannot be read" in huge_pages.huge_pages_unavailable_reason()
    assert transparent_huge_pages_mode(tmp_path / "absent") is None
    monkeypatch.setattr(huge_pages.sys, "platform", "darwin")
    assert "Linux" in huge_pages.huge_pages_unavailable_reason()


@needs_huge_pages
@pytest.mark.parametrize("nbytes", [1, 3 * 2**20 + 5])
def test_the_buffer_starts_on_a_huge_page(nbytes):
    buffer = huge_pages.huge_page_buffer(nbytes)
    assert buffer.dtype == torch.uint8 and buffer.numel() == nbytes
    assert buffer.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0


@needs_huge_pages
def test_copies_keep_values_and_let_go_of_the_originals_in_order():
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(5, 7, generator=generator), torch.randint(0, 9, (3,), dtype=torch.int64),
               torch.randn(4, 3, 2, generator=generator).to(torch.bfloat16), torch.empty(0)]
    expected = [t.clone() for t in tensors]
    pending = list(tensors)
    replaced = []

    def replace(old, new):
        replaced.append((old, new))
        assert pending[len(replaced) - 1] is None  # the list no longer holds the tensor being replaced

    nbytes = huge_pages.copy_to_huge_pages(pending, replace)
    assert [old for old, _ in replaced] == tensors and pending == [None] * 4
    starts = [new.data_ptr() for _, new in replaced[:3]]
    assert starts[0] % huge_pages.HUGE_PAGE_BYTES == 0 and all(s % 64 == 0 for s in starts)
    assert starts == sorted(starts) and starts[-1] - starts[0] < nbytes  # one buffer, in order
    for (_, new), want in zip(replaced, expected):
        assert new.dtype == want.dtype and torch.equal(new, want) and huge_pages.on_huge_pages(new)
    assert not huge_pages.on_huge_pages(tensors[0])
    with pytest.raises(ValueError, match="contiguous"):
        huge_pages.copy_to_huge_pages([torch.randn(4, 4).t()], replace)


def _row_block_copies(model):
    return [m._packed_weight() for m in model.modules() if isinstance(m, PackedLinear)]


@needs_huge_pages
@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prepared_model_reads_its_packed_weights_from_huge_pages_with_the_same_outputs(dtype, caplog):
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    ordinary = optimize_for_cpu(random_target(seed=3).to(dtype), packed_kernel="row_block", packed_min_rows=1,
                                huge_pages=False)
    with caplog.at_level(logging.INFO, logger="dspark_cpu.fast_path"):
        huge = optimize_for_cpu(random_target(seed=3).to(dtype), packed_kernel="row_block", packed_min_rows=1)
    assert "onto memory advised for 2 MB pages" in caplog.text
    copies = _row_block_copies(huge)
    assert copies and all(huge_pages.on_huge_pages(c) for c in copies)
    assert not any(huge_pages.on_huge_pages(c) for c in _row_block_copies(ordinary))
    for layer in (m for m in huge.modules() if isinstance(m, PackedLinear)):
        assert torch.equal(layer._packed_weight(), row_block.pack_row_blocks(layer.weight))
    with torch.no_grad():
        assert torch.equal(huge(ids).logits, ordinary(ids).logits)

    pointers = [c.data_ptr() for c in copies]
    optimize_for_cpu(huge, packed_kernel="row_block", packed_min_rows=1)  # idempotent: nothing is copied again
    assert [c.data_ptr() for c in _row_block_copies(huge)] == pointers

    layer = huge.model.layers[0].mlp.down_proj
    with torch.no_grad():
        layer.weight.mul_(2)  # changed in place: the layer packs it again, in ordinary memory
        x = torch.randn(3, layer.in_features).to(dtype)
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight), rtol=2e-2, atol=2e-2)
    assert not huge_pages.on_huge_pages(layer._packed_weight())


@needs_kernel
def test_without_huge_pages_the_weights_stay_and_the_reason_is_logged(monkeypatch, caplog):
    monkeypatch.setattr(huge_pages, "huge_pages_unavailable_reason", lambda: "transparent huge pages are off (test)")
    with caplog.at_level(logging.INFO, logger="dspark_cpu.fast_path"):
        model = optimize_for_cpu(random_target(seed=4), packed_kernel="row_block", packed_min_rows=1)
    assert "packed weights stay on ordinary pages: transparent huge pages are off (test)" in caplog.text
    assert not any(huge_pages.on_huge_pages(c) for c in _row_block_copies(model))


@needs_kernel
@pytest.mark.parametrize("error", [OSError(22, "madvise(MADV_HUGEPAGE) failed on a 2 MB buffer"),
                                   RuntimeError("madvise(MADV_HUGEPAGE) failed: DefaultCPUAllocator: not enough memory")])
def test_a_failing_madvise_keeps_the_weights_where_they_are(error, monkeypatch, caplog):
    def fail(nbytes):
        raise error

    monkeypatch.setattr(huge_pages, "huge_pages_unavailable_reason", lambda: None)
    monkeypatch.setattr(huge_pages, "huge_page_buffer", fail)
    with caplog.at_level(logging.INFO, logger="dspark_cpu.fast_path"):
        model = optimize_for_cpu(random_target(seed=4), packed_kernel="row_block", packed_min_rows=1)
    assert "stay on ordinary pages" in caplog.text and "madvise(MADV_HUGEPAGE) failed" in caplog.text
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, optimize_for_cpu(random_target(seed=4), packed_kernel="row_block",
                                                               packed_min_rows=1, huge_pages=False)(ids).logits)


def test_onednn_copies_are_left_alone():
    model = optimize_for_cpu(random_target(seed=5), packed_kernel="onednn", packed_min_rows=1)
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert layers and not any(huge_pages.on_huge_pages(m._packed_weight()) for m in layers)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))


@needs_huge_pages
@needs_kernel
def test_a_layer_packed_like_a_huge_page_layer_goes_there_too():
    from dspark_cpu.fast_path import packed_like

    for huge in (True, False):
        source = optimize_for_cpu(random_target(seed=6), packed_kernel="row_block", packed_min_rows=1,
                                  huge_pages=huge).lm_head
        rows = torch.nn.Linear(source.in_features, 7, bias=False)
        with torch.no_grad():
            rows.weight.copy_(source.weight[:7])
        packed = packed_like(source, rows)
        assert isinstance(packed, PackedLinear) and huge_pages.on_huge_pages(packed._packed_weight()) == huge
        x = torch.randn(2, source.in_features)
        with torch.no_grad():
            assert torch.equal(packed(x), source(x)[:, :7])
