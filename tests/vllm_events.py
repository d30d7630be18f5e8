"""What vLLM's own subscriber code reads from a publisher: its `KVEventBatch` decoder (msgspec, in
.venv-vllm) decodes every batch the replay endpoint keeps (`vllm_batches`), and an index applies
them as a subscriber would (`vllm_index`)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Each batch as [[event class name, its fields], ...]; bytes (block hashes) as hex.
VLLM_DECODES = """
import json, sys, msgspec, zmq
from vllm.distributed.kv_events import KVEventBatch
sock = zmq.Context.instance().socket(zmq.DEALER)
sock.setsockopt(zmq.RCVTIMEO, 10000)
sock.connect(sys.argv[1])
sock.send_multipart((b"", (0).to_bytes(8, "big")))
decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
out = []
while True:
    _, _, number, payload = sock.recv_multipart()
    if number == (-1).to_bytes(8, "big", signed=True):
        break
    hexed = lambda v: v.hex() if isinstance(v, bytes) else [hexed(x) for x in v] if isinstance(v, list) else v
    out.append([[type(e).__name__, {f: hexed(getattr(e, f)) for f in e.__struct_fields__}]
                for e in decoder.decode(payload).events])
print(json.dumps(out))
"""


def vllm_batches(replay_endpoint: str) -> list[list[list]]:
    """Every kept batch as vLLM's decoder reads it: [[class name, fields], ...] per batch."""
    python = REPO / ".venv-vllm" / "bin" / "python"
    if not python.exists():
        pytest.fail("the vLLM venv is missing: run `make install-vllm` (make test builds it)")
    run = subprocess.run([str(python), "-c", VLLM_DECODES, replay_endpoint], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def vllm_index(replay_endpoint: str) -> dict[str, list[str]]:
    """Block hash (hex) -> mediums, as a subscriber applying vLLM's decoded batches in order holds."""
    held: dict[str, set[str]] = {}
    for batch in vllm_batches(replay_endpoint):
        for kind, event in batch:
            if kind == "BlockStored":
                for block in event["block_hashes"]:
                    held.setdefault(block, set()).add(event["medium"])
            elif kind == "BlockRemoved":
                for block in event["block_hashes"]:
                    held.get(block, set()).discard(event["medium"])
            elif kind == "AllBlocksCleared":
                held.clear()
    return {block: sorted(mediums) for block, mediums in held.items() if mediums}
