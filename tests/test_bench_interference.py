"""kvfabric bench interference: the engine's fetch loop never lets a set-up report a row whose fetch never happened."""
import threading

import pytest
import torch

from kvfabric.bench.interference_engine import FetchError, FetchLoop


def _first_token() -> None:
    pass


def test_fetch_loop_writes_an_inference_tensor_from_its_thread():
    with torch.inference_mode():
        buf = torch.zeros(4, 8)  # as B's buffer in the engine: made under inference mode on the main thread

    def fetch() -> int:
        buf.copy_(torch.ones(4, 8))  # outside inference mode this raises (inference mode is per thread)
        return 8

    loop = FetchLoop(fetch, 8)
    assert loop.warm() == 8
    loop.start()
    ttfts = loop.finish(_first_token, timeout=60)
    assert len(ttfts) >= 1 and all(t >= 0 for t in ttfts)
    assert torch.equal(buf, torch.ones(4, 8))


def test_a_failing_fetch_raises_in_the_main_thread():
    def fetch() -> int:
        raise RuntimeError("server gone")

    loop = FetchLoop(fetch, 8)
    loop.start()
    with pytest.raises(FetchError, match="server gone"):
        loop.finish(_first_token, timeout=60)


@pytest.mark.parametrize("num_loaded", [0, 7])
def test_a_fetch_that_loads_less_than_the_prompt_raises(num_loaded):
    loop = FetchLoop(lambda: num_loaded, 8)
    with pytest.raises(FetchError, match=f"loaded {num_loaded} of"):
        loop.warm()
    loop.start()
    with pytest.raises(FetchError):
        loop.finish(_first_token, timeout=60)


def test_no_fetch_finished_raises_instead_of_a_row_with_zero_fetches():
    release = threading.Event()

    def fetch() -> int:
        release.wait(60)
        return 8

    loop = FetchLoop(fetch, 8)
    loop.start()
    with pytest.raises(FetchError, match="no fetch finished"):
        loop.finish(_first_token, timeout=0.2)
    release.set()


@pytest.mark.slow
def test_every_set_up_fetches_through_real_processes():
    from kvfabric.bench.interference import run
    rows = run(steps=16, b_tokens=512, links=(1000,))
    by_setup = {row["setup"]: row for row in rows}
    for setup in ("inproc", "server"):
        assert by_setup[setup]["num_fetches"] >= 1
        assert by_setup[setup]["warm_fetch_tokens"] == 512
        assert by_setup[setup]["ttft_s"] > 0
    assert by_setup["none"]["ttft_s"] is None
    assert by_setup["share"]["hit_tokens"] > 0
    assert by_setup["copy"]["exact"]


def test_vllm_pairs_name_prompts_that_make_prompts_makes(monkeypatch):
    import transformers

    from kvfabric.bench import vllm as bench_vllm
    from kvfabric.bench.interference_vllm import pair_names

    class Tokenizer:  # make_prompts only slices token ids; the text and its tokenizer do not matter here
        def __call__(self, text):
            return type("Encoded", (), {"input_ids": list(range(100_000))})()

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *_: Tokenizer())
    prompts = bench_vllm.make_prompts("unused", [64], repeats=5)
    names = [name for pair in pair_names(64, 5) for name in pair]
    assert len(set(names)) == 10 and all(len(prompts[name]) == 64 for name in names)
    starts = {prompts[name][0] for name in names}
    assert len(starts) == 10  # disjoint slices: no pair shares a prefix
