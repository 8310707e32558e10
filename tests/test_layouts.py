"""autotile.layouts: outputs laid out as their inputs, as torch's cuDNN attention lays them out."""
import torch

from autotile.layouts import matching_strides, same_layout, with_strides


def test_matching_strides_of_a_contiguous_tensor_are_its_own():
    t = torch.empty(2, 3, 5, 8)
    assert matching_strides(t) == t.stride()


def test_matching_strides_follow_a_transposed_projection():
    # (B, S, H, D) storage seen as (B, H, S, D): the output keeps S outside H, so o.transpose(1, 2) is contiguous.
    q = torch.empty(2, 7, 4, 16).transpose(1, 2)
    strides = matching_strides(q)
    assert strides == q.stride()
    assert torch.empty_strided(q.shape, strides).transpose(1, 2).is_contiguous()


def test_matching_strides_of_a_slice_of_packed_qkv_are_dense():
    qkv = torch.empty(2, 7, 3, 4, 16)  # (B, S, 3, H, D), as a fused QKV projection leaves it
    q = qkv[:, :, 0].transpose(1, 2)
    assert matching_strides(q) == (7 * 4 * 16, 16, 4 * 16, 1)


def test_ties_go_to_the_lower_index_and_address_memory_as_the_input_does():
    # Decode: S = 1 ties with B; torch's alloc_with_matching_layout (a stable sort) puts B inside S.
    q = torch.empty(3, 1, 4, 16).transpose(1, 2)
    assert matching_strides(q) == (64, 16, 192, 1)
    assert same_layout(q, matching_strides(q))


def test_with_strides_keeps_views_and_copies_only_other_layouts():
    t = torch.randn(2, 1, 5, 8)
    assert with_strides(t, t.stride()) is t
    odd = t.as_strided(t.shape, (40, 999, 8, 1))  # only the size-1 dimension's stride differs
    view = with_strides(odd, t.stride())
    assert view.stride() == t.stride() and view.data_ptr() == t.data_ptr()
    other = t.transpose(2, 3).contiguous().transpose(2, 3)  # D outside S: another layout, so a copy
    assert not same_layout(other, t.stride())
    moved = with_strides(other, t.stride())
    assert moved.stride() == t.stride() and moved.data_ptr() != other.data_ptr() and torch.equal(moved, t)


def test_a_broadcast_dimension_goes_outermost_and_the_last_stays_innermost():
    k = torch.empty(2, 1, 9, 16).expand(2, 4, 9, 16)  # one key head shared by four query heads
    assert matching_strides(k) == (9 * 16, 2 * 9 * 16, 16, 1)
    odd = torch.empty(2, 3, 1, 16).as_strided((2, 3, 1, 16), (48, 16, 1, 1))  # a size-1 dimension of stride 1
    assert matching_strides(odd)[-1] == 1
