import hashlib
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

from tiered_cache.index.keys import KEY_BYTES, PageKeyer, chain_keys, root_key
from tiered_cache.model.presets import preset_spec

SPEC = preset_spec("smollm2-135m", page_size=4)


def reference_keys(tokens, page_size, namespace, fingerprint):
    """DESIGN.md §4 written out independently of the implementation."""
    ns = namespace.encode()
    prev = hashlib.sha256(struct.pack("<I", len(ns)) + ns + bytes.fromhex(fingerprint)).digest()
    keys = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        page = b"".join(struct.pack("<i", t) for t in tokens[start:start + page_size])
        prev = hashlib.sha256(prev + page).digest()
        keys.append(prev)
    return keys


def test_keys_follow_the_contract_and_skip_the_partial_page():
    tokens = list(range(1000, 1014))  # 3 full pages of 4 and 2 tokens left over
    keys = PageKeyer(SPEC, "tenant-a").keys(tokens)
    assert keys == reference_keys(tokens, 4, "tenant-a", SPEC.fingerprint)
    assert len(keys) == 3 and all(len(k) == KEY_BYTES for k in keys)


def test_equal_prefixes_share_keys_and_diverge_after():
    keyer = PageKeyer(SPEC)
    a, b = keyer.keys([1, 2, 3, 4, 5, 6, 7, 8]), keyer.keys([1, 2, 3, 4, 5, 6, 7, 9])
    assert a[0] == b[0] and a[1] != b[1]


def test_namespaces_and_specs_never_share_keys():
    tokens = list(range(16))
    assert PageKeyer(SPEC, "a").keys(tokens)[0] != PageKeyer(SPEC, "b").keys(tokens)[0]
    other = SPEC.with_options(dtype="bf16")
    assert PageKeyer(SPEC).keys(tokens)[0] != PageKeyer(other).keys(tokens)[0]
    # Length-prefixed namespace: "ab" + fingerprint never collides with "a" + "b"-shifted bytes.
    assert root_key("ab", SPEC.fingerprint) != root_key("a", SPEC.fingerprint)


def test_extend_continues_a_chain():
    keyer = PageKeyer(SPEC)
    tokens = list(range(40))
    full = keyer.keys(tokens)
    head = keyer.extend(None, tokens[:12])
    assert head + keyer.extend(head[-1], tokens[12:]) == full


def test_tokens_from_numpy_torch_and_lists_agree():
    keyer = PageKeyer(SPEC)
    tokens = [5, 70000, 3, 2**31 - 1, 0, 9, 9, 9]
    expected = keyer.keys(tokens)
    assert keyer.keys(np.array(tokens, dtype=np.int64)) == expected
    assert keyer.keys(torch.tensor(tokens)) == expected
    assert keyer.keys(np.array(tokens, dtype=">i8")) == expected  # big-endian input is re-encoded
    assert keyer.keys([]) == []


@pytest.mark.parametrize("bad, error, message", [
    ([1.0, 2.0], TypeError, "must be integers"),
    (["a"], TypeError, "must be integers"),
    ([True, False], TypeError, "must be integers"),
    ([[1, 2], [3, 4]], ValueError, "one flat sequence"),
    ([1, -1], ValueError, r"in \[0, 2\*\*31\)"),
    ([2**31], ValueError, r"in \[0, 2\*\*31\)"),
])
def test_bad_tokens_get_clear_errors(bad, error, message):
    with pytest.raises(error, match=message):
        PageKeyer(SPEC).keys(bad)


def test_bad_roots_and_parents():
    with pytest.raises(ValueError, match="64 hex characters"):
        root_key("ns", "abc")
    with pytest.raises(TypeError, match="namespace must be a str"):
        root_key(b"ns", SPEC.fingerprint)
    with pytest.raises(ValueError, match="parent key must be 32 bytes"):
        chain_keys([1, 2], 1, b"short")


def test_keys_are_equal_in_another_process():
    tokens = list(range(7, 7 + 64))
    code = ("import sys; from tiered_cache.index.keys import PageKeyer;"
            "from tiered_cache.model.presets import preset_spec;"
            "k = PageKeyer(preset_spec('smollm2-135m', page_size=4), 'tenant-a');"
            "print(','.join(x.hex() for x in k.keys(list(range(7, 71)))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "987"})
    mine = [k.hex() for k in PageKeyer(SPEC, "tenant-a").keys(tokens)]
    assert out.stdout.strip().split(",") == mine
