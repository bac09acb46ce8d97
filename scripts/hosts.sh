#!/usr/bin/env bash
# Hosts on this machine for interactive use: network namespaces on a private bridge, as the
# host tests build them (tests/hosts.py). Needs root and iproute2.
#
#   sudo bash scripts/hosts.sh up [-n 3] [--rate h1=100]   # prints each host's address and how
#                                                          # to enter it; Enter or Ctrl-C removes all
#   sudo bash scripts/hosts.sh list    # namespaces, links and state files of runs on this machine
#   sudo bash scripts/hosts.sh clean   # removes the hosts of runs whose process died
#
# Inside a host (`ip netns exec vfXXXX-h0 bash`) the interface is eth0; the hosts reach each
# other's addresses and nothing else. docs/multi-node.md shows a job across them.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
if [ ! -x "$PYTHON" ]; then PYTHON=python3; fi
exec "$PYTHON" tests/hosts.py "$@"
