#!/usr/bin/env bash
# Issue 18's benchmark, both halves in one run:
# 1. `mdkit thin delta` vs `thin_delta` on the same metadata, BLOCKS mapped blocks per device
#    (default 1,048,576);
# 2. the block-status map of a SIZE thin volume (default 1 TiB) over NBD: `nbdinfo --map`
#    through mdkit vs through a reference server, nbdkit's file plugin on a sparse file holding
#    the same data at the same offsets (it answers with lseek SEEK_DATA/SEEK_HOLE).
# Each comparison carries an A/A control: the reference measured a second time, interleaved
# with the other two the same way, so the noise of the ratio is on the same page.
#
#   bench/thin_delta.sh                            # the acceptance size (a few minutes)
#   SMALL=1 bench/thin_delta.sh                    # seconds: 20,000 blocks, 16 GiB, 2 reps
#   MDKIT=target/suite/mdkit bench/thin_delta.sh   # use that binary, no release build
#
# Delta: the pool (64 KiB blocks) has an origin, device 1, with BLOCKS mapped blocks, and
# device 2, a snapshot of it in which every 100th block was rewritten (remapped: `different`)
# and BLOCKS/100 blocks past the origin's end were written (`right_only`); the rest is `same`.
# The metadata is made by thin_restore from a generated XML, so neither side reads metadata it
# wrote itself. The script fails if the two outputs differ.
# Map: EXTENTS runs of 64 KiB spread evenly over the volume (default 4096, one every 256 MiB),
# written by qemu-io to the mdkit export and to the sparse file alike. The script fails if the
# two maps differ.
# Every measurement runs REPS times per side, the order of the sides rotating; it prints every
# time, the medians, the ratio mdkit/reference (below 1: mdkit is faster) and the A/A ratio.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
ensure_packages python3 thin-provisioning-tools libnbd-bin nbdkit qemu-utils

if [[ -n ${SMALL:-} ]]; then
    BLOCKS=${BLOCKS:-20000} SIZE=${SIZE:-16GiB} EXTENTS=${EXTENTS:-64} REPS=${REPS:-2}
fi
BLOCKS=${BLOCKS:-1048576}
SIZE=${SIZE:-1TiB}
EXTENTS=${EXTENTS:-4096}
REPS=${REPS:-5}
WORKDIR=${WORKDIR:-/var/tmp/mdkit-bench-thin-delta}
if [[ -z ${MDKIT:-} ]]; then
    ensure_rust
    cargo build --release -p mdkit --bin mdkit >&2
    MDKIT=target/release/mdkit
fi
MDKIT=$(realpath "$MDKIT")

rm -rf "$WORKDIR"
mkdir -p "$WORKDIR"
pids=()
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true' EXIT

now() { echo "$EPOCHREALTIME"; }
declare -A times

# timed SIDE CMD...: runs CMD, appends its wall time to times[SIDE].
timed() {
    local side=$1 t0
    shift
    t0=$(now)
    "$@"
    times[$side]+="$t0:$(now) "
}

# rounds A B C: REPS rounds of the three functions, the order rotating each round.
rounds() {
    local i order
    for ((i = 0; i < REPS; i++)); do
        case $((i % 3)) in
            0) order=("$1" "$2" "$3") ;;
            1) order=("$2" "$3" "$1") ;;
            2) order=("$3" "$1" "$2") ;;
        esac
        for f in "${order[@]}"; do "$f"; done
    done
}

# report TITLE OURS REF CTL: times, medians, ratio and the A/A control.
report() {
    python3 - "$1" "${times[$2]}" "${times[$3]}" "${times[$4]}" "$2" "$3" <<'PY'
import statistics, sys
title, ours, ref, ctl, on, rn = sys.argv[1:7]
def spans(arg):
    return [float(b) - float(a) for a, b in (x.split(":") for x in arg.split())]
o, r, c = spans(ours), spans(ref), spans(ctl)
print(title)
for name, xs in ((on, o), (rn, r), (rn + " (A/A)", c)):
    print(f"  {name:<22} s: " + " ".join(f"{x:.3f}" for x in xs))
mo, mr, mc = statistics.median(o), statistics.median(r), statistics.median(c)
print(f"  median {on} {mo:.3f} s, {rn} {mr:.3f} s: ratio {mo / mr:.2f}; A/A control {mc / mr:.2f}")
PY
}

#--- 1. thin delta ------------------------------------------------------------------------------
xml=$WORKDIR/pool.xml
meta=$WORKDIR/pool.meta
log "generating $BLOCKS mapped blocks per device in $xml"
python3 - "$BLOCKS" >"$xml" <<'PY'
import sys
n = int(sys.argv[1])
extra = max(1, n // 100)
nr_data = n + n // 100 + extra + 16
print(f'<superblock uuid="" time="1" transaction="1" flags="0" version="2" data_block_size="128" nr_data_blocks="{nr_data}">')
# Origin: snapshotted at time 1, every block written at time 0.
print(f'  <device dev_id="1" mapped_blocks="{n}" transaction="0" creation_time="0" snap_time="1">')
print(f'    <range_mapping origin_begin="0" data_begin="0" length="{n}" time="0"/>')
print('  </device>')
rewritten = range(0, n, 100)
print(f'  <device dev_id="2" mapped_blocks="{n + extra}" transaction="0" creation_time="1" snap_time="1">')
nxt = n
prev = 0
for v in rewritten:
    if v > prev:
        print(f'    <range_mapping origin_begin="{prev}" data_begin="{prev}" length="{v - prev}" time="0"/>')
    print(f'    <single_mapping origin_block="{v}" data_block="{nxt}" time="1"/>')
    nxt += 1
    prev = v + 1
if n > prev:
    print(f'    <range_mapping origin_begin="{prev}" data_begin="{prev}" length="{n - prev}" time="0"/>')
print(f'    <range_mapping origin_begin="{n}" data_begin="{nxt}" length="{extra}" time="1"/>')
print('  </device>')
print('</superblock>')
PY
meta_mib=$((BLOCKS / 20000 + 16))
truncate -s "${meta_mib}M" "$meta"
log "thin_restore into a ${meta_mib} MiB metadata file"
thin_restore -i "$xml" -o "$meta" >&2

delta_ours() { timed "mdkit thin delta" "$MDKIT" thin delta --metadata "$meta" 1 2 >"$WORKDIR/ours.xml"; }
delta_ref() { timed thin_delta thin_delta --snap1 1 --snap2 2 "$meta" >"$WORKDIR/tool.xml"; }
delta_ctl() { timed ctl-delta thin_delta --snap1 1 --snap2 2 "$meta" >"$WORKDIR/ctl.xml"; }
rounds delta_ours delta_ref delta_ctl
cmp "$WORKDIR/ours.xml" "$WORKDIR/tool.xml" || { log "outputs differ: $WORKDIR/ours.xml $WORKDIR/tool.xml"; exit 1; }
report "thin delta: $BLOCKS mapped blocks per device, $(grep -c '<different' "$WORKDIR/ours.xml") different and \
$(grep -c '<right_only' "$WORKDIR/ours.xml") right_only runs (outputs identical)" "mdkit thin delta" thin_delta ctl-delta

#--- 2. block-status map ------------------------------------------------------------------------
data_mib=$((EXTENTS / 16 + 64))
cat >"$WORKDIR/mdkit.toml" <<TOML
data_dir = "$WORKDIR"
[nbd]
listen = ["unix:$WORKDIR/nbd.sock"]
[[volume]]
name = "pool"
kind = "thin-pool"
metadata = "map.meta"
metadata_size = "64MiB"
data = "map.data"
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
pids+=($!)
ours_uri="nbd+unix:///sparse?socket=$WORKDIR/nbd.sock"
for _ in $(seq 300); do nbdinfo --size "$ours_uri" >/dev/null 2>&1 && break; sleep 0.1; done
size_bytes=$(nbdinfo --size "$ours_uri")
ref_img=$WORKDIR/ref.img
truncate -s "$size_bytes" "$ref_img"

step=$((size_bytes / EXTENTS / 65536 * 65536))
cmds=()
for ((i = 0; i < EXTENTS; i++)); do cmds+=(-c "write -q -P 0x5a $((i * step)) 64k"); done
log "writing $EXTENTS runs of 64 KiB, one every $((step >> 20)) MiB, to mdkit and to $ref_img"
qemu-io -f raw "${cmds[@]}" "$ours_uri" >/dev/null
qemu-io -f raw "${cmds[@]}" "$ref_img" >/dev/null
sync "$ref_img"
nbdkit -f --unix "$WORKDIR/ref.sock" file "$ref_img" 2>"$WORKDIR/nbdkit.log" &
pids+=($!)
ref_uri="nbd+unix:///?socket=$WORKDIR/ref.sock"
for _ in $(seq 300); do nbdinfo --size "$ref_uri" >/dev/null 2>&1 && break; sleep 0.1; done

map_ours() { timed "mdkit map" nbdinfo --map "$ours_uri" >"$WORKDIR/ours.map"; }
map_ref() { timed "nbdkit file map" nbdinfo --map "$ref_uri" >"$WORKDIR/ref.map"; }
map_ctl() { timed ctl-map nbdinfo --map "$ref_uri" >"$WORKDIR/ctl.map"; }
rounds map_ours map_ref map_ctl
cmp "$WORKDIR/ours.map" "$WORKDIR/ref.map" || { log "maps differ: $WORKDIR/ours.map $WORKDIR/ref.map"; exit 1; }
report "block-status map: $SIZE thin volume ($size_bytes bytes), $EXTENTS runs of 64 KiB, \
$(wc -l <"$WORKDIR/ours.map") map rows (identical)" "mdkit map" "nbdkit file map" ctl-map
echo "# $(nproc) cores; REPS=$REPS; $(date -u +%FT%TZ)"
