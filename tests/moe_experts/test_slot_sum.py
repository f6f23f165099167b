"""moe_lib.moe_experts.slot_sum: each token's K rows summed where the combine left them, kernel against float64."""

import pytest
import torch

from moe_lib.moe_experts import slot_sum

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def nan_filled(*size, dtype, device):
    return torch.full(size, float("nan"), dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("num_tokens", "top_k", "hidden_size"), [(5, 3, 40), (1, 1, 16), (7, 2, 9)])
def test_kernel_matches_the_float64_sum_in_slot_order(dtype, num_tokens, top_k, hidden_size, seed, monkeypatch):
    generator = torch.Generator().manual_seed(seed)
    spare = 3  # rows no slot points at: the kernel must not read them into any sum
    rows = torch.randn((num_tokens * top_k + spare, hidden_size), generator=generator).to(dtype)
    row_of_slot = torch.randperm(num_tokens * top_k + spare, generator=generator)[: num_tokens * top_k]
    monkeypatch.setattr(slot_sum, "allocate", lambda size, **kw: nan_filled(*size, **kw))
    out = slot_sum.sum_slot_rows_triton(rows, row_of_slot, num_tokens, top_k)
    by_slot = rows.double()[row_of_slot].view(num_tokens, top_k, hidden_size)
    exact, magnitude = by_slot.sum(dim=1), by_slot.abs().sum(dim=1)
    assert out.dtype == dtype and out.shape == (num_tokens, hidden_size) and not out.isnan().any()
    # the fp32 sum's K roundings (relative to the rows' magnitudes), then one rounding to the output dtype
    ulp = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    assert ((out.double() - exact).abs() <= ulp * exact.abs() + top_k * 2.0**-24 * magnitude).all()
    # the readable form agrees (it sums in fp32 too, in the same slot order)
    reference = slot_sum.sum_slot_rows_reference(rows, row_of_slot, num_tokens, top_k)
    assert torch.allclose(out.double(), reference.double(), rtol=ulp, atol=0)


@pytest.mark.parametrize("topk_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_tokens", "top_k", "partials"), [(5, 3, 4), (1, 1, 1), (7, 6, 3)])
def test_kernel_sums_each_slots_partials_in_the_same_launch(num_tokens, top_k, partials, topk_dtype, seed, monkeypatch):
    """grad_topk[t, k] = Σ_j partial[j, row_of_slot[t·K + k]]: against float64, rounded once; the rows' sums as
    without partials; no element left unwritten."""
    generator = torch.Generator().manual_seed(seed)
    spare = 3
    slots = num_tokens * top_k
    rows = torch.randn((slots + spare, 24), generator=generator).to(torch.bfloat16)
    row_of_slot = torch.randperm(slots + spare, generator=generator)[:slots].to(torch.int32)
    partial = torch.randn((partials, slots + spare), generator=generator)
    monkeypatch.setattr(slot_sum, "allocate", lambda size, **kw: nan_filled(*size, **kw))
    out, grad_topk = slot_sum.sum_slot_rows_triton(rows, row_of_slot, num_tokens, top_k, partial, topk_dtype)
    assert torch.equal(out, slot_sum.sum_slot_rows_triton(rows, row_of_slot, num_tokens, top_k))
    exact = partial.double()[:, row_of_slot.long()].sum(dim=0).view(num_tokens, top_k)
    magnitude = partial.double().abs()[:, row_of_slot.long()].sum(dim=0).view(num_tokens, top_k)
    ulp = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}[topk_dtype]
    assert grad_topk.dtype == topk_dtype and grad_topk.shape == (num_tokens, top_k) and not grad_topk.isnan().any()
    assert ((grad_topk.double() - exact).abs() <= ulp * exact.abs() + partials * 2.0**-24 * magnitude).all()
    reference = slot_sum.gathered_partials_reference(partial, row_of_slot.long(), num_tokens, top_k, topk_dtype)
    assert ((grad_topk.double() - reference.double()).abs() <= 2 * ulp * magnitude).all()


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "reference"])
def test_out_a_column_slice_gets_the_sums_and_nothing_beside_them(kernel, seed):
    """``out`` a column slice of a wider tensor (the engine layer's dX summed a column slice at a time): the sums
    land in the slice, bit for bit as allocated, and the columns beside it keep their values."""
    generator = torch.Generator().manual_seed(seed)
    num_tokens, top_k, width, wider = 5, 3, 24, 40
    rows = torch.randn((num_tokens * top_k, width), generator=generator).to(torch.bfloat16)
    row_of_slot = torch.randperm(num_tokens * top_k, generator=generator).to(torch.int32)
    partial = torch.randn((2, num_tokens * top_k), generator=generator)
    wide = torch.randn((num_tokens, wider), generator=generator).to(torch.bfloat16)
    before = wide.clone()
    cols = slice(8, 8 + width)
    run = slot_sum.sum_slot_rows_triton if kernel else slot_sum.sum_slot_rows
    out, grad_topk = run(rows, row_of_slot, num_tokens, top_k, partial, torch.float32, out=wide[:, cols])
    expected, expected_topk = run(rows, row_of_slot, num_tokens, top_k, partial, torch.float32)
    assert out.data_ptr() == wide[:, cols].data_ptr()
    assert torch.equal(wide[:, cols], expected) and torch.equal(grad_topk, expected_topk)
    assert torch.equal(wide[:, :8], before[:, :8]) and torch.equal(wide[:, 8 + width :], before[:, 8 + width :])


@pytest.mark.parametrize(
    ("shape", "dtype", "cols", "message"),
    [
        ((5, 23), torch.bfloat16, slice(None), r"out: expected \[5, 24\]"),
        ((5, 24), torch.float32, slice(None), r"out: expected \[5, 24\] torch.bfloat16"),
        ((24, 5), torch.bfloat16, "t", r"contiguous columns"),
    ],
    ids=["shape", "dtype", "strided_columns"],
)
def test_a_wrong_out_is_refused_before_any_work(shape, dtype, cols, message):
    rows = torch.randn((15, 24)).to(torch.bfloat16)
    row_of_slot = torch.randperm(15)
    out = torch.full(shape, 7.0, dtype=dtype)
    out = out.t() if cols == "t" else out[:, cols]
    with pytest.raises(ValueError, match=message):
        slot_sum.sum_slot_rows(rows, row_of_slot, 5, 3, out=out)
    assert (out == 7.0).all()


def test_cpu_rows_take_the_reference_with_partials_too():
    rows = torch.arange(12, dtype=torch.float64).view(6, 2)
    row_of_slot = torch.tensor([5, 0, 1, 4, 2, 3])
    partial = torch.arange(12, dtype=torch.float32).view(2, 6)
    out, grad_topk = slot_sum.sum_slot_rows(rows, row_of_slot, 3, 2, partial, torch.float64)
    assert out.tolist() == [[10.0, 12.0], [10.0, 12.0], [10.0, 12.0]]
    assert grad_topk.tolist() == [[16.0, 6.0], [8.0, 14.0], [10.0, 12.0]]  # partial[0, r] + partial[1, r] = 2r + 6


def test_cpu_rows_take_the_reference():
    rows = torch.arange(12, dtype=torch.float64).view(6, 2)
    row_of_slot = torch.tensor([5, 0, 1, 4, 2, 3])
    out = slot_sum.sum_slot_rows(rows, row_of_slot, 3, 2)
    assert out.tolist() == [[10.0, 12.0], [10.0, 12.0], [10.0, 12.0]]
    assert slot_sum.sum_slot_rows(rows[:0], row_of_slot[:0], 0, 2).shape == (0, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_kernel_matches_the_reference_at_the_layer_shape(dtype, seed):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    num_tokens, top_k, hidden_size = 4096, 8, 4096
    rows = torch.randn((num_tokens * top_k, hidden_size), generator=generator, device="cuda").to(dtype)
    row_of_slot = torch.randperm(num_tokens * top_k, generator=generator, device="cuda")
    out = slot_sum.sum_slot_rows(rows, row_of_slot, num_tokens, top_k)
    reference = slot_sum.sum_slot_rows_reference(rows, row_of_slot, num_tokens, top_k)
    ulp = {torch.float32: 2.0**-22, torch.bfloat16: 2.0**-7}[dtype]
    assert not out.isnan().any()
    assert ((out.double() - reference.double()).abs() <= ulp * reference.double().abs() + 1e-5).all()


@pytest.mark.gpu
def test_gpu_kernel_sums_the_partials_as_the_reference(seed):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    num_tokens, top_k, hidden_size, partials = 4096, 8, 2048, 16
    rows = torch.randn((num_tokens * top_k, hidden_size), generator=generator, device="cuda").to(torch.bfloat16)
    row_of_slot = torch.randperm(num_tokens * top_k, generator=generator, device="cuda").to(torch.int32)
    partial = torch.randn((partials, num_tokens * top_k), generator=generator, device="cuda")
    out, grad_topk = slot_sum.sum_slot_rows(rows, row_of_slot, num_tokens, top_k, partial, torch.float32)
    assert torch.equal(out, slot_sum.sum_slot_rows(rows, row_of_slot, num_tokens, top_k))
    exact = partial.double()[:, row_of_slot.long()].sum(dim=0).view(num_tokens, top_k)
    magnitude = partial.double().abs()[:, row_of_slot.long()].sum(dim=0).view(num_tokens, top_k)
    assert ((grad_topk.double() - exact).abs() <= partials * 2.0**-24 * magnitude).all()
