#!/usr/bin/env bash
# What `make test-long` needs beyond .venv: an SSH server for the "node" `ray up` reaches, and
# `nc` as its SSH proxy (tests/deploy/test_ray_up.py). Installed through apt where missing; as root.
set -euo pipefail

missing=()
[ -x /usr/sbin/sshd ] || missing+=(openssh-server)
command -v ssh >/dev/null 2>&1 || missing+=(openssh-client)
command -v nc >/dev/null 2>&1 || missing+=(netcat-openbsd)
command -v runuser >/dev/null 2>&1 || missing+=(util-linux)
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "test-long needs ${missing[*]} and cannot install them here (not root or no apt)" >&2
    exit 1
fi
echo "==> installing ${missing[*]} with apt"
(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}") >/dev/null
