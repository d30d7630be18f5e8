"""`ray up deploy/cluster-local.yaml` for real, the way deploy/README.md tells a user to run it:
an SSH "node" on this machine (an `sshd` on a loopback port, a key made here, a user of its own),
`ray up` mounts the auth token, the wheel `make wheel` builds and the cluster config, installs the
wheel into the node user's Python and starts Ray with token auth; `ray exec` then runs
`tiered-cache cluster start / status / generate / stop`, and `ray down` leaves no process behind.

What the test changes in the recipe is what the README tells a user to edit: the node's address,
the SSH user and key, `worker.num_gpus: 0` on machines without GPUs, sizes for a small machine.
Two things only a shared test machine needs: Ray's port (a Redis may hold 6379 here), and `nc` as
the SSH proxy (Ray's local provider always dials
port 22). The node user's Python already holds the project's dependencies (as a machine image
would): the recipe's pinned `pip install`s find them installed, and what it installs is the wheel.

Runs as root (it adds a user and starts `sshd`), in `make test-long`, not in `make test`: the
node user's `ray stop` is what `ray down` runs, and it must not meet the suite's own Ray cluster.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.long

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
NODE_USER = "tiered-node"
NODE_HOME = Path("/home") / NODE_USER
NODE_PYTHON = "/usr/bin/python3"  # a Python the node user can run (the suite's may sit under /root)
STEP_TIMEOUT_S = 600  # one `ray up` or `ray exec` step, bounded so a stuck SSH cannot hang CI
TOKEN = "deploy-test-shard-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=STEP_TIMEOUT_S, **kwargs)
    if done.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {done.returncode}\n--- stdout\n{done.stdout[-4000:]}"
                             f"\n--- stderr\n{done.stderr[-4000:]}")
    return done


def node_processes() -> list[str]:
    ps = subprocess.run(["ps", "-u", NODE_USER, "-o", "pid=,args="], capture_output=True, text=True)
    return [line.strip() for line in ps.stdout.splitlines() if line.strip()]


def as_node(*args: str) -> None:
    run(["runuser", "-u", NODE_USER, "--", *args])


def make_node_user() -> None:
    """A user of its own for the node: its `ray stop` cannot touch root's processes, and its home
    holds what `ray up` writes. Recreated each run so nothing from a previous run is reused."""
    if shutil.which("sshd") is None and not Path("/usr/sbin/sshd").exists():
        pytest.fail("sshd is missing: `make test-long` installs openssh-server")
    subprocess.run(["pkill", "-KILL", "-u", NODE_USER], capture_output=True)
    subprocess.run(["userdel", "-r", NODE_USER], capture_output=True)
    run(["useradd", "-m", "-d", str(NODE_HOME), "-s", "/bin/bash", NODE_USER])
    run(["usermod", "-p", "*", NODE_USER])  # no password, but not locked: sshd lets a key in


def provision_node_python() -> None:
    """The node user's venv, with the suite's installed dependencies visible through a .pth file
    (the project itself, installed editable there, is left out: the wheel brings it). `ray` on the
    node's PATH runs from this venv, so Ray's workers import the wheel's tiered_cache."""
    deps = NODE_HOME / "deps"
    deps.mkdir()
    site = Path(sysconfig.get_paths()["purelib"])
    for entry in site.iterdir():
        name = entry.name
        if name.startswith(("tiered_cache", "__editable__", "_tiered_cache")) or name.endswith(".pth"):
            continue
        (deps / name).symlink_to(entry)
    run(["chown", "-R", f"{NODE_USER}:{NODE_USER}", str(deps)])
    as_node(NODE_PYTHON, "-m", "venv", str(NODE_HOME / "venv"))
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    pth = NODE_HOME / "venv" / "lib" / version / "site-packages" / "node-deps.pth"
    pth.write_text(f"{deps}\n")
    ray_cli = NODE_HOME / "venv" / "bin" / "ray"
    ray_cli.write_text(f"#!{NODE_HOME}/venv/bin/python\nimport sys\nfrom ray.scripts.scripts import main\n"
                       "sys.exit(main())\n")
    ray_cli.chmod(0o755)
    bashrc = NODE_HOME / ".bashrc"
    bashrc.write_text(bashrc.read_text() + f"\nexport PATH={NODE_HOME}/venv/bin:$PATH\n"
                      f"export RAY_TMPDIR={NODE_HOME}/ray-tmp\n")  # not root's /tmp/ray
    (NODE_HOME / "ray-tmp").mkdir()
    run(["chown", "-R", f"{NODE_USER}:{NODE_USER}", str(NODE_HOME)])


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    """An sshd on a loopback port that lets the node user in with a key made here."""
    if os.geteuid() != 0:
        pytest.skip("the ray up test adds a user and starts sshd: run it as root (make test-long)")
    folder = tmp_path_factory.mktemp("sshd")
    make_node_user()
    run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(folder / "host_key")])
    run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(folder / "user_key")])
    ssh_dir = NODE_HOME / ".ssh"
    ssh_dir.mkdir(mode=0o700)
    shutil.copy(folder / "user_key.pub", ssh_dir / "authorized_keys")
    run(["chown", "-R", f"{NODE_USER}:{NODE_USER}", str(ssh_dir)])
    provision_node_python()
    port = free_port()
    config = folder / "sshd_config"
    config.write_text("\n".join([
        f"Port {port}", "ListenAddress 127.0.0.1", f"HostKey {folder / 'host_key'}",
        f"PidFile {folder / 'sshd.pid'}", "AuthorizedKeysFile .ssh/authorized_keys",
        "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no",
        f"AllowUsers {NODE_USER}", ""]))
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation folder
    with open(folder / "sshd.log", "w") as log:  # the child keeps its own copy of the descriptor
        server = subprocess.Popen([shutil.which("sshd") or "/usr/sbin/sshd", "-D", "-e", "-f", str(config)],
                                  stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"sshd did not start: {(folder / 'sshd.log').read_text()[-2000:]}")
            time.sleep(0.2)
    yield {"port": port, "key": folder / "user_key"}
    server.terminate()
    server.wait(timeout=10)
    subprocess.run(["pkill", "-KILL", "-u", NODE_USER], capture_output=True)
    subprocess.run(["userdel", "-r", NODE_USER], capture_output=True)  # the machine as it was


def readme_steps() -> list[str]:
    """The commands deploy/README.md gives under "Machines you have", in order."""
    text = (DEPLOY / "README.md").read_text()
    section = text[text.index("## Machines you have"):]
    block = section[section.index("```bash\n") + len("```bash\n"):]
    block = block[:block.index("```")]
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def launch(sshd, tmp_path_factory):
    """cluster-local.yaml and the cluster config edited as the README tells a user to, and a
    launcher whose home is a folder of the test's (the token lands there, not in root's ~/.ray)."""
    folder = tmp_path_factory.mktemp("launcher")
    env = launcher_env(folder)

    cluster_config = yaml.safe_load((DEPLOY / "tiered-cache-cluster.yaml").read_text())
    cluster_config["shards"] = cluster_config["workers"] = 1
    cluster_config["start_timeout_s"] = 120
    cluster_config["shard"].update(ram_capacity="64MiB", disk_capacity="256MiB", token=TOKEN)
    cluster_config["worker"].update(num_gpus=0, pool_capacity="32MiB", host_capacity="64MiB")
    (folder / "tiered-cache-cluster.yaml").write_text(yaml.safe_dump(cluster_config))

    path, ray_port = node_config(sshd, folder)
    return {"config": str(path), "env": env, "port": ray_port, "folder": folder, "ran": []}


def launcher_env(folder: Path) -> dict[str, str]:
    """The launcher's environment: a home of its own in `folder` (the token lands there, not in
    root's ~/.ray), this Python's `ray` first on PATH, no Ray address inherited."""
    home = folder / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("RAY_ADDRESS", None)
    return env


def node_config(sshd: dict, folder: Path, ray_start: str = "") -> tuple[Path, int]:
    """cluster-local.yaml edited as the README tells a user (this machine's address, the SSH user
    and key, no worker nodes, the cluster config in `folder`), plus a free port for Ray and
    `ray_start` added to the head's `ray start`. Returns its path and Ray's port."""
    ray_port = free_port()
    config = yaml.safe_load((DEPLOY / "cluster-local.yaml").read_text())
    config["provider"].update(head_ip="127.0.0.1", worker_ips=[])
    config["min_workers"] = config["max_workers"] = 0
    config["auth"] = {"ssh_user": NODE_USER, "ssh_private_key": str(sshd["key"]),
                      "ssh_proxy_command": f"nc 127.0.0.1 {sshd['port']}"}
    mounts = config["file_mounts"]
    assert mounts["~/tiered-cache-dist"] == "dist"  # relative to the repository root, where ray up runs
    assert mounts.pop("~/tiered-cache-cluster.yaml") == "deploy/tiered-cache-cluster.yaml"
    mounts["~/tiered-cache-cluster.yaml"] = str(folder / "tiered-cache-cluster.yaml")
    config["head_start_ray_commands"] = [
        line.replace("--port=6379", f"--port={ray_port}{ray_start}")
        for line in config["head_start_ray_commands"]]
    assert any(f"--port={ray_port}" in line for line in config["head_start_ray_commands"])
    path = folder / "cluster-local.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, ray_port


def step(launch: dict, starts: str) -> str:
    """Run the README's step that starts with `starts`, on the edited cluster-local.yaml; its stdout."""
    line = next(s for s in readme_steps() if s.startswith(starts))
    launch["ran"].append(line)
    command = line.replace("deploy/cluster-local.yaml", launch["config"])
    return run(["bash", "-c", command], env=launch["env"], cwd=REPO).stdout


@pytest.fixture(scope="module")
def cluster(launch):
    step(launch, "ray get-auth-token --generate")
    assert (Path(launch["env"]["HOME"]) / ".ray" / "auth_token").is_file()
    step(launch, "make wheel")
    assert list((REPO / "dist").glob("tiered_cache-*.whl"))
    yield step(launch, "ray up ")
    if node_processes():  # the last test's `ray down` did not run or left something
        subprocess.run(["ray", "down", "-y", launch["config"]], env=launch["env"], cwd=REPO,
                       capture_output=True, timeout=STEP_TIMEOUT_S)
        subprocess.run(["pkill", "-KILL", "-u", NODE_USER], capture_output=True)


def ray_exec(launch: dict, command: str) -> str:
    return run(["ray", "exec", launch["config"], command], env=launch["env"], cwd=REPO).stdout


def test_ray_up_installs_the_wheel_and_starts_ray_with_token_auth(cluster, launch):
    installed = ray_exec(launch, "python -c 'import tiered_cache, os; print(os.path.realpath(tiered_cache.__file__))'")
    assert f"{NODE_HOME}/venv/lib/" in installed  # the wheel, in the node user's own Python
    # The wheel brings the Ray layer as tiered_cache.workers and no top-level `workers` (a PyPI name).
    found = ray_exec(launch, "python -c 'import importlib.util as u, tiered_cache.workers.cluster as c; "
                             "print(c.__file__, u.find_spec(\"workers\"))'")
    assert "/tiered_cache/workers/cluster.py None" in found, found
    token = (Path(launch["env"]["HOME"]) / ".ray" / "auth_token").read_text().strip()
    assert (NODE_HOME / ".ray" / "auth_token").read_text().strip() == token  # mounted at Ray's path
    assert "Active:" in ray_exec(launch, "ray status")  # the node user's Ray, reached with the token
    # A caller without the token is turned away (root's own, token-less client on the same port).
    no_token = {k: v for k, v in launch["env"].items() if not k.startswith("RAY_AUTH")}
    no_token["HOME"] = str(launch["folder"])  # no ~/.ray/auth_token here
    refused = subprocess.run(
        [sys.executable, "-c", f"import ray; ray.init(address='127.0.0.1:{launch['port']}', log_to_driver=False)"],
        capture_output=True, text=True, env=no_token, timeout=120)
    assert refused.returncode != 0
    assert "InvalidAuthToken" in refused.stdout + refused.stderr, refused.stderr[-2000:]


def test_cluster_start_status_generate_stop_through_ray_exec(cluster, launch):
    started = step(launch, "ray exec deploy/cluster-local.yaml \"tiered-cache cluster start")
    assert "shard-0" in started and "worker-0" in started, started
    status = step(launch, "ray exec deploy/cluster-local.yaml \"tiered-cache cluster status")
    assert "worker-0" in status and "cpu" in status, status
    answer = step(launch, "ray exec deploy/cluster-local.yaml \"tiered-cache cluster generate")
    assert answer.strip(), "generate printed no answer"
    stopped = step(launch, "ray exec deploy/cluster-local.yaml \"tiered-cache cluster stop")
    assert "actor(s) stopped" in stopped, stopped


def test_ray_down_leaves_no_process_behind(cluster, launch):
    step(launch, "ray down ")
    deadline = time.monotonic() + 60
    while node_processes() and time.monotonic() < deadline:
        time.sleep(1)
    assert node_processes() == []
    assert launch["ran"] == readme_steps()  # every step the README gives, in its order
