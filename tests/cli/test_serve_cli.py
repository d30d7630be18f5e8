"""`tiered-cache serve` as a careless operator runs it: what it says at start, and one clear line
(exit 2) for every mistake instead of a traceback or a silent wrong setting."""

from __future__ import annotations

import pytest
from conftest import run_cli

from tiered_cache.server.config import ServerConfig, default_store_folder
from tiered_cache.server.process import StoreProcess


def _refused(*args: str) -> str:
    result = run_cli("serve", *args, check=False)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def test_start_says_what_it_serves_from(tmp_path):
    with StoreProcess(["--disk", str(tmp_path / "pages"), "--ram", "64MiB", "--disk-capacity", "2GiB",
                       "--metrics-port", "0"]) as store:
        pass
    text = "\n".join(store.output)
    assert f"tiers: RAM 64 MiB -> disk 2 GiB at {tmp_path / 'pages'}" in text
    assert "no token" in text and "metrics at http://127.0.0.1:" in text


def test_a_dead_redis_is_announced_and_the_server_still_serves(tmp_path):
    with StoreProcess(["--no-disk", "--redis", "redis://someone:hunter2@127.0.0.1:1/3"]) as store:
        assert store.address
    text = "\n".join(store.output)
    assert "WARNING: Redis at 127.0.0.1:1/3 is not reachable now" in text and "hunter2" not in text
    assert "tiers: RAM 1 GiB -> Redis at 127.0.0.1:1/3" in text


def test_the_default_disk_folder_follows_tiered_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("TIERED_CACHE_DIR", str(tmp_path))
    assert default_store_folder() == str(tmp_path / "store") == ServerConfig().disk_path
    assert ServerConfig(disk_path="").disk_path == ""  # --no-disk


def test_mistakes_get_one_line_naming_them(tmp_path):
    assert "ram_capacity of 10 bytes cannot hold a page" in _refused("--ram", "10", "--no-disk", "--port", "0")
    assert "ram_capacity of 0 bytes" in _refused("--ram", "0", "--no-disk", "--port", "0")
    assert "disk_capacity of 512 bytes" in _refused("--disk", str(tmp_path), "--disk-capacity", "512", "--port", "0")
    bad = tmp_path / "serve.yaml"
    bad.write_text("workers: lots\n")
    assert "bad value for workers: expected an integer, got 'lots'" in _refused("--config", str(bad), "--port", "0")
    bad.write_text("stream_idle_s: soon\n")
    assert "bad value for stream_idle_s" in _refused("--config", str(bad), "--port", "0")
    bad.write_text("ram_capacity: lots\n")
    assert "bad value for ram_capacity" in _refused("--config", str(bad), "--port", "0")
    assert "port must be in 0..65535" in _refused("--port", "70000")
    missing = str(tmp_path / "missing.pem")
    assert f"--tls-cert {missing}: no such file" in _refused("--no-disk", "--tls-cert", missing, "--tls-key", missing)
    assert "--disk /proc/impossible: cannot keep pages there" in _refused("--disk", "/proc/impossible", "--port", "0")


def test_a_port_in_use_is_one_line_with_what_to_do():
    with StoreProcess(["--no-disk"]) as store:
        port = store.address.rsplit(":", 1)[1]
        line = _refused("--no-disk", "--port", port)
    assert f"cannot listen on 127.0.0.1:{port}: the port is in use" in line and "--port 0" in line


@pytest.mark.parametrize("value", ["1.5", "true"])
def test_integers_are_integers(value):
    with pytest.raises(ValueError, match="bad value for workers: expected an integer"):
        ServerConfig(workers=float(value) if value == "1.5" else True)


def test_what_would_go_wrong_later_is_said_at_start(monkeypatch, tmp_path):
    """A RAM tier larger than the machine, and a token in the environment that a token file
    overrides, are said when the server starts, not found out later."""
    tokens = tmp_path / "tokens"
    tokens.write_text("operator-token-0123456789 *\n")
    monkeypatch.setenv("TIERED_CACHE_SERVE_TOKEN", "forgotten-token-0123456789")
    with StoreProcess(["--no-disk", "--shm", "off", "--ram", "1TiB", "--token-file", str(tokens)]) as store:
        pass
    text = "\n".join(store.output)
    assert "WARNING: --ram 1 TiB is more than this machine's" in text
    assert "$TIERED_CACHE_SERVE_TOKEN is set but not used: the token file" in text and "forgotten" not in text


def test_a_mistyped_option_is_told_by_its_command_with_the_one_meant():
    result = run_cli("serve", "--rm", "1GiB", "--port", "0", check=False)
    assert result.returncode == 2 and "usage: tiered-cache serve" in result.stderr
    assert "--rm: did you mean --ram?" in result.stderr.splitlines()[-1]


def test_the_start_line_shows_the_disk_capacity_the_tier_really_got(tmp_path):
    """A disk with less room than --disk-capacity: the tier uses the room there, and the start-up
    line says so (a small tmpfs, as root; elsewhere skipped)."""
    import subprocess

    folder = tmp_path / "small"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8M", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        with StoreProcess(["--disk", str(folder), "--disk-capacity", "1GiB", "--ram", "16MiB"]) as store:
            pass
    finally:
        subprocess.run(["umount", str(folder)], capture_output=True)
    line = next(line for line in store.output if "tiers:" in line)
    assert "(of 1 GiB asked: the room there)" in line and "disk 1 GiB" not in line, line
