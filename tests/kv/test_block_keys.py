"""Block content keys: the same in every process (no salted hash), different for every model, KV dtype,
block size, token and prefix."""

from __future__ import annotations

import os
import subprocess
import sys

from kvserve.kv.block_keys import KEY_BYTES, block_key, group_key, root_key

_PRINT_KEY = (
    "from kvserve.kv.block_keys import block_key, root_key; "
    "print(block_key(root_key('m', 'int8', 16), list(range(16))).hex())"
)


def test_keys_are_the_same_in_processes_with_different_hash_seeds() -> None:
    keys = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        keys.add(subprocess.run([sys.executable, "-c", _PRINT_KEY], env=env, capture_output=True, text=True,
                                check=True).stdout.strip())
    assert keys == {block_key(root_key("m", "int8", 16), list(range(16))).hex()}


def test_everything_a_block_depends_on_changes_its_key() -> None:
    root = root_key("m", "int8", 16)
    tokens = list(range(16))
    keys = {
        block_key(root, tokens),
        block_key(root_key("other model", "int8", 16), tokens),
        block_key(root_key("m", "fp8", 16), tokens),
        block_key(root_key("m", "int8", 32), tokens),
        block_key(root, tokens[:-1] + [99]),
        block_key(block_key(root, tokens), tokens),  # the same tokens after a prefix
        block_key(root_key("m", "int8", 16, "full:1;8:0"), tokens),  # a block of one KV cache group's layers
        group_key(block_key(root, tokens), 1),  # KV cache group 1's block of the same tokens
        group_key(block_key(root, tokens), 2),
    }
    assert len(keys) == 9
    assert all(len(key) == KEY_BYTES for key in keys)


def test_the_plain_layout_and_group_0_keep_the_keys_of_blocks_written_before_kv_cache_groups() -> None:
    assert root_key("m", "int8", 16, "") == root_key("m", "int8", 16)
    assert root_key("m", "int8", 16).hex() == "1c791f102696551d9303290e6d2ff315"  # as before groups
    key = block_key(root_key("m", "int8", 16), list(range(16)))
    assert group_key(key, 0) == key
