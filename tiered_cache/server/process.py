"""Run `tiered-cache serve` as a child process on a free port (tests, benchmarks, the demo)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

_LISTENING = re.compile(r"listening on (\S+):(\d+)")
_METRICS = re.compile(r"metrics at (http://\S+/metrics)")
_EVENTS = re.compile(r"KV events at (tcp://\S+) \(replay (tcp://\S+)\)")


class StoreProcess:
    """`with StoreProcess(["--no-disk"]) as store: ...` -> `store.address` is HOST:PORT (and with
    `--metrics-port`, `store.metrics_url` the URL to scrape)."""

    def __init__(self, args: Sequence[str] = (), start_timeout_s: float = 30.0) -> None:
        self.args = list(args)
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[str] | None = None
        self.address = ""
        self.metrics_url = ""
        self.events_endpoint = self.replay_endpoint = ""  # with --kv-events
        self.output: list[str] = []
        self._reader: threading.Thread | None = None

    def start(self) -> str:
        cmd = [sys.executable, "-m", "tiered_cache.cli.main", "serve", "--port", "0", *self.args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + self.start_timeout_s
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.output.append(line.rstrip())
            found = _LISTENING.search(line)
            if found:
                self.address = f"{found.group(1)}:{found.group(2)}"
            metrics = _METRICS.search(line)
            if metrics:
                self.metrics_url = metrics.group(1)
            events = _EVENTS.search(line)
            if events:
                self.events_endpoint, self.replay_endpoint = events.group(1), events.group(2)
            if self.address and self._wants(self.metrics_url, "--metrics-port") and \
                    self._wants(self.events_endpoint, "--kv-events"):
                # The rest is read by a thread: a full pipe would block the server's prints, and
                # lines the reader buffered past this one must not be lost to a later read.
                self._reader = threading.Thread(target=self._read_rest, name="store-process-output", daemon=True)
                self._reader.start()
                return self.address
        self.kill()
        raise RuntimeError("the store server did not start:\n" + "\n".join(self.output))

    def _wants(self, found: str, flag: str) -> bool:
        """Whether what `flag` makes the server print was read (or the flag was not given)."""
        return bool(found) or not any(a == flag or a.startswith(flag + "=") for a in self.args)

    def _read_rest(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line.rstrip())

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        """Send `sig` and wait; returns the exit code (and keeps what it printed in `output`)."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=10)
            self._reader = None
        code = self.proc.returncode
        self.proc = None
        return code

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def __enter__(self) -> StoreProcess:
        self.start()
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        exited = self.proc.poll() if self.proc is not None else None  # before it was told to stop
        code = self.stop()
        if exc_type is not None:  # what the server said, for whoever reads the failure
            state = f"had exited with {exited}" if exited is not None else f"exited with {code} when stopped"
            print(f"store server ({' '.join(self.args)}) {state}; its output:\n" + "\n".join(self.output),
                  file=sys.stderr)
