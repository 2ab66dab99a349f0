import pytest

from kvproto.runtime.units import format_size, parse_size


@pytest.mark.parametrize("text,value", [
    (0, 0), (4096, 4096), ("0", 0), ("17", 17), ("17B", 17), ("1KiB", 1024), ("4 KiB", 4096),
    ("256MiB", 256 << 20), ("1GiB", 1 << 30), ("1gib", 1 << 30), ("2TiB", 2 << 40),
    ("1K", 1024), ("1M", 1 << 20), ("1G", 1 << 30), ("1KB", 1000), ("1MB", 10 ** 6),
    ("1GB", 10 ** 9), ("1.5KiB", 1536), ("0.5GiB", 1 << 29), (" 3 MiB ", 3 << 20),
])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["", "MiB", "1.5B", "-1", -1, "1 PiB", "1e3", True, 1.5, None, "1..2K"])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


def test_format_size():
    assert format_size(256 << 20) == "256MiB"
    assert format_size(1000) == "1000B"
