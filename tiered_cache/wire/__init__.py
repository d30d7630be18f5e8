"""What a store client and a store server both speak, below both (DESIGN.md §2).

- `codec.py`: the page blob (DESIGN.md §5), with its checksum (`checksum.py`).
- `framing.py`: `PageBlob` messages built and parsed by hand on both ends of Get and Put.
- `auth.py`: the bearer token, one check for every path that takes one.
- `options.py`: gRPC channel and message options, and the default message bound.
- `deadline.py`: the progress deadline of a stream, and the errors a deadline ends a call with.

Nothing here knows the client or the server; it imports only `model/`, `errors.py` and the stubs.
"""
