"""What vLLM's own subscriber code learns from a publisher: its `KVEventBatch` decoder (msgspec, in
.venv-vllm) reads every batch the replay endpoint keeps and applies them as an index would."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VLLM_INDEX = """
import json, sys, msgspec, zmq
from vllm.distributed.kv_events import KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared
sock = zmq.Context.instance().socket(zmq.DEALER)
sock.setsockopt(zmq.RCVTIMEO, 10000)
sock.connect(sys.argv[1])
sock.send_multipart((b"", (0).to_bytes(8, "big")))
decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
held = {}
while True:
    _, topic, number, payload = sock.recv_multipart()
    if number == (-1).to_bytes(8, "big", signed=True):
        break
    for e in decoder.decode(payload).events:
        if isinstance(e, BlockStored):
            for h in e.block_hashes:
                held.setdefault(h.hex(), set()).add(e.medium)
        elif isinstance(e, BlockRemoved):
            for h in e.block_hashes:
                held.get(h.hex(), set()).discard(e.medium)
        elif isinstance(e, AllBlocksCleared):
            held.clear()
print(json.dumps({h: sorted(m) for h, m in held.items() if m}))
"""


def vllm_index(replay_endpoint: str) -> dict[str, list[str]]:
    """Block hash (hex) -> mediums, as vLLM's decoder applied the kept batches."""
    python = REPO / ".venv-vllm" / "bin" / "python"
    if not python.exists():
        pytest.fail("the vLLM venv is missing: run `make install-vllm` (make test builds it)")
    run = subprocess.run([str(python), "-c", VLLM_INDEX, replay_endpoint], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])
