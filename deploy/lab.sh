#!/bin/sh
# A lab of hosts on this machine: network namespaces on a bridge with shaped links (root only).
#   deploy/lab.sh up --hosts 3 --rate 100mbit   then   ip netns exec pslab-K COMMAND
#   deploy/lab.sh cut K | restore K | partition A B | heal A B | shape --rate R | status | down
# See docs/deployment.md#a-lab-of-hosts-on-one-machine; the code is benchmarks/lab.py.
set -eu
if command -v pipeshard >/dev/null 2>&1; then
    exec pipeshard bench lab "$@"
fi
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" -m benchmarks.lab "$@"
