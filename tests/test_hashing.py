"""Chunk keys: prefix property, sensitivity, namespaces, process independence."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric.kv.hashing import KeySpace, chunk_keys, root_key, token_bytes
from kvfabric.kv.layout import KVLayout

LAYOUT = KVLayout(30, 3, 64, "float16")
ROOT = root_key("m", LAYOUT, 4)
tokens_st = st.lists(st.integers(0, 2**32 - 1), max_size=64)


@given(tokens_st, st.integers(0, 64))
def test_keys_of_a_prefix_are_a_prefix_of_the_keys(tokens, cut):
    full = chunk_keys(tokens, ROOT, 4)
    assert chunk_keys(tokens[:cut], ROOT, 4) == full[:cut // 4]


@given(st.lists(st.integers(0, 50_000), min_size=8, max_size=64), st.data())
def test_any_token_change_changes_that_key_and_every_later_one(tokens, data):
    i = data.draw(st.integers(0, len(tokens) - 1))
    changed = list(tokens)
    changed[i] = (changed[i] + data.draw(st.integers(1, 1000))) % 2**32
    a, b = chunk_keys(tokens, ROOT, 4), chunk_keys(changed, ROOT, 4)
    first = i // 4
    assert a[:first] == b[:first]
    assert all(x != y for x, y in zip(a[first:], b[first:]))


@settings(max_examples=50)
@given(st.lists(st.integers(0, 1000), min_size=4, max_size=32))
def test_namespaces_are_separate(tokens):
    keys = {
        tuple(chunk_keys(tokens, root_key(model, layout, cs, salt, h), cs, hash_name=h))
        for model, layout, cs, salt, h in [
            ("m", LAYOUT, 4, "", "sha256"), ("m2", LAYOUT, 4, "", "sha256"),
            ("m", KVLayout(30, 3, 64, "float32"), 4, "", "sha256"), ("m", LAYOUT, 4, "tenant-a", "sha256"),
            ("m", LAYOUT, 4, "", "blake3"), ("m", LAYOUT, 2, "", "sha256"),
        ]
    }
    flat = [k for ks in keys for k in ks]
    assert len(flat) == len(set(flat))


def test_partial_chunk_only_when_asked_and_distinct():
    tokens = list(range(10))
    assert len(chunk_keys(tokens, ROOT, 4)) == 2
    keys = chunk_keys(tokens, ROOT, 4, include_partial=True)
    assert len(keys) == 3 and keys[:2] == chunk_keys(tokens, ROOT, 4)
    assert keys[2] not in chunk_keys(list(range(12)), ROOT, 4)


@given(st.lists(st.integers(0, 50_000), max_size=40), st.integers(0, 4), st.sampled_from([1, 2, 4]))
def test_tail_keys_are_the_partial_keys_of_the_shorter_prompts(tokens, num_chunks, step):
    """A chunk's leading parts, every `step` tokens, have the keys their prompt's partial chunk is stored under."""
    space = KeySpace.of("m", LAYOUT, 8)
    partial = KeySpace.of("m", LAYOUT, 8, include_partial=True)
    whole = space.keys(tokens)
    num_chunks = min(num_chunks, len(whole))
    first = num_chunks * 8
    tails = space.tail_keys(tokens, whole[num_chunks - 1] if num_chunks else None, first, step)
    lengths = [m for m in range(step, 8, step) if first + m <= len(tokens)]
    assert tails == [partial.keys(tokens[:first + m])[-1] for m in lengths]
    assert not set(tails) & set(whole)


def test_input_types_agree():
    tokens = [5, 7, 2**31, 9, 1, 2, 3, 4]
    ref = chunk_keys(tokens, ROOT, 4)
    assert chunk_keys(np.array(tokens, dtype=np.int64), ROOT, 4) == ref
    assert chunk_keys(torch.tensor(tokens, dtype=torch.int64), ROOT, 4) == ref


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.5], ["a"]])
def test_bad_token_ids_are_rejected(bad):
    with pytest.raises(ValueError):
        token_bytes(bad)


def test_keys_identical_across_processes_and_hash_seeds():
    code = ("import json; from kvfabric.kv.hashing import chunk_keys, root_key; from kvfabric.kv.layout import KVLayout;"
            "r = root_key('smollm2', KVLayout(30, 3, 64), 256, 'salt');"
            "print(json.dumps([k.hex() for k in chunk_keys(list(range(1000)), r, 256)]))")
    outs = []
    for seed in ("0", "12345", "random"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.append(json.loads(subprocess.run([sys.executable, "-c", code], env=env, check=True,
                                              capture_output=True, text=True).stdout))
    assert outs[0] == outs[1] == outs[2] and len(outs[0]) == 3
    # a golden value: a change of the key scheme must be deliberate (it invalidates every cache)
    assert outs[0][0][:16] == chunk_keys(list(range(256)), root_key("smollm2", KVLayout(30, 3, 64), 256, "salt"),
                                         256)[0].hex()[:16]


def test_key_space_is_the_only_caller_of_the_key_functions():
    """Every part of kvfabric derives chunk keys from one KeySpace value: no module but hashing.py calls
    root_key( or chunk_keys( (the vLLM scheduler, remote client, server, controller and stream sender included)."""
    import re
    from pathlib import Path

    import kvfabric

    root = Path(kvfabric.__file__).parent
    callers = sorted(str(path.relative_to(root)) for path in root.rglob("*.py")
                     if path.name != "hashing.py" and re.search(r"\b(root_key|chunk_keys)\(", path.read_text()))
    assert callers == []


def test_key_space_tenants_and_wire_form():
    from kvfabric.cluster.index import Namespace
    from kvfabric.kv.hashing import KeySpace, chunk_keys, root_key, tenant_root
    from kvfabric.kv.layout import KVLayout

    layout = KVLayout(2, 2, 8, "float16")
    space = KeySpace.of("m", layout, 4, salt="org", include_partial=True)
    tokens = list(range(10))
    assert space.keys(tokens) == chunk_keys(tokens, root_key("m", layout, 4, "org"), 4, True)
    tenant = space.tenant("alice")
    assert tenant.root == tenant_root(root_key("m", layout, 4, "org"), "alice") and tenant.salt == "org/alice"
    assert tenant.keys(tokens)[0] != space.keys(tokens)[0]
    assert tenant.root not in {root_key("m", layout, 4, s) for s in ("", "org", "alice", "org/alice")}
    # a vLLM request's cache_salt S and an engine configured with salt S share one namespace
    assert KeySpace.of("m", layout, 4).tenant("alice").root == root_key("m", layout, 4, "alice")
    wire = Namespace.of(space)
    assert wire.key_space().keys(tokens) == space.keys(tokens)  # the controller's keys are the instance's
    # ... and so are a tenant's: the controller derives them from the wire form, without the layout
    assert wire.key_space().tenant("bob").keys(tokens) == space.tenant("bob").keys(tokens)
    assert space.tenant("bob").keys(tokens) != space.tenant("alice").keys(tokens)
    with pytest.raises(ValueError, match="non-empty"):
        space.tenant("")


def test_unsalted_roots_are_unchanged_by_tenant_roots():
    """The unsalted root is what it was before tenant roots (a cache written then stays valid): the vector below is
    root_key("smollm2", KVLayout(30, 3, 64), 256) computed with the earlier code."""
    from kvfabric.kv.hashing import root_key
    from kvfabric.kv.layout import KVLayout

    assert root_key("smollm2", KVLayout(30, 3, 64), 256).hex() == (
        "712745b416f78ad2c4ba532993ad2d9b809480e3ed3ebb501d1a3db1dc417988")
