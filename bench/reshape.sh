#!/usr/bin/env bash
# Reshape throughput: mdkit restriping raid5 (or raid6) from N to N+1 members against the member
# files' own rate for a reshape's access pattern, same files, same run, in process
# (crates/mdkit-md/examples/reshape_bench.rs: the Array on io_uring O_DIRECT file members). Not
# part of the test suite.
#
#   bench/reshape.sh                                   # raid5 4 -> 5 members of 512 MiB
#   LEVEL=raid6 MEMBERS=5 MEMBER_MIB=1024 WORKDIR=/srv/bench bench/reshape.sh
#
# ceiling       the member files' rate with a reader and a writer streaming 1 MiB requests on
#               every file at once (bytes read + written per second): a reshape reads every old
#               member and writes every new one, so this is the most it can move
# reshape-a/-b  the restripe, idle, sync_speed limits raised, twice on new superblocks over the
#               same files: -b is the A/A control (its ratio to -a is the run's own spread)
# reshape-load  the restripe's rate during SECS of QD 4 KiB random reads on the array,
#               sync_speed_min at md's default (the reshape yields to requests as md's does),
#               and the reads' IOPS meanwhile, beside their idle IOPS
# "of ceiling" = member traffic per second / ceiling, where the member traffic is the least a
# restripe moves: the old data read once, written once with the new geometry's parity.
# Target (issue 17): reshape-a >= 80% of the ceiling.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
ensure_packages python3
ensure_rust

LEVEL=${LEVEL:-raid5}
MEMBERS=${MEMBERS:-4}
MEMBER_MIB=${MEMBER_MIB:-512}
CHUNK_KIB=${CHUNK_KIB:-64}
QD=${QD:-32}
SECS=${SECS:-4}
WORKDIR=${WORKDIR:-/var/tmp/mdkit-bench-reshape}

bench_workdir "$WORKDIR"

cargo build --release -p mdkit-md --example reshape_bench >&2
for i in $(seq 0 "$MEMBERS"); do
    written_file "$WORKDIR/reshape-bench-m$i.img" "$MEMBER_MIB"
done
out=$(target/release/examples/reshape_bench --dir "$WORKDIR" --level "$LEVEL" --members "$MEMBERS" \
      --member-mib "$MEMBER_MIB" --chunk-kib "$CHUNK_KIB" --qd "$QD" --secs "$SECS")
echo "$out" >&2

LEVEL=$LEVEL MEMBERS=$MEMBERS python3 - "$out" <<'PY'
import os, sys
rows = {}
for line in sys.argv[1].splitlines():
    if line.startswith("result "):
        kv = dict(w.split("=", 1) for w in line.split()[1:])
        rows[kv["test"]] = kv
ceil = float(rows["ceiling"]["mbps"])
n = int(os.environ["MEMBERS"])
print(f"{os.environ['LEVEL']} {n} -> {n + 1} members; member files' ceiling {ceil:.0f} MB/s (read + write)")
print(f"{'test':<13} {'array MB/s':>10} {'member MB/s':>11} {'of ceiling':>10} {'secs':>6} {'4K read IOPS':>12}")
for t in ["reshape-a", "reshape-b", "reshape-load"]:
    r = rows[t]
    share = float(r["member_mbps"]) / ceil
    iops = r["read_iops"] if t == "reshape-load" else "-"
    secs = f"{float(r['secs']):.1f}" if "secs" in r else "-"
    print(f"{t:<13} {float(r['array_mbps']):>10.0f} {float(r['member_mbps']):>11.0f} {share:>10.2f} {secs:>6} {iops:>12}")
a, b = float(rows["reshape-a"]["member_mbps"]), float(rows["reshape-b"]["member_mbps"])
print(f"A/A control: reshape-b / reshape-a = {b / a:.2f}")
idle = float(rows["rand-read-idle"]["iops"])
print(f"4 KiB random reads on the array: {idle:.0f} IOPS idle, {float(rows['reshape-load']['read_iops']):.0f} during the reshape")
print("target: reshape-a >= 0.80 of the ceiling (issue 17); upstream md: no published reshape rate in anchors-perf.md to set beside it")
PY
