#!/usr/bin/env bash
# The hierarchical all-reduce against the flat ring on 2 nodes × 2 ranks: two network
# namespaces joined by a veth pair (the inter-node link), made here and removed on exit, one
# `flotilla bench allreduce` per node (shared memory inside a node); then PyTorch's Gloo on the
# same layout when PEERS_PY names a Python with torch (../shared/peers/setup.sh). Needs root.
#
#   bash benches/hierarchical_allreduce.sh                 # SIZES=1,16,64 ITERS=10
#   PEERS_PY=$HOME/.cache/flotilla-peers/bin/python bash benches/hierarchical_allreduce.sh
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${FLOTILLA:-target/release/flotilla}
SIZES=${SIZES:-1,16,64}
ITERS=${ITERS:-10}
id=$$
nodes=("flb${id}a" "flb${id}b")
ips=(10.234.0.1 10.234.0.2)
links=("va${id}" "vb${id}")
started=()
cleanup() {
    for pid in "${started[@]}"; do kill "$pid" 2>/dev/null || true; done
    for ns in "${nodes[@]}"; do ip netns del "$ns" 2>/dev/null || true; done
}
trap cleanup EXIT
for ns in "${nodes[@]}"; do ip netns add "$ns"; done
ip link add "${links[0]}" netns "${nodes[0]}" type veth peer name "${links[1]}" netns "${nodes[1]}"
for i in 0 1; do
    ip -n "${nodes[$i]}" addr add "${ips[$i]}/24" dev "${links[$i]}"
    ip -n "${nodes[$i]}" link set "${links[$i]}" up
    ip -n "${nodes[$i]}" link set lo up
done
FLOTILLA_TOKEN=$(head -c 24 /dev/urandom | base64)
export FLOTILLA_TOKEN
port=29610
echo "# $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); avx512: $(grep -qw avx512f /proc/cpuinfo && echo yes || echo no)"
for algorithm in flat hierarchical; do
    port=$((port + 1))
    node() {
        ip netns exec "${nodes[$1]}" "$BIN" bench allreduce --nproc 2 --nnodes 2 --node-rank "$1" \
            --node-ip "${ips[$1]}" --master "${ips[0]}:$port" --algorithm "$algorithm" \
            --size-mb "$SIZES" --iters "$ITERS" 2>/dev/null
    }
    node 1 >/dev/null &
    started+=($!)
    node 0
    wait "${started[-1]}"
done
if [ -n "${PEERS_PY:-}" ]; then
    port=$((port + 1))
    echo "# Gloo, 2 nodes × 2 ranks (TCP everywhere: Gloo has no shared-memory transport on CPU)"
    for rank in 3 2 1; do
        GLOO_SOCKET_IFNAME=${links[$((rank / 2))]} ip netns exec "${nodes[$((rank / 2))]}" "$PEERS_PY" \
            benches/gloo_allreduce_rank.py --rank "$rank" --world 4 --master "${ips[0]}:$port" \
            --sizes-mib ${SIZES//,/ } --iters "$ITERS" &
        started+=($!)
    done
    GLOO_SOCKET_IFNAME=${links[0]} ip netns exec "${nodes[0]}" "$PEERS_PY" benches/gloo_allreduce_rank.py \
        --rank 0 --world 4 --master "${ips[0]}:$port" --sizes-mib ${SIZES//,/ } --iters "$ITERS"
    wait
fi
