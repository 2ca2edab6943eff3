"""`kvfabric profile cachegen` on the real model: a small calibration writes a profile the codec can load."""
from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from kvfabric.apps.cli import main
from kvfabric.codec.cachegen import profile as P
from kvfabric.data import demo_document

pytestmark = pytest.mark.slow


def test_profile_command_writes_a_loadable_profile(tmp_path):
    texts = tmp_path / "texts.json"  # MuSiQue-style: questions with passages
    texts.write_text(json.dumps([{"ctxs": [{"title": "The lighthouse", "text": demo_document()}]}]))
    out = tmp_path / "profile.npz"
    result = CliRunner().invoke(main, ["profile", "cachegen", "--texts", str(texts), "--genres", "retrieval,code",
                                       "--per-genre", "1", "--ctx-tokens", "256", "--out", str(out)])
    assert result.exit_code == 0, result.output
    prof = P.load(out)
    assert f"profile {prof.id:#018x}" in result.output
    shipped = P.shipped()[prof.fingerprint]  # the shipped SmolLM2 profile: same layout
    assert prof.fingerprint == shipped.fingerprint and prof.e_base.shape == shipped.e_base.shape
    assert prof.meta["genres"] == {"retrieval": 1, "code": 1} and prof.meta["ctx_tokens"] == 256
    fisher = np.load(out.with_suffix(".fisher.npy"))
    assert fisher.shape == (30, 2, 3, 64) and (fisher > 0).all()
