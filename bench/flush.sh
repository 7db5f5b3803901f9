#!/usr/bin/env bash
# Flush batching: a raid1 array (2 members) with 32 and 128 concurrent clients, each looping
# on a 4 KiB write then a flush of the array, flush_batching on vs off; then the same at
# component level (FlushBatcher over the member files directly), with the files' own flush and
# with a modelled slow device flush.
#
#   bench/flush.sh [DIR] [SECS] [REPEAT]
#
# 32 and 128 concurrent clients, each looping on a 4 KiB write to every member (2 members) and a
# flush request, with batching on and off (one member-flush round per request), on the same
# member files (DIR, default /var/tmp), alternating, REPEAT runs (default 2) of SECS seconds
# (default 5). Twice: with the files' own flush (fdatasync through io_uring; cheap on a VM disk
# with a host cache) and with a modelled device flush of FLUSH_US microseconds (default 1000,
# serviced one at a time, as a disk cache flush is). Prints member flushes per client flush
# (target <= 1/8) and client flushes per second batched vs unbatched (target >= 3x).
set -euo pipefail

dir=${1:-/var/tmp}
secs=${2:-5}
repeat=${3:-2}
data_mib=256
root=$(cd "$(dirname "$0")/.." && pwd)
command -v python3 >/dev/null || { echo "flush.sh: python3 not found" >&2; exit 1; }

# MDKIT_BENCH_NO_BUILD=1 reuses an existing build (e.g. while the tree does not build).
if [ "${MDKIT_BENCH_NO_BUILD:-0}" != 1 ]; then
    cargo build --quiet --release --manifest-path "$root/Cargo.toml" -p mdkit-md --example bitmap_bench
fi
bench="$root/target/release/examples/bitmap_bench"

files=()
for i in 0 1; do  # the array runs use members 0 and 1 too
    f="$dir/bitmap-bench-m$i.img"
    files+=("$f")
    if [ ! -f "$f" ] || [ "$(stat -c %s "$f")" -lt $(((data_mib + 1) << 20)) ]; then
        echo "# preparing $f" >&2
        dd if=/dev/zero of="$f" bs=1M count=$((data_mib + 1)) oflag=direct conv=fsync status=none
    fi
done
trap 'rm -f "${files[@]}"' EXIT

results=$(mktemp)
echo "# $(date -u +%FT%TZ) $(nproc) cores; other builds may share this machine; ${secs}s x ${repeat} per mode" >&2
for clients in 32 128; do
    for r in $(seq "$repeat"); do
        for b in off on; do
            line=$("$bench" array-flush --dir "$dir" --level raid1 --members 2 --batching $b --clients $clients \
                --secs "$secs")
            echo "array=raid1 flush_latency_us=0 $line" | tee -a "$results" >&2
        done
    done
done
for lat in 0 "${FLUSH_US:-1000}"; do
    for clients in 32 128; do
        for r in $(seq "$repeat"); do
            for b in off on; do
                line=$("$bench" flush --dir "$dir" --batching $b --clients $clients --members 2 --data-mib $data_mib \
                    --secs "$secs" --flush-latency-us "$lat")
                echo "$line" | tee -a "$results" >&2
            done
        done
    done
done

python3 - "$results" <<'PY'
import sys, statistics, collections
rows = [dict(kv.split("=", 1) for kv in line.split()) for line in open(sys.argv[1]) if line.strip()]
groups = collections.OrderedDict()
for r in rows:
    groups.setdefault((r.get("array", "component"), r["flush_latency_us"], r["clients"]), []).append(r)
print(f"{'':10} {'member flush':>14} {'clients':>7} {'unbatched flush/s':>17} {'batched flush/s':>15} {'speedup':>8} {'target':>6} {'member flushes/client flush':>27} {'target':>7}")
for (what_, lat, clients), rs in groups.items():
    med = lambda b, k: statistics.median(float(r[k]) for r in rs if r["batching"] == b)
    off, on = med("off", "client_flushes_per_s"), med("on", "client_flushes_per_s")
    per = med("on", "member_flushes_per_client_flush") / 2  # per member
    what = "file fdatasync" if lat == "0" else f"model {lat} us"
    print(f"{what_:10} {what:>14} {clients:>7} {off:>17.0f} {on:>15.0f} {on/off if off else 0:>7.1f}x {'>=3x':>6} {per:>27.4f} {'<=0.125':>7}")
print("(member flushes per client flush counted per member; unbatched = 1 per member)")
PY
