#!/usr/bin/env bash
# Block-status map of a large sparse thin volume over NBD (issue 18): `nbdinfo --map` of a
# thin volume of SIZE (default 1 TiB virtual) with EXTENTS mapped runs of 1 MiB spread evenly
# over it, then `nbdcopy` of the volume to null: (reads only the mapped data), same run.
# Not part of the test suite.
#
#   bench/block_status.sh                          # 1 TiB, 256 mapped MiB-runs, 3 reps
#   SIZE=16GiB EXTENTS=16 REPS=1 bench/block_status.sh  # small: proves the script works
#   MDKIT=target/suite/mdkit bench/block_status.sh # an existing binary instead of a release build
#
# Prints per rep the wall time of the map and of the copy, the number of map rows, the bytes
# the export served to the copy (its read counter) and the BLOCK_STATUS requests it answered.
# What it measures: one BLOCK_STATUS request covers up to 4 GiB (nbdinfo asks 2^32 minus one
# block at a time) and the server walks only the mappings inside it on the pool's metadata
# worker, so the map costs about SIZE / 4 GiB round trips plus the mapped runs, not SIZE.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
ensure_packages libnbd-bin qemu-utils

SIZE=${SIZE:-1TiB}
EXTENTS=${EXTENTS:-256}
REPS=${REPS:-3}
PORT=${PORT:-10882}
WORKDIR=${WORKDIR:-/var/tmp/mdkit-bench-block-status}

if [ -z "${MDKIT:-}" ]; then
    ensure_rust
    cargo build --release -p mdkit --bin mdkit >&2
    MDKIT=$PWD/target/release/mdkit
fi

rm -rf "$WORKDIR"; mkdir -p "$WORKDIR"
data_mib=$(( EXTENTS + 64 ))
cat > "$WORKDIR/mdkit.toml" <<TOML
data_dir = "$WORKDIR"
[nbd]
listen = ["127.0.0.1:$PORT"]
[[volume]]
name = "pool"
kind = "thin-pool"
metadata = "meta.img"
metadata_size = "64MiB"
data = "data.img"
data_size = "${data_mib}MiB"
block_size = "64KiB"
create = true
[[volume]]
name = "sparse"
kind = "thin"
pool = "pool"
id = 0
size = "$SIZE"
create = true
[[export]]
name = "sparse"
volume = "sparse"
TOML
"$MDKIT" serve --config "$WORKDIR/mdkit.toml" 2>"$WORKDIR/mdkit.log" &
pid=$!
trap 'kill $pid 2>/dev/null || true; wait 2>/dev/null || true' EXIT
uri="nbd://127.0.0.1:$PORT/sparse"
for _ in $(seq 100); do nbdinfo --size "$uri" >/dev/null 2>&1 && break; sleep 0.1; done
size_bytes=$(nbdinfo --size "$uri")

# EXTENTS runs of 1 MiB, evenly spaced, written by one qemu-io process.
step=$(( size_bytes / EXTENTS / 1048576 * 1048576 ))
cmds=()
for i in $(seq 0 $(( EXTENTS - 1 ))); do cmds+=(-c "write -q -P 0x5a $(( i * step )) 1M"); done
qemu-io -f raw "${cmds[@]}" "$uri" >/dev/null
log "$SIZE thin volume, $EXTENTS mapped MiB-runs every $(( step >> 20 )) MiB"

now_ms() { echo $(( $(date +%s%N) / 1000000 )); }
stat_of() { "$MDKIT" status --json --socket "$WORKDIR/mdkit.sock" |
    python3 -c "import json,sys; e=[x for x in json.load(sys.stdin)['exports'] if x['name']=='sparse'][0]; print(e['stats']['$1'])"; }

printf '%-4s %10s %8s %10s %14s %14s\n' rep map_ms rows copy_ms copy_read_B status_reqs
for rep in $(seq "$REPS"); do
    s0=$(stat_of block_status); r0=$(stat_of read_bytes)
    t0=$(now_ms)
    rows=$(nbdinfo --map "$uri" | wc -l)
    t1=$(now_ms)
    nbdcopy "$uri" null:
    t2=$(now_ms)
    s1=$(stat_of block_status); r1=$(stat_of read_bytes)
    printf '%-4s %10s %8s %10s %14s %14s\n' "$rep" $(( t1 - t0 )) "$rows" $(( t2 - t1 )) $(( r1 - r0 )) $(( s1 - s0 ))
done
echo "# mapped bytes: $(( EXTENTS * 1048576 )); $(nproc) cores; $(date -u +%FT%TZ)"
