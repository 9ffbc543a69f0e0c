#!/usr/bin/env bash
# System packages the tests use, installed only when missing (Debian/Ubuntu, as root):
#   redis-server     the L2 cache tier's integration tests start a real one
#   docker-compose   validates compose.yaml (`docker-compose config -q` needs no engine);
#                    --no-install-recommends keeps the docker engine itself out
set -euo pipefail
missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v docker-compose >/dev/null || missing+=(docker-compose)
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
