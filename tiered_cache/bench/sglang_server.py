"""A real SGLang server in its own process group (from `.venv-sglang`), with HiCache and an L3
storage backend, and the requests a user sends it: what `bench sglang` and the engine tests run.

On a machine without CUDA the engine needs the stand-ins of `tests/sglang_cpu/` (README, "Under
SGLang"): `standins=True` puts them on its path, never otherwise."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tiered_cache.bench.redis_process import free_port

REPO = Path(__file__).resolve().parents[2]
SGLANG_PYTHON = REPO / ".venv-sglang" / "bin" / "python"
STANDINS = REPO / "tests" / "sglang_cpu"
OUR_BACKEND = {"backend_name": "tiered-cache", "module_path": "tiered_cache.integrations.sglang.backend",
               "class_name": "TieredCacheStorage"}


def model_folder() -> str:
    """SmolLM2-135M as safetensors, converted once by the main venv (which has the GGUF reader)."""
    code = "from tiered_cache.integrations.smollm2 import MODEL_DIR, cache_dir, load_model; load_model(); " \
           "print(cache_dir() / MODEL_DIR)"
    out = subprocess.run([str(REPO / ".venv" / "bin" / "python"), "-c", code], capture_output=True, text=True,
                         check=True, timeout=600)
    return out.stdout.strip().splitlines()[-1]


def sglang_env(standins: bool = True) -> dict[str, str]:
    """The environment of an SGLang process here: its CPU engine, and the stand-ins it needs on a
    machine without CUDA when `standins`."""
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"}
    if standins:
        env["PYTHONPATH"] = os.pathsep.join([str(STANDINS), os.environ.get("PYTHONPATH", "")])
    return env


class SGLangServer:
    """`with SGLangServer(model, log, storage="dynamic", extra={...}) as server: server.generate(...)`.
    `storage=None`: HiCache with no L3. The CPU engine (torch attention, `direct` host copies)."""

    def __init__(self, model: str, log: Path, storage: str | None = "dynamic", extra: dict[str, Any] | None = None,
                 start_timeout_s: float = 300.0, standins: bool = True) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        python = str(SGLANG_PYTHON) if SGLANG_PYTHON.exists() else sys.executable
        cmd = [python, "-m", "sglang.launch_server", "--model-path", model, "--device", "cpu",
               "--attention-backend", "torch_native", "--max-total-tokens", "4096", "--page-size", "16",
               "--port", str(self.port), "--enable-hierarchical-cache", "--hicache-io-backend", "direct",
               "--hicache-mem-layout", "layer_first", "--hicache-ratio", "2", "--sleep-on-idle"]
        if storage:
            cmd += ["--hicache-storage-backend", storage]
        if extra is not None:
            cmd += ["--hicache-storage-backend-extra-config", json.dumps(extra)]
        self._out = log.open("w")
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT, env=sglang_env(standins),
                                     start_new_session=True)
        self._wait_ready(start_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"SGLang exited {self.proc.returncode} at start:\n{self.tail()}")
            if "The server is fired up and ready to roll" in self.log.read_text(errors="replace"):
                return
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"SGLang did not start within {timeout_s:.0f} s:\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def post(self, path: str, body: dict[str, Any] | None = None, timeout_s: float = 300.0) -> Any:
        data = json.dumps(body or {}).encode()
        request = urllib.request.Request(self.url + path, data, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            raw = reply.read()
        try:
            return json.loads(raw)
        except ValueError:
            return raw.decode()

    def generate(self, prompt: str, max_new_tokens: int = 8) -> dict[str, Any]:
        """The greedy answer and what SGLang says of it: `text`, `cached` (tokens reused) and
        `storage` (of those, tokens read from the L3 backend)."""
        reply = self.post("/generate", {"text": prompt,
                                        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}})
        meta = reply["meta_info"]
        details = meta.get("cached_tokens_details") or {}
        return {"text": reply["text"], "prompt": meta["prompt_tokens"], "cached": meta.get("cached_tokens", 0),
                "storage": details.get("storage", 0)}

    def flush(self, timeout_s: float = 60.0) -> None:
        """`/flush_cache` (device and host caches; SGLang refuses while requests or backups run)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.post("/flush_cache")
                return
            except urllib.error.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._out.close()

    def __enter__(self) -> SGLangServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
