"""The shard list a replica keeps for its connector (`shard_list.py`): the directory's list, or,
when the directory does not answer, the list the engines were deployed with, never a list an
earlier deployment left; a directory that lists no shard leaves the file as it was."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray")

from tiered_cache.cache.address_file import read_addresses
from tiered_cache.workers.serve_llm import shard_list


def test_the_list_is_the_directory_s_else_the_deployed_one(tmp_path, monkeypatch):
    monkeypatch.setattr(shard_list.tempfile, "gettempdir", lambda: str(tmp_path))
    listed = shard_list.shard_list_path("ns")
    answers: list[list[str] | None] = [["10.0.0.2:7001"], None, []]

    async def directory_shards(namespace: str) -> list[str] | None:
        assert namespace == "ns"
        return answers.pop(0)

    monkeypatch.setattr(shard_list, "directory_shards", directory_shards)
    listed.parent.mkdir(mode=0o700)
    listed.write_text("10.0.0.9:1\n")  # an earlier deployment's
    assert asyncio.run(shard_list.write_shard_list("ns", ["10.0.0.1:7000"]))
    assert read_addresses(listed) == ["10.0.0.2:7001"]  # the directory's: the shard moved
    assert asyncio.run(shard_list.write_shard_list("ns", ["10.0.0.1:7000"]))
    assert read_addresses(listed) == ["10.0.0.1:7000"]  # no answer: what the engines were given
    assert not asyncio.run(shard_list.write_shard_list("ns"))  # no shard listed, none deployed
    assert read_addresses(listed) == ["10.0.0.1:7000"]
