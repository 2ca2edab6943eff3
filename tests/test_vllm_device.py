"""The connector's worker side for vLLM's GPU backends (DeviceWorkerSide), driven through its step hooks as vLLM
calls them, on CPU tensors in the GPU layouts (vLLM's [B, H, N, C] views, built as vLLM's create_kv_cache_views
builds them: paged_views, compared with vLLM's own in test_vllm_paged_layouts) and through the staging buffers
a CUDA stream uses. Saves hold their request's blocks until the copies landed; async loads land exactly in
another layout; a missing chunk is reported as bad blocks. Needs vllm importable (.venv-vllm); skips otherwise."""
from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("vllm")

from kvfabric import CacheEngine, Config, KVLayout  # noqa: E402
from kvfabric.connectors.copy_stream import CpuCopyStream  # noqa: E402
from kvfabric.connectors.paged_views import DeviceLayer, PagedSpec, layer_views  # noqa: E402
from kvfabric.connectors.vllm.config import KVGroups  # noqa: E402
from kvfabric.connectors.vllm.device import DeviceWorkerSide  # noqa: E402
from kvfabric.connectors.vllm.metadata import KVFabricMetadata, LoadSpec, SaveSpec  # noqa: E402

BLOCK, CHUNK = 16, 32
LAYOUT = KVLayout(3, 2, 8, "float16")


class WatchedStream(CpuCopyStream):
    """The CPU stream, noting each CopyDone it records and which ones the engine's stream was told to wait for."""

    def __init__(self, staged: bool) -> None:
        super().__init__(staged=staged)
        self.recorded: list[int] = []
        self.held: list[int] = []

    def record(self):  # noqa: ANN201
        done, number, held = super().record(), len(self.recorded), self.held

        class Noted:
            is_done, wait = done.is_done, done.wait

            def hold_compute(self) -> None:
                held.append(number)

        self.recorded.append(number)
        return Noted()


def caches(layout: str, seed: int) -> dict[str, torch.Tensor]:
    spec = PagedSpec(layout, "kv", LAYOUT.num_layers, 24, LAYOUT.num_kv_heads, BLOCK, LAYOUT.head_dim, torch.float16)
    views = layer_views(torch.empty(spec.num_bytes, dtype=torch.uint8), spec)
    generator = torch.Generator().manual_seed(seed)
    for view in views:
        view.copy_(torch.randn(view.shape, generator=generator))
    return {f"model.layers.{i}.self_attn.attn": view for i, view in enumerate(views)}


def tokens_of(kv: dict[str, torch.Tensor], block_ids: list[int], start: int, end: int) -> torch.Tensor:
    out = torch.empty(LAYOUT.shape(end - start), dtype=torch.float16)
    for index, view in enumerate(kv.values()):
        DeviceLayer.of(view, "LBHNC").gather(block_ids, start, end, out[index])  # tokens: any block order
    return out


def side(config: Config, kv: dict[str, torch.Tensor], layout: str, staged: bool = True) -> DeviceWorkerSide:
    worker = DeviceWorkerSide(config, LAYOUT, "m", BLOCK, {"load_threads": 1})
    worker.register(kv, layout)
    worker.mover.stream = CpuCopyStream(staged=staged)  # the CUDA path's staging buffers, on the CPU
    return worker


def step(worker: DeviceWorkerSide, meta: KVFabricMetadata) -> None:
    worker.bind(meta)
    worker.start_loads()
    worker.end_step()


def wait_loaded(worker: DeviceWorkerSide, req_id: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        step(worker, KVFabricMetadata(is_idle=True))  # an idle step: the worker waits briefly for a load
        if req_id in worker.finished(set())[1]:
            return
    pytest.fail(f"load of {req_id} never finished")


@pytest.fixture
def config(tmp_path) -> Config:
    return Config.from_dict({"chunk_size": CHUNK, "tiers": ["cpu", "disk"], "disk": {"path": str(tmp_path)}})


@pytest.mark.parametrize("source,target", [("BLHNC", "LBNHC"), ("LBHNC", "BLNHC"), ("LBNHC", "LBNHC")])
def test_saved_kv_loads_exactly_into_other_blocks_of_another_layout(config, source, target):
    tokens = list(range(1, 3 * CHUNK + 1))
    src, dst = caches(source, seed=1), caches(target, seed=2)
    src_ids, dst_ids = [3, 4, 9, 10, 0, 1], [20, 21, 5, 6, 7, 8]
    with CacheEngine(config, LAYOUT, "m") as keys_of:
        keys = keys_of.keys(tokens)
    writer = side(config, src, source)
    step(writer, KVFabricMetadata(saves=[SaveSpec("w", keys, 0, len(tokens), src_ids)]))
    writer.saver.join()
    writer.engine.flush()
    assert writer.counters.snapshot().get("chunks_stored") == 3
    writer.close()
    reader = side(config, dst, target)  # a fresh process: its cpu tier is empty, the chunks come from disk
    try:
        step(reader, KVFabricMetadata(loads=[LoadSpec("r", keys[1:], CHUNK + BLOCK, len(tokens), dst_ids,
                                                      is_async=True)]))
        wait_loaded(reader, "r")
        assert torch.equal(tokens_of(dst, dst_ids, CHUNK + BLOCK, len(tokens)),
                           tokens_of(src, src_ids, CHUNK + BLOCK, len(tokens)))
        assert reader.take_invalid_blocks() == set()
        untouched = caches(target, seed=2)  # blocks outside [CHUNK + BLOCK, end) kept their values
        assert torch.equal(tokens_of(dst, dst_ids, 0, CHUNK + BLOCK), tokens_of(untouched, dst_ids, 0, CHUNK + BLOCK))
    finally:
        reader.close()


def test_a_request_that_saved_is_reported_sent_only_after_its_copies_landed(config, monkeypatch):
    kv = caches("BLHNC", seed=3)
    worker = side(config, kv, "BLHNC")
    try:
        with CacheEngine(config, LAYOUT, "m") as keys_of:
            keys = keys_of.keys(list(range(CHUNK)))
        held = []  # copies that have not landed: a CUDA event not yet reached
        real_save = worker.mover.save

        def slow_save(*args, **kwargs):
            job = real_save(*args, **kwargs)
            monkeypatch.setattr(job.done, "is_done", lambda: not held)
            return job

        monkeypatch.setattr(worker.mover, "save", slow_save)
        held.append(True)
        step(worker, KVFabricMetadata(saves=[SaveSpec("a", keys, 0, CHUNK, [1, 2])]))
        assert worker.finished({"a", "b"}) == (set(), set())  # "a" ended, its copies are in flight; "b" never saved
        assert worker.finished(set()) == (set(), set())
        held.clear()
        assert worker.finished(set()) == ({"a"}, set())  # landed: vLLM may free its blocks now
        assert worker.finished(set()) == (set(), set())  # once
    finally:
        worker.close()


def in_flight_saves(worker: DeviceWorkerSide, monkeypatch) -> list[bool]:
    """Make every save's copies stay in flight until waited for; returns the list each wait appends to."""
    waited: list[bool] = []
    real_save = worker.mover.save

    def watched_save(*args, **kwargs):
        job = real_save(*args, **kwargs)
        monkeypatch.setattr(job.done, "is_done", lambda: bool(waited))
        monkeypatch.setattr(job.done, "wait", lambda: waited.append(True))
        return job

    monkeypatch.setattr(worker.mover, "save", watched_save)
    return waited


def test_the_next_step_waits_only_for_copies_out_of_blocks_vllm_hands_out_again(config, monkeypatch):
    """handle_preemptions (before vLLM zeroes and writes the step's new blocks): a copy still reading a block that
    is handed out again (a preempted request's) is waited for; one whose blocks vLLM keeps is not."""
    worker = side(config, caches("LBNHC", seed=4), "LBNHC")
    try:
        with CacheEngine(config, LAYOUT, "m") as keys_of:
            keys = keys_of.keys(list(range(CHUNK)))
        waited = in_flight_saves(worker, monkeypatch)
        step(worker, KVFabricMetadata(saves=[SaveSpec("p", keys, 0, CHUNK, [1, 2, 3])]))
        worker.fence(KVFabricMetadata(new_block_ids=frozenset({3, 7, 8})))  # block 3 is past the save's tokens
        assert not waited  # the forward of the next step does not wait for this save
        worker.fence(KVFabricMetadata(new_block_ids=frozenset({2, 7})))
        assert waited == [True]  # block 2 is handed out again: its copy landed first
        assert worker.counters.snapshot().get("save_fences") == 1
        step(worker, KVFabricMetadata(saves=[SaveSpec("q", keys, 0, CHUNK, [4, 5])]))
        waited.clear()
        worker.fence(None)  # no block list: every copy in flight
        assert waited == [True]
    finally:
        worker.close()


HYBRID = KVLayout.from_layer_types(["sliding_attention", "full_attention", "sliding_attention"], 2, 8, CHUNK,
                                   "float16")


def hybrid_groups() -> KVGroups:
    """vLLM's hybrid manager on HYBRID: group 0 the window layers 0 and 2, group 1 the full layer 1."""
    names = {f"model.layers.{i}.self_attn.attn": group for i, group in enumerate([0, 1, 0])}
    return KVGroups(BLOCK, 2, names, CHUNK)


def layer_tokens(view: torch.Tensor, table: list[int], start: int, end: int) -> torch.Tensor:
    out = torch.empty(HYBRID.shape(end - start)[1:], dtype=torch.float16)
    DeviceLayer.of(view, "LBHNC").gather(table, start, end, out)  # tokens: any block order
    return out


@pytest.mark.parametrize("source,target", [("BLHNC", "LBNHC"), ("LBHNC", "LBHNC")])
def test_the_hybrid_managers_groups_each_move_through_their_own_block_table(config, source, target):
    """Gemma-like groups on a GPU layout: every layer is saved from its group's blocks; a load puts the full layer
    in from the start and the window layers only from window_from (before it vLLM holds no window block)."""
    tokens = list(range(1, 3 * CHUNK + 1))
    src, dst = caches(source, seed=11), caches(target, seed=12)
    src_tables = ([4, 5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15])  # (window group, full group)
    dst_tables = ([16, 17, 18, 19, 20, 21], [0, 1, 2, 3, 22, 23])
    with CacheEngine(config, HYBRID, "m") as keys_of:
        keys = keys_of.keys(tokens)
    writer = DeviceWorkerSide(config, HYBRID, "m", BLOCK, {}, groups=hybrid_groups())
    writer.register(src, source)
    writer.mover.stream = CpuCopyStream(staged=True)
    step(writer, KVFabricMetadata(saves=[SaveSpec("w", keys, 0, len(tokens), src_tables[1], src_tables)]))
    writer.saver.join()
    writer.engine.flush()
    writer.close()
    reader = DeviceWorkerSide(config, HYBRID, "m", BLOCK, {}, groups=hybrid_groups())
    try:
        reader.register(dst, target)
        window_from = 2 * CHUNK - BLOCK  # the window layers' first held block: token 48
        step(reader, KVFabricMetadata(loads=[LoadSpec("r", keys, 0, len(tokens), dst_tables[1], is_async=True,
                                                      group_block_ids=dst_tables, window_from=window_from)]))
        wait_loaded(reader, "r")
        assert reader.take_failed_loads() == set()
        untouched = caches(target, seed=12)
        for (name, view), group in zip(dst.items(), [0, 1, 0]):
            first = window_from if group == 0 else 0
            assert torch.equal(layer_tokens(view, dst_tables[group], first, len(tokens)),
                               layer_tokens(src[name], src_tables[group], first, len(tokens))), name
            assert torch.equal(layer_tokens(view, dst_tables[group], 0, first),
                               layer_tokens(untouched[name], dst_tables[group], 0, first)), name
    finally:
        reader.close()


def test_a_window_block_that_slid_out_is_fenced_before_vllm_reuses_it(config, monkeypatch):
    worker = DeviceWorkerSide(config, HYBRID, "m", BLOCK, {}, groups=hybrid_groups())
    try:
        worker.register(caches("BLHNC", seed=13), "BLHNC")
        waited = in_flight_saves(worker, monkeypatch)
        with CacheEngine(config, HYBRID, "m") as keys_of:
            keys = keys_of.keys(list(range(CHUNK)))
        step(worker, KVFabricMetadata(saves=[SaveSpec("s", keys, 0, CHUNK, [9, 10], ([1, 2], [9, 10]))]))
        worker.fence(KVFabricMetadata(new_block_ids=frozenset({3, 11})))
        assert not waited
        worker.fence(KVFabricMetadata(new_block_ids=frozenset({1})))  # window block 1 slid out and is handed out
        assert waited == [True]
    finally:
        worker.close()


def test_a_missing_chunk_ends_the_load_and_its_blocks_are_recomputed(config):
    tokens = list(range(1, 2 * CHUNK + 1))
    src = caches("BLHNC", seed=5)
    worker = side(config, src, "BLHNC")
    try:
        with CacheEngine(config, LAYOUT, "m") as keys_of:
            keys = keys_of.keys(tokens)
        step(worker, KVFabricMetadata(saves=[SaveSpec("w", keys[:1], 0, CHUNK, [0, 1])]))
        worker.saver.join()
        worker.finished({"w"})
        step(worker, KVFabricMetadata(loads=[LoadSpec("r", keys, 0, 2 * CHUNK, [8, 9, 10, 11], is_async=True)]))
        wait_loaded(worker, "r")
        assert worker.take_invalid_blocks() == {10, 11}  # the second chunk was never stored
        assert torch.equal(tokens_of(src, [8, 9], 0, CHUNK), tokens_of(src, [0, 1], 0, CHUNK))
    finally:
        worker.close()


def test_a_layer_wise_load_lands_before_each_layer_and_a_failed_one_saves_nothing(config):
    """load_mode: layerwise: start_load_kv reads every chunk, wait_for_layer_load holds the engine's stream per
    layer; end_step reports a missing chunk's blocks and drops that request's save of the step."""
    tokens = list(range(1, 2 * CHUNK + 1))
    src, dst = caches("BLNHC", seed=8), caches("LBHNC", seed=9)
    with CacheEngine(config, LAYOUT, "m") as keys_of:
        keys = keys_of.keys(tokens)
    writer = side(config, src, "BLNHC")
    step(writer, KVFabricMetadata(saves=[SaveSpec("w", keys[:1], 0, CHUNK, [0, 1])]))
    writer.saver.join()
    writer.close()
    reader = DeviceWorkerSide(config, LAYOUT, "m", BLOCK, {"load_mode": "layerwise"})
    try:
        reader.register(dst, "LBHNC")
        reader.mover.stream = stream = WatchedStream(staged=True)
        meta = KVFabricMetadata(loads=[LoadSpec("r", keys, 0, 2 * CHUNK, [8, 9, 10, 11])],
                                saves=[SaveSpec("r", keys[1:], CHUNK, 2 * CHUNK, [8, 9, 10, 11])])
        reader.bind(meta)
        reader.start_loads()
        recorded = list(stream.recorded)  # one per layer: its copies of both chunks
        for name in dst:
            reader.layer_load(name)
        assert len(recorded) == LAYOUT.num_layers and stream.held == recorded  # the stream waits, in layer order
        reader.end_step()
        assert reader.take_invalid_blocks() == {10, 11}  # chunk 1 was never stored
        assert reader.counters.snapshot().get("saves_dropped_incomplete") == 1
        assert torch.equal(tokens_of(dst, [8, 9], 0, CHUNK), tokens_of(src, [0, 1], 0, CHUNK))
    finally:
        reader.close()


def test_a_cache_that_is_not_the_models_is_refused_in_one_line(config):
    worker = DeviceWorkerSide(config, LAYOUT, "m", BLOCK, {})
    try:
        kv = caches("LBNHC", seed=7)
        kv.pop("model.layers.2.self_attn.attn")
        with pytest.raises(ValueError, match=r"are not \[blocks, 2 heads, tokens, 2 x 8\] views of K\|V"):
            worker.register(kv, "LBNHC")
    finally:
        worker.close()
    latent = KVLayout(3, 1, 16, "float16", is_latent=True)  # an MLA model's worker handed K|V caches
    worker = DeviceWorkerSide(config, latent, "m", BLOCK, {})
    try:
        with pytest.raises(ValueError, match=r"are not \[blocks, 1 heads, tokens, 16\] views of an MLA latent"):
            worker.register(caches("LBNHC", seed=7), "LBNHC")
    finally:
        worker.close()


def test_the_scheduler_lists_every_block_vllm_hands_out_in_a_step():
    """allocated_blocks reads vLLM's own SchedulerOutput: new requests' tables, running requests' new blocks and
    resumed ones' whole tables in every group, and copy-on-write targets; never the null block 0."""
    from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    from kvfabric.connectors.vllm.scheduler import allocated_blocks

    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [NewRequestData("a", [1, 2, 3], [], None, None, ([0, 4, 5], [6, 7]), 0, None)]
    out.scheduled_cached_reqs = CachedRequestData(
        req_ids=["b", "c", "d"], resumed_req_ids={"d"}, new_token_ids=[[], [], []], all_token_ids={},
        new_block_ids=[([8], []), None, ([9, 10], [11])], num_computed_tokens=[16, 32, 0], num_output_tokens=[1, 2, 0])
    out.kv_cache_block_copies = [KVCacheBlockCopy(src_block_id=12, dst_block_id=13)]
    assert allocated_blocks(out) == frozenset({4, 5, 6, 7, 8, 9, 10, 11, 13})
    assert allocated_blocks(SchedulerOutput.make_empty()) == frozenset()
