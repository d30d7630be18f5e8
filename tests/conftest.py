"""Shared test set-up: hypothesis profiles and a helper to run the CLI in its own process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

REPO = Path(__file__).resolve().parent.parent

# How deep the property tests search. `ci` (the default) runs a hundred state-machine runs of 50
# steps each, and each run of the suite draws new ones; `thorough` searches 4x deeper (run it
# after changing a protocol, the index or the page ledger); `dev` is quicker.
_PROFILES = {"ci": 100, "thorough": 400, "dev": 40}
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
settings.register_profile("ci", max_examples=_PROFILES["ci"], stateful_step_count=50, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=_PROFILES["thorough"], stateful_step_count=50, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=_PROFILES["dev"], stateful_step_count=30, deadline=None)
settings.load_profile(PROFILE)


def examples(ci: int) -> int:
    """A property test's own example count at `ci` depth, scaled for the profile in use."""
    return max(10, ci * _PROFILES.get(PROFILE, _PROFILES["ci"]) // _PROFILES["ci"])


def ctrl_c_able() -> None:
    """`preexec_fn` for a child a test interrupts with SIGINT: a shell that runs the suite in the
    background (`make test &`) starts it with SIGINT ignored, every child inherits that, and
    Python then never raises KeyboardInterrupt: the child would hang instead of exiting."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_cli(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run `tiered-cache ARGS` as a user would, in a fresh interpreter."""
    result = subprocess.run([sys.executable, "-m", "tiered_cache.cli.main", *args],
                            capture_output=True, text=True, cwd=REPO, timeout=300)
    if check and result.returncode != 0:
        raise AssertionError(f"tiered-cache {' '.join(args)} exited {result.returncode}:\n{result.stderr}")
    return result


def run_cli_here(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """`run_cli`, through `tiered-cache`'s entry point (`main`) in this process: the same argv in,
    exit status, stdout and stderr out, without a fresh interpreter importing torch again (2-4 s a
    command here). For commands whose figures a test reads; `run_cli` walks the program itself
    (exit codes of a process, signals, a command that must not share this process)."""
    import contextlib
    import io

    from tiered_cache.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exit_:  # argparse's usage errors, and `raise SystemExit("message")`
            if exit_.code is None or isinstance(exit_.code, int):
                code = exit_.code or 0
            else:
                print(exit_.code, file=sys.stderr)
                code = 1
    result = subprocess.CompletedProcess(["tiered-cache", *args], code, out.getvalue(), err.getvalue())
    if check and code != 0:
        raise AssertionError(f"tiered-cache {' '.join(args)} exited {code}:\n{result.stderr}")
    return result


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """One real redis-server for the whole session, on a free loopback port."""
    from tiered_cache.bench.redis_process import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    """A real 3-master Redis Cluster for one test module (its tests may kill and restart masters).
    Masters flag a silent peer failed after 0.5 s instead of Redis's default 15 s."""
    from tiered_cache.bench.redis_process import RedisClusterServers

    cluster = RedisClusterServers(tmp_path_factory.mktemp("redis-cluster"), masters=3, node_timeout_ms=500)
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture
def redis_prefix(request) -> str:
    """A key prefix of this test's own, so tests sharing the server never see each other's keys."""
    return f"test-{request.node.name}"


try:
    _USER_CACHE: Path | None = Path("~/.cache/tiered-cache").expanduser()
except RuntimeError:  # no home to expand: nothing shared between runs
    _USER_CACHE = None
_SMOLLM2 = "smollm2-135m-instruct"  # integrations/smollm2.py's MODEL_DIR (not imported here: no torch yet)


def pytest_configure(config):
    """Store servers started without --disk use $TIERED_CACHE_DIR/store: a folder of this run's
    own, removed afterwards, never the user's ~/.cache/tiered-cache (which earlier runs filled).
    SmolLM2's safetensors copy (converted from the GGUF once: ~16 s of parsing) is the one thing
    shared: the run links the user's copy where there is one, and leaves its own there otherwise."""
    if "TIERED_CACHE_DIR" not in os.environ:
        import tempfile

        config._tiered_cache_dir = tempfile.mkdtemp(prefix="tiered-cache-tests-")
        os.environ["TIERED_CACHE_DIR"] = config._tiered_cache_dir
        if _USER_CACHE is not None and (_USER_CACHE / _SMOLLM2 / "model.safetensors").is_file():
            os.symlink(_USER_CACHE / _SMOLLM2, Path(config._tiered_cache_dir) / _SMOLLM2)


def pytest_unconfigure(config):
    folder = getattr(config, "_tiered_cache_dir", None)
    if folder is not None:
        import shutil

        converted = Path(folder) / _SMOLLM2
        if _USER_CACHE is not None and (converted / "model.safetensors").is_file() and not converted.is_symlink():
            _keep_conversion(converted, _USER_CACHE)  # the next run links it instead of converting again
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop("TIERED_CACHE_DIR", None)


def _keep_conversion(converted: Path, cache: Path) -> None:
    """Move a run's SmolLM2 conversion to `cache`, whole or not at all: copied beside the target,
    then renamed, under the lock `integrations/smollm2.py` converts under (two runs ending
    together, or a run and a conversion, take turns). Any failure leaves nothing behind."""
    import fcntl
    import shutil

    incoming = cache / f".{_SMOLLM2}.{os.getpid()}"
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with open(cache / f".{_SMOLLM2}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (cache / _SMOLLM2).exists():
                shutil.move(converted, incoming)
                os.rename(incoming, cache / _SMOLLM2)
    except OSError:
        shutil.rmtree(incoming, ignore_errors=True)


def pytest_addoption(parser):
    parser.addoption("--long", action="store_true",
                     help="run the tests marked `long` too (the real `ray up` as root, soaks: make test-long)")
    parser.addoption("--engines", action="store_true",
                     help="run the tests marked `engine` too (real SGLang servers, vLLM instances: make test-sglang, "
                          "make test-vllm)")


def pytest_collection_modifyitems(config, items):
    """The modules that use the session's Ray cluster run last, so that its idle daemons (a tenth
    of a core for three nodes) run beside those tests only, not beside the whole suite. Tests
    marked `gpu` need CUDA and CuPy; without them they are skipped, and say so. Tests marked
    `long` run only under --long (`make test-long`), tests marked `engine` only under --engines
    (engines start for minutes: `make test-sglang`, `make test-vllm`)."""
    import torch

    for marker, option, reason in (
            ("long", "--long", "past the suite's time budget or needs root: runs in make test-long"),
            ("engine", "--engines", "starts real serving engines: runs in make test-vllm / make test-sglang")):
        if not config.getoption(option):
            for item in items:
                if marker in item.keywords:
                    item.add_marker(pytest.mark.skip(reason=reason))

    ray_modules = {item.module for item in items if "ray_cluster" in getattr(item, "fixturenames", ())}
    items[:] = [i for i in items if i.module not in ray_modules] + [i for i in items if i.module in ray_modules]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (GPU path; its logic is also tested on the CPU)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ray_cluster():
    """One real local Ray cluster for the whole session: a CPU head and two more nodes that each
    advertise one GPU (Ray's resource only: the work runs on the CPU), each node with a custom
    resource (`node0`, `node1`, `node2`) so a test can pin an actor to a node. The calling process
    is not connected: tests call `ray.init(address=ray_cluster.address, namespace=...)`."""
    from ray.cluster_utils import Cluster

    object_store = 100 * 2**20  # the smallest Ray allows is 75 MiB; pages travel over gRPC, not Ray
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 4, "resources": {"node0": 100}, "object_store_memory": object_store})
    for i in (1, 2):
        cluster.add_node(num_cpus=4, num_gpus=1, resources={f"node{i}": 100}, object_store_memory=object_store)
    cluster.wait_for_nodes()
    yield cluster
    import ray

    ray.shutdown()
    cluster.shutdown()


@pytest.fixture
def small_fs(tmp_path):
    """A 4 MiB tmpfs of the test's own: a filesystem smaller than the disk tier's capacity."""
    import shutil

    if shutil.which("mount") is None:
        pytest.skip("no `mount` command to make a small filesystem with")
    folder = tmp_path / "small-fs"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(folder)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here (needs root): {mounted.stderr.strip()}")
    yield folder
    if subprocess.run(["umount", str(folder)]).returncode != 0:
        subprocess.run(["umount", "--lazy", str(folder)], check=True)  # a tier the test left open


# SGLang's tests run in .venv-sglang (its own pytest: `make test`, `make test-sglang`): this
# interpreter has no SGLang, so it does not collect them.
try:
    import sglang  # noqa: F401
except ImportError:
    collect_ignore = ["integrations/test_sglang_backend.py", "integrations/test_sglang_engine.py"]
