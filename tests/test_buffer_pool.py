"""The cache buffer pool (`buffer_pool_deepseek_v41_vl.py`): a freed buffer of the same role and
shape comes back (so CUDA decode graphs keyed by its address replay), one still referenced (by a
cache, or through a view) never does, free bytes past the bound are released, and caches use it
only on CUDA without autograd. The pool itself is device-agnostic, so it is tested on the CPU."""

from __future__ import annotations

import torch

import deepseek_v41_vl.modeling.buffer_pool_deepseek_v41_vl as pool_module
from deepseek_v41_vl.modeling.buffer_pool_deepseek_v41_vl import DeepseekV41BufferPool, cache_buffer
from deepseek_v41_vl.modeling.cache_deepseek_v41_vl import DeepseekV41RowBuffer

ROLE = (3, "window_kv")


def test_a_freed_buffer_comes_back_one_in_use_never():
    pool = DeepseekV41BufferPool()
    a = pool.take(ROLE, (2, 8, 4), torch.bfloat16, torch.device("cpu"))
    b = pool.take(ROLE, (2, 8, 4), torch.bfloat16, torch.device("cpu"))
    assert a.data_ptr() != b.data_ptr()
    address = a.data_ptr()
    del a
    again = pool.take(ROLE, (2, 8, 4), torch.bfloat16, torch.device("cpu"))
    assert again.data_ptr() == address
    # another role, shape or dtype gets its own tensor
    assert pool.take((4, "window_kv"), (2, 8, 4), torch.bfloat16, torch.device("cpu")).data_ptr() != address
    assert pool.take(ROLE, (2, 16, 4), torch.bfloat16, torch.device("cpu")).data_ptr() != address
    # a view keeps its storage in use
    view = again[:, :2]
    del again
    assert pool.take(ROLE, (2, 8, 4), torch.bfloat16, torch.device("cpu")).data_ptr() != address
    del view
    assert pool.take(ROLE, (2, 8, 4), torch.bfloat16, torch.device("cpu")).data_ptr() == address


def test_held_by_an_object_is_in_use():
    pool = DeepseekV41BufferPool()

    class Holder:
        pass

    holder = Holder()
    holder.data = pool.take(ROLE, (4,), torch.float32, torch.device("cpu"))
    address = holder.data.data_ptr()
    assert pool.take(ROLE, (4,), torch.float32, torch.device("cpu")).data_ptr() != address
    del holder
    assert pool.take(ROLE, (4,), torch.float32, torch.device("cpu")).data_ptr() == address


def test_free_bytes_past_the_bound_are_released():
    pool = DeepseekV41BufferPool(max_free_bytes=1024)
    first = pool.take(ROLE, (256,), torch.float32, torch.device("cpu"))  # 1024 bytes
    del first
    assert pool.free_bytes() == 1024
    second = pool.take((5, "index_k"), (256,), torch.float32, torch.device("cpu"))  # the first stays: at the bound
    second_address = second.data_ptr()
    assert pool.free_bytes() == 1024
    del second
    third = pool.take((6, "index_k"), (8,), torch.float32, torch.device("cpu"))  # 2048 free > 1024: the oldest goes
    assert pool.free_bytes() == 1024
    assert pool.take((5, "index_k"), (256,), torch.float32, torch.device("cpu")).data_ptr() == second_address
    kept = pool.take(ROLE, (256,), torch.float32, torch.device("cpu"))
    assert pool.free_bytes() == 1024  # the second, free again
    del third, kept
    pool.clear()
    assert pool.free_bytes() == 0


def test_caches_pool_only_on_cuda_without_autograd(monkeypatch):
    taken = []
    monkeypatch.setattr(pool_module._POOL, "take", lambda *a: taken.append(a) or torch.empty(a[1], dtype=a[2]))
    with torch.no_grad():
        cpu = cache_buffer(ROLE, (2, 3), torch.float32, torch.device("cpu"), -torch.inf)
    assert taken == [] and bool((cpu == -torch.inf).all())
    # a CUDA device without autograd: the pool (faked here: the CPU cannot hold CUDA tensors)
    with torch.no_grad():
        pooled = cache_buffer(ROLE, (2, 3), torch.float32, torch.device("cuda"), 0.0)
        assert len(taken) == 1 and bool((pooled == 0).all())
        cache_buffer(None, (2, 3), torch.float32, torch.device("cpu"), 0.0)
    assert len(taken) == 1
    with torch.enable_grad():
        cache_buffer(ROLE, (2, 3), torch.float32, torch.device("cpu"), 0.0)
    assert len(taken) == 1


def test_row_buffers_hold_power_of_two_capacities_with_zeros_past_the_rows():
    rows = torch.randn(2, 5, 3)
    buffer = DeepseekV41RowBuffer(rows)
    assert buffer.storage(8).shape == (2, 8, 3) and torch.equal(buffer.rows(5), rows)
    assert bool((buffer.storage(8)[:, 5:] == 0).all())
    buffer.write(5, torch.ones(2, 4, 3))
    assert buffer.length == 9 and buffer.storage(16).shape == (2, 16, 3)
    assert torch.equal(buffer.rows(5), rows) and bool((buffer.storage(16)[:, 9:] == 0).all())
    assert DeepseekV41RowBuffer.empty(rows).length == 0


def test_a_finished_generate_leaves_no_cache_alive(tiny_model):
    """A cache must die by reference counting as soon as `generate` returns (a reference cycle
    would keep it, and its buffers, until the cyclic collector runs: the next call would allocate
    new buffers and capture every decode graph again)."""
    import gc

    from deepseek_v41_vl.modeling.cache_deepseek_v41_vl import DeepseekV41Cache

    def live_caches() -> int:
        return sum(isinstance(o, DeepseekV41Cache) for o in gc.get_objects())

    ids = torch.tensor([[5, 6, 7, 8]])
    gc.collect()
    gc.disable()
    try:
        before = live_caches()
        tiny_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=3)
        assert live_caches() == before
    finally:
        gc.enable()
