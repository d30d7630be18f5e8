"""PageBlob messages framed by hand on both ends of Get and Put.

A `PageBlob` is three length-delimited fields (key, blob, fingerprint). Building and parsing
them directly makes one copy of each blob per side, where the protobuf message class makes two
(copied into the message, then out again on serialization or on access).
"""

from __future__ import annotations


def page_blob_message(key: bytes, blob: bytes, fingerprint: bytes = b"") -> bytes:
    """A serialized `PageBlob{key, blob, fingerprint}`, built with one copy of the blob (a
    message object copies it in and `SerializeToString` copies it again)."""
    parts = [b"\x0a", _varint(len(key)), key, b"\x12", _varint(len(blob)), blob]
    if fingerprint:
        parts += [b"\x1a", _varint(len(fingerprint)), fingerprint]
    return b"".join(parts)


def page_ref_message(key: bytes, position: int, length: int) -> bytes:
    """A serialized `PageBlob{key, shm_position, shm_length}`: where the page lies in the
    server's arena (shm/arena.py), instead of its bytes."""
    return b"".join([b"\x0a", _varint(len(key)), key, b"\x20", _varint(position), b"\x28", _varint(length)])


class ReceivedBlob:
    """A `PageBlob` as received (key, blob, fingerprint), parsed without the message class;
    `shm`: (position, length) in the server's ring when the page came that way (blob empty)."""

    __slots__ = ("blob", "fingerprint", "key", "shm")

    def __init__(self, key: bytes, blob: bytes | memoryview, fingerprint: bytes = b"",
                 shm: tuple[int, int] | None = None) -> None:
        self.key, self.blob, self.fingerprint, self.shm = key, blob, fingerprint, shm


def parse_page_blob(data: bytes) -> ReceivedBlob:
    """The fields of a serialized `PageBlob`. The blob is a read-only view into `data`, not a copy
    (the message class copies it in, then again into a Python `bytes` on access): a fresh multi-MiB
    buffer per page costs first-touch page faults that, in a busy engine process, took longer
    than the network. Unknown fields are skipped as protobuf requires; a malformed message raises
    ValueError."""
    key = fingerprint = b""
    blob: bytes | memoryview = b""
    shm_position = shm_length = 0
    view, pos, end = memoryview(data), 0, len(data)
    while pos < end:
        tag, pos = _read_varint(view, pos)
        number, wire = tag >> 3, tag & 7
        if wire == 2:
            length, pos = _read_varint(view, pos)
            if pos + length > end:
                raise ValueError("PageBlob field runs past the message")
            if number == 1:
                key = bytes(view[pos:pos + length])
            elif number == 2:
                blob = view[pos:pos + length]
            elif number == 3:
                fingerprint = bytes(view[pos:pos + length])
            pos += length
        elif wire == 0:
            value, pos = _read_varint(view, pos)
            if number == 4:
                shm_position = value
            elif number == 5:
                shm_length = value
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        else:
            raise ValueError(f"PageBlob has a field of unsupported wire type {wire}")
    if pos != end:
        raise ValueError("PageBlob is truncated")
    return ReceivedBlob(key, blob, fingerprint, (shm_position, shm_length) if shm_length else None)


def _read_varint(view: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(view) or shift > 63:
            raise ValueError("PageBlob has a malformed varint")
        byte = view[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)
