"""Start vLLM instances in seconds: one process in the vLLM venv imports vLLM once and forks a
fresh child for each instance (`instance.py`).

Importing vLLM takes most of a fresh instance's start-up; a child forked after the import skips
it. Each child is still its own process with its own engine, KV cache,
connector and block stores, as a second serving instance would be: nothing but imported modules
is shared (the server creates no engine, no tokenizer and no thread before it forks).

    with InstanceLauncher(Path(".venv-vllm/bin/python")) as launcher:
        done = launcher.run(["--model", folder, "-q", "..."], timeout_s=600)  # a CompletedProcess
        answers = launcher.run_json(["--model", folder, "-q", "..."])  # its JSON line, or RuntimeError

The protocol is one JSON line each way on the server's stdin and stdout: a request names the
instance's arguments and the files its stdout and stderr go to; the server answers with the
child's pid as soon as it runs (so a caller can kill it), then with its exit status. The server
ends when its stdin closes (its caller exited).
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

PRELOADED = ("vllm", "vllm.entrypoints.llm", "vllm.v1.engine.llm_engine", "vllm.v1.engine.core",
             "vllm.v1.executor.uniproc_executor", "vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner",
             "vllm.model_executor.models.llama", "tiered_cache.integrations.vllm.instance",
             "tiered_cache.integrations.vllm.connector")


class InstanceLauncher:
    """The caller's side (any venv): starts the fork server in the vLLM venv's `python`."""

    def __init__(self, python: Path, start_timeout_s: float = 300.0) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="tiered-cache-vllm-instances-")
        self._log = Path(self._tmp.name) / "forkserver.err"  # a file: a full pipe would block the server
        with self._log.open("w") as log:
            self._proc = subprocess.Popen([str(python), "-m", "tiered_cache.integrations.vllm.forkserver"],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
        self._pending = b""  # read from the server, not yet a whole line
        self._runs = 0
        try:
            ready = self._answer(start_timeout_s)
        except BaseException:
            self.close()
            raise
        if ready != {"ready": True}:
            self.close()
            raise RuntimeError(f"the vLLM fork server did not start: {ready}")

    def run(self, argv: list[str], timeout_s: float = 600.0) -> subprocess.CompletedProcess[str]:
        """Run `instance.main(argv)` in a fresh child; a child still running after `timeout_s` is
        killed and reported as `TimeoutError`."""
        self._runs += 1
        out, err = (Path(self._tmp.name) / f"{self._runs}.{name}" for name in ("out", "err"))
        assert self._proc.stdin is not None
        request = {"argv": argv, "stdout": str(out), "stderr": str(err)}
        self._proc.stdin.write(json.dumps(request).encode() + b"\n")
        self._proc.stdin.flush()
        pid = self._answer(30.0)["pid"]
        try:
            done = self._answer(timeout_s)
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            self._answer(30.0)
            raise TimeoutError(f"a vLLM instance ran past {timeout_s:.0f} s and was killed: "
                               f"{err.read_text()[-3000:]}") from None
        return subprocess.CompletedProcess(argv, done["returncode"], out.read_text(), err.read_text())

    def run_json(self, argv: list[str], timeout_s: float = 600.0) -> dict[str, Any]:
        """The JSON line an instance prints last (`instance.py`); RuntimeError with the end of
        its stderr when it fails."""
        done = self.run(argv, timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"vLLM instance failed ({done.returncode}):\n{done.stderr[-4000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    def _answer(self, timeout_s: float) -> dict[str, Any]:
        """The server's next line (raises TimeoutError after `timeout_s`, RuntimeError if it died).
        Read from the pipe's descriptor, not a buffered file: two lines that arrive together
        must not leave the second in a buffer that `select` cannot see."""
        assert self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError(f"the vLLM fork server did not answer within {timeout_s:.0f} s")
            data = os.read(fd, 65536)
            if not data:
                self._proc.wait()
                raise RuntimeError(f"the vLLM fork server exited ({self._proc.returncode}): "
                                   f"{self._log.read_text()[-3000:]}")
            self._pending += data
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()  # the server's loop ends on end of input
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        self._tmp.cleanup()

    def __enter__(self) -> InstanceLauncher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _child(request: dict[str, Any]) -> int:
    """In the forked child: stdout and stderr to the request's files, then one instance."""
    from tiered_cache.integrations.vllm import instance

    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # the server's requests are not the instance's input
    os.close(devnull)
    try:
        return instance.main(request["argv"])
    except SystemExit as exc:  # argparse's errors, sys.exit()
        return exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _reply(out: IO[str], message: dict[str, Any]) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


def serve() -> int:
    """The server's loop (in the vLLM venv): import vLLM once, then fork a child per request."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # scheduler and worker in the child
    replies = os.fdopen(os.dup(1), "w")  # the protocol's channel, kept apart from fd 1:
    os.dup2(2, 1)  # what vLLM's import prints goes to the log, and each child sets fd 1 to its file
    started = time.perf_counter()
    # The point: every child starts with these imported. vLLM's top level is lazy: `LLM`, the
    # engine, the CPU worker and the model's code import on first use, which would be in each
    # child. Importing them creates no engine and starts no thread.
    for module in PRELOADED:
        importlib.import_module(module)
    # The imported heap is large and never freed: out of the garbage collector's sight, each
    # child's collections (vLLM calls gc.collect() while it starts) walk only what it made.
    gc.freeze()
    print(f"vLLM imported in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    _reply(replies, {"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os._exit(_child(request))  # no atexit handlers of the server's in the child
        _reply(replies, {"pid": pid})
        _, status = os.waitpid(pid, 0)
        _reply(replies, {"returncode": os.waitstatus_to_exitcode(status)})
    return 0


if __name__ == "__main__":
    sys.exit(serve())
