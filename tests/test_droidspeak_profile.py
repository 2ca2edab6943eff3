"""DroidSpeak's profiler (kvfabric.research.droidspeak_profile) and the pair table it fills
(kvfabric.droidspeak.table), on the tiny seeded Llama pair of tests/test_droidspeak.py."""
from __future__ import annotations

import pytest
import torch

from kvfabric.droidspeak.runtime import Block, recompute_block, sender_prefill
from kvfabric.droidspeak.table import ProfileTable
from kvfabric.research.droidspeak_profile import kl_rows, profile_prompt, table_from_prompts
from tests.test_droidspeak import pair  # noqa: F401  (the fixture: two tiny seeded Llamas)


def test_profile_table_extremes_choice_and_json(pair, tmp_path):
    a, b = pair
    gen = torch.Generator().manual_seed(3)
    context, suffix = torch.randint(0, 128, (40,), generator=gen).tolist(), torch.randint(0, 128, (10,), generator=gen).tolist()
    prof = profile_prompt(a, b, context, suffix, num_answer=4)
    assert float(prof.kl[0, 0]) > 1e-4  # the two models differ: naive reuse costs something
    assert float(prof.kl[0, 4]) < 1e-6 and float(prof.kl_ans[0, 4]) < 1e-6  # whole model: the full prefill
    for s, e in ((0, 0), (1, 3), (2, 4), (3, 4), (0, 2)):  # the shared-trajectory scores equal a direct run
        kv_a, hidden_a = sender_prefill(a, context, capture=range(4))
        ws = b.workspace(50)
        ws[:, :, :, :40] = kv_a
        recompute_block(b, context, ws, Block(s, e), hidden_a.get(s))
        ref = torch.log_softmax(b.logits(b.forward(torch.tensor(context + suffix), b.workspace(50))[40:]), -1)
        with torch.inference_mode():
            rows = kl_rows(ref, b.logits(b.forward(torch.tensor(suffix), ws, start=40)))
        assert abs(float(rows.mean()) - float(prof.kl[s, e])) < 1e-5
        assert abs(float(rows[6:].mean()) - float(prof.kl_ans[s, e])) < 1e-5
    coarse = profile_prompt(a, b, context, suffix, num_answer=4, stride=2)  # ends at 2 and 4 only
    scored = {(s, e) for s in range(5) for e in range(5) if not torch.isnan(coarse.kl[s, e])}
    assert scored == {(0, 0), (1, 1), (2, 2), (3, 3), (4, 4), (0, 2), (0, 4), (2, 4)}
    assert all(abs(float(coarse.kl[s, e] - prof.kl[s, e])) < 1e-6 for s, e in scored)
    coarse_table = table_from_prompts("a", "b", [coarse])
    assert {(blk.start, blk.stop) for blk in coarse_table.blocks()} == {(0, 2), (0, 4), (2, 4)}
    assert coarse_table.best_of_size(1) is None and coarse_table.nearest_of_size(1).num_layers == 2
    selfprof = profile_prompt(a, a, context, suffix, num_answer=4)
    assert float(selfprof.kl.nan_to_num(0).abs().max()) < 1e-6  # a model reusing itself loses nothing anywhere
    table = table_from_prompts("a", "b", [prof, prof])
    assert table.gap_closed(Block(0, 4)) == (1.0, 1.0) and table.gap_closed(Block(0, 0)) == (0.0, 0.0)
    chosen = table.choose(0.9)
    assert min(table.gap_closed(chosen)) >= 0.9
    smaller = [blk for blk in table.blocks() if blk.num_layers < chosen.num_layers]
    assert all(min(table.gap_closed(blk)) < 0.9 for blk in smaller)
    assert table.best_of_size(0) == Block(0, 0) and table.best_of_size(4) == Block(0, 4)
    assert ProfileTable.from_json(table.to_json()).to_json() == table.to_json()  # NaN below the diagonal
    with pytest.raises(ValueError):
        ProfileTable.from_json(table.to_json().replace('"num_layers": 4', '"num_layers": 5'))
