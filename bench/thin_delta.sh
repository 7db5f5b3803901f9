#!/usr/bin/env bash
# `mdkit thin delta` vs `thin_delta` on the same metadata, same run. Not part of the test suite.
#
#   bench/thin_delta.sh                              # 1,000,000 mapped blocks per device
#   BLOCKS=20000 REPS=3 bench/thin_delta.sh          # a quick check that it works
#   MDKIT=target/suite/mdkit BLOCKS=20000 bench/thin_delta.sh   # use that binary, no build
#
# The pool (64 KiB blocks) has an origin, device 1, with BLOCKS mapped blocks, and device 2, a
# snapshot of it in which every 100th block was rewritten (remapped: `different`) and BLOCKS/100
# blocks past the origin's end were written (`right_only`); the rest is `same`. The metadata is
# made by thin_restore from a generated XML, so neither side reads metadata it wrote itself.
# Each side runs REPS times, alternating; the script prints every time, the medians and the
# ratio mdkit/thin_delta (below 1: mdkit is faster), and fails if the two outputs differ.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
ensure_packages python3 thin-provisioning-tools

BLOCKS=${BLOCKS:-1000000}
REPS=${REPS:-5}
WORKDIR=${WORKDIR:-/var/tmp/mdkit-bench-thin-delta}
if [[ -z ${MDKIT:-} ]]; then
    ensure_rust
    cargo build --release -p mdkit --bin mdkit >&2
    MDKIT=target/release/mdkit
fi

mkdir -p "$WORKDIR"
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
meta_mib=$(( BLOCKS / 20000 + 16 ))
rm -f "$meta"
truncate -s "${meta_mib}M" "$meta"
log "thin_restore into a ${meta_mib} MiB metadata file"
thin_restore -i "$xml" -o "$meta" >&2

now() { echo "$EPOCHREALTIME"; }
ours_t=()
tool_t=()
for ((i = 0; i < REPS; i++)); do
    for side in ours tool; do
        # Alternate which side runs first.
        if (( i % 2 )); then side=$([[ $side == ours ]] && echo tool || echo ours); fi
        t0=$(now)
        if [[ $side == ours ]]; then
            "$MDKIT" thin delta --metadata "$meta" 1 2 >"$WORKDIR/ours.xml"
            ours_t+=("$t0:$(now)")
        else
            thin_delta --snap1 1 --snap2 2 "$meta" >"$WORKDIR/tool.xml"
            tool_t+=("$t0:$(now)")
        fi
    done
done
cmp "$WORKDIR/ours.xml" "$WORKDIR/tool.xml" || { log "outputs differ: $WORKDIR/ours.xml $WORKDIR/tool.xml"; exit 1; }

python3 - "$BLOCKS" "${ours_t[*]}" "${tool_t[*]}" <<'PY'
import statistics, sys
n = int(sys.argv[1])
def spans(arg):
    return [float(b) - float(a) for a, b in (x.split(":") for x in arg.split())]
ours = spans(sys.argv[2])
tool = spans(sys.argv[3])
print(f"mapped blocks per device: {n}")
print("mdkit thin delta s: " + " ".join(f"{x:.3f}" for x in ours))
print("thin_delta       s: " + " ".join(f"{x:.3f}" for x in tool))
mo, mt = statistics.median(ours), statistics.median(tool)
print(f"median mdkit {mo:.3f} s, thin_delta {mt:.3f} s, ratio mdkit/thin_delta {mo / mt:.2f}")
PY
