import pytest

from tiered_cache.model.units import format_binary, format_bytes, parse_size


@pytest.mark.parametrize("text, expected", [
    ("4096", 4096), (4096, 4096), ("64KiB", 65536), ("1.5 GiB", 3 * 2**29), ("80G", 80 * 2**30),
    ("2GB", 2_000_000_000), ("10mib", 10 * 2**20), ("7 B", 7), ("1TiB", 2**40),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "GiB", "-1GiB", "4 GiBs", "1e9", "four", True, -5])
def test_parse_size_rejects_with_a_clear_message(bad):
    with pytest.raises(ValueError, match="size"):
        parse_size(bad)


def test_formatting_is_exact_and_binary():
    assert format_bytes(327_680) == "327,680 B (320 KiB)"
    assert format_bytes(10 * 2**30) == "10,737,418,240 B (10 GiB)"
    assert format_bytes(512) == "512 B"
    assert format_binary(1536) == "1.5 KiB"
    assert format_binary(2**50) == "1024 TiB"
