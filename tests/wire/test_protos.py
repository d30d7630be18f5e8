import subprocess
import sys

from conftest import REPO

GENERATED = ["cache_pb2.py", "cache_pb2.pyi", "cache_pb2_grpc.py"]


def test_committed_stubs_match_the_proto(tmp_path):
    """Fails when proto/ changed without `scripts/gen_protos.sh`."""
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", str(REPO / "proto"),
                    f"--python_out={tmp_path}", f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}",
                    str(REPO / "proto/tiered_cache/v1/cache.proto")], check=True)
    for name in GENERATED:
        fresh = (tmp_path / "tiered_cache/v1" / name).read_text()
        committed = (REPO / "tiered_cache/v1" / name).read_text()
        assert fresh == committed, f"tiered_cache/v1/{name} is stale: run scripts/gen_protos.sh"
