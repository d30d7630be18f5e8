"""Telling a TLS mismatch from a dead server: gRPC reports both as UNAVAILABLE, but a server that
answers in the other protocol closes the socket mid-handshake (plaintext client, TLS server) or
fails the handshake (TLS client, plaintext server), and says so in its details."""

from __future__ import annotations

_SIGNS = ("ssl", "tls", "handshake", "certificate", "socket closed", "wrong_version_number")
TLS_HINT = ("the server and this client disagree on TLS: a TLS server needs the CA that signed it "
            "(--tls-ca, remote_tls_ca), a plaintext one none")


def tls_mismatch(details: str) -> bool:
    """Whether a failed call's details read as a TLS handshake that failed (not a server that is down)."""
    text = details.lower()
    return any(sign in text for sign in _SIGNS)
