#!/usr/bin/env bash
# NBD front-end benchmark: mdkit serve vs nbdkit's file plugin vs the raw file, same file,
# same fio jobs, one run. Not part of the test suite.
#
#   bench/nbd.sh                    # defaults below; prints a table with ratios
#   RUNTIME_S=20 SIZE=4G WORKDIR=/srv/bench bench/nbd.sh
#   REPS=5 WORKLOADS="randwrite 4k 1;randread 4k 1" bench/nbd.sh   # chosen cases, median of 5
#   IDLE_POLL_US=0 bench/nbd.sh     # mdkit's data-path threads sleep at once (nbd.idle_poll_us)
#
# Two mdkit rows over the same file: `mdkit` answers a write when the member finished it
# (write-through, the default); `mdkit(wb)` is the volume with `write_back = true`, which answers
# a plain write once it is queued on the member — the contract nbdkit's file plugin has (its
# pwrite lands in the page cache; cache=none only starts writeback with sync_file_range).
#
# Fairness:
# - One file on a real filesystem (not tmpfs), fully written once (no unwritten extents, no
#   holes) and shared by all three targets.
# - Identical fio job parameters for every target (bs, iodepth, rw, runtime, ramp, size,
#   norandommap); fio's nbd engine (libnbd, one connection per job) for both servers, both
#   over TCP loopback with TCP_NODELAY. Raw = fio io_uring O_DIRECT on the file: the ceiling.
# - mdkit: release build, `kind = "file"` volume with direct = "require" (O_DIRECT, io_uring).
# - nbdkit: `nbdkit --threads 16 file FILE cache=none` (its recommended setting to keep the
#   page cache out; the file plugin is otherwise buffered). Page-cache state is reset before
#   every run (drop_caches) so no target reads another's cached data. A second nbdkit row
#   with the default cache (page cache, warmed by its own ramp) is printed for reference.
# - Protocol path only: mdkit's `mem` volume vs `nbdkit memory`, same jobs, in a second table:
#   the servers' own cost per request with no device behind them.
# - Runs are interleaved (raw, mdkit, nbdkit per workload, REPS rounds with the order rotating
#   each round) so machine noise hits all alike; the table shows the median of the rounds.
# - A/A control: a second, identical `mdkit serve` (same config, own port and data_dir, same
#   file and an own `mem` volume) is run interleaved like the others. Its ratio to the first
#   (column `A/A`, mdkit/mdkit) is what this run resolves: a side-by-side ratio closer to 1 than
#   the A/A ratio's distance from 1 is noise, not a difference.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
ensure_packages python3
ensure_rust

RUNTIME_S=${RUNTIME_S:-10}
RAMP_S=${RAMP_S:-2}
SIZE=${SIZE:-2G}
WORKDIR=${WORKDIR:-/var/tmp/mdkit-bench-nbd}
MDKIT_PORT=${MDKIT_PORT:-10871}
NBDKIT_PORT=${NBDKIT_PORT:-10872}
NBDKIT_CACHED_PORT=${NBDKIT_CACHED_PORT:-10873}
MDKIT_BUFFERED_PORT=${MDKIT_BUFFERED_PORT:-10874}
NBDKIT_MEM_PORT=${NBDKIT_MEM_PORT:-10875}
MDKIT_WB_PORT=${MDKIT_WB_PORT:-10876}
MDKIT_AA_PORT=${MDKIT_AA_PORT:-10877}
NBDKIT_THREADS=${NBDKIT_THREADS:-16}
REPS=${REPS:-1}
IDLE_POLL_US=${IDLE_POLL_US:-100}
WORKLOADS=${WORKLOADS:-randread 4k 1;randread 4k 32;randwrite 4k 1;randwrite 4k 32;write 1m 8}

bench_mdkit_and_file "$WORKDIR" "$SIZE"

trap kill_pids EXIT

bench_file_config "$WORKDIR/mdkit.toml" "$WORKDIR/mdkit" "$MDKIT_PORT" "$IDLE_POLL_US" "$FILE"
# The same service with a buffered member (page cache, like nbdkit's file plugin): reference
# row that separates the protocol path from the cost of waiting for the device.
sed -e "s/$MDKIT_PORT/$MDKIT_BUFFERED_PORT/" -e 's/direct = "require"/direct = "off"/' \
    -e "s|^data_dir = .*|data_dir = \"$WORKDIR/mdkit-buffered\"|" "$WORKDIR/mdkit.toml" > "$WORKDIR/mdkit-buffered.toml"
# The same service with the write-back window on.
sed -e "s/$MDKIT_PORT/$MDKIT_WB_PORT/" -e 's/direct = "require"/direct = "require"\nwrite_back = true/' \
    -e "s|^data_dir = .*|data_dir = \"$WORKDIR/mdkit-wb\"|" "$WORKDIR/mdkit.toml" > "$WORKDIR/mdkit-wb.toml"
cat >> "$WORKDIR/mdkit.toml" <<TOML
[[volume]]
name = "mem"
kind = "mem"
size = "$SIZE"
[[export]]
name = "mem"
volume = "mem"
TOML
# The A/A control: the same service (file and mem volume) a second time.
sed -e "s/$MDKIT_PORT/$MDKIT_AA_PORT/" -e "s|^data_dir = .*|data_dir = \"$WORKDIR/mdkit-aa\"|" \
    "$WORKDIR/mdkit.toml" > "$WORKDIR/mdkit-aa.toml"
"$MDKIT" serve --config "$WORKDIR/mdkit.toml" 2>"$WORKDIR/mdkit.log" &
pids+=($!)
"$MDKIT" serve --config "$WORKDIR/mdkit-buffered.toml" 2>"$WORKDIR/mdkit-buffered.log" &
pids+=($!)
"$MDKIT" serve --config "$WORKDIR/mdkit-wb.toml" 2>"$WORKDIR/mdkit-wb.log" &
pids+=($!)
"$MDKIT" serve --config "$WORKDIR/mdkit-aa.toml" 2>"$WORKDIR/mdkit-aa.log" &
pids+=($!)
nbdkit -f -p "$NBDKIT_PORT" --threads "$NBDKIT_THREADS" file "$FILE" cache=none 2>"$WORKDIR/nbdkit.log" &
pids+=($!)
nbdkit -f -p "$NBDKIT_CACHED_PORT" --threads "$NBDKIT_THREADS" file "$FILE" 2>"$WORKDIR/nbdkit-cached.log" &
pids+=($!)
nbdkit -f -p "$NBDKIT_MEM_PORT" --threads "$NBDKIT_THREADS" memory "$SIZE" 2>"$WORKDIR/nbdkit-mem.log" &
pids+=($!)
for uri in "$MDKIT_PORT/bench" "$MDKIT_PORT/mem" "$MDKIT_BUFFERED_PORT/bench" "$MDKIT_WB_PORT/bench" "$NBDKIT_PORT/" \
    "$NBDKIT_CACHED_PORT/" "$NBDKIT_MEM_PORT/" "$MDKIT_AA_PORT/bench" "$MDKIT_AA_PORT/mem"; do
    wait_export "nbd://127.0.0.1:$uri"
done

drop_caches() { sync; [ -w /proc/sys/vm/drop_caches ] && echo 3 > /proc/sys/vm/drop_caches || true; }

# run_fio NAME TARGET RW BS QD -> JSON file path
run_fio() {
    local name=$1 target=$2 rw=$3 bs=$4 qd=$5 out="$WORKDIR/$1.json" eng
    case $target in
        raw) eng=(--ioengine=io_uring --direct=1 "--filename=$FILE") ;;
        mdkit) eng=(--ioengine=nbd "--uri=nbd://127.0.0.1:$MDKIT_PORT/bench") ;;
        mdkit-wb) eng=(--ioengine=nbd "--uri=nbd://127.0.0.1:$MDKIT_WB_PORT/bench") ;;
        mdkit-aa) eng=(--ioengine=nbd "--uri=nbd://127.0.0.1:$MDKIT_AA_PORT/bench") ;;
        mdkit-buffered) eng=(--ioengine=nbd "--uri=nbd://127.0.0.1:$MDKIT_BUFFERED_PORT/bench") ;;
        nbdkit) eng=(--ioengine=nbd "--uri=nbd://127.0.0.1:$NBDKIT_PORT/") ;;
        nbdkit-cached) eng=(--ioengine=nbd "--uri=nbd://127.0.0.1:$NBDKIT_CACHED_PORT/") ;;
        mdkit-mem) eng=(--ioengine=nbd "--uri=nbd://127.0.0.1:$MDKIT_PORT/mem") ;;
        nbdkit-mem) eng=(--ioengine=nbd "--uri=nbd://127.0.0.1:$NBDKIT_MEM_PORT/") ;;
        mdkit-mem-aa) eng=(--ioengine=nbd "--uri=nbd://127.0.0.1:$MDKIT_AA_PORT/mem") ;;
    esac
    case $target in raw|mdkit|mdkit-wb|mdkit-aa|nbdkit) drop_caches ;; esac
    fio --name="$name" "${eng[@]}" --rw="$rw" --bs="$bs" --iodepth="$qd" --size="$SIZE" \
        --runtime="$RUNTIME_S" --ramp_time="$RAMP_S" --time_based --norandommap --randrepeat=0 \
        --output-format=json --output="$out" >/dev/null 2>&1
    echo "$out"
}

IFS=';' read -r -a workloads <<< "$WORKLOADS"
TARGETS=(raw mdkit mdkit-wb nbdkit mdkit-aa mdkit-buffered nbdkit-cached mdkit-mem nbdkit-mem mdkit-mem-aa)
results=$WORKDIR/results.txt
: > "$results"
for w in "${workloads[@]}"; do
    set -- $w
    for rep in $(seq 0 $((REPS - 1))); do
        n=${#TARGETS[@]}
        for i in $(seq 0 $((n - 1))); do
            t=${TARGETS[$(((i + rep) % n))]}
            log "$t: $1 bs=$2 qd=$3 (round $((rep + 1))/$REPS)"
            f=$(run_fio "$t-$1-$2-qd$3-r$rep" "$t" "$1" "$2" "$3")
            echo "$1 $2 $3 $t $f" >> "$results"
        done
    done
done

python3 - "$results" "$RUNTIME_S" "$NBDKIT_THREADS" "$IDLE_POLL_US" <<'PY'
import json, statistics, sys
runs = {}
for line in open(sys.argv[1]):
    rw, bs, qd, target, path = line.split()
    j = json.load(open(path))["jobs"][0]
    d = j["write"] if "write" in rw else j["read"]
    runs.setdefault((rw, bs, qd), {}).setdefault(target, []).append((d["iops"], d["bw_bytes"] / 1e6))
def ratio(r, a, b, k):
    """Median of `a` over median of `b` (IOPS, or MB/s when k = 1); nan when either is missing."""
    return r[a][k] / r[b][k] if a in r and b in r and r[b][k] else float("nan")
rows = {w: {t: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)) for t, v in r.items()}
        for w, r in runs.items()}
reps = max(len(v) for r in runs.values() for v in r.values())
print(f"\nfio {sys.argv[2]} s per run, median of {reps} round(s), 1 job (1 NBD connection), TCP loopback; nbdkit --threads {sys.argv[3]}; mdkit nbd.idle_poll_us = {sys.argv[4]}")
hdr = f"{'workload':<20}{'raw':>15}{'mdkit':>15}{'nbdkit':>15}{'mdkit/nbdkit':>13}{'mdkit/raw':>10}{'A/A':>7} |{'mdkit(wb)':>15}{'wb/nbdkit':>10} |{'mdkit(buf)':>15}{'nbdkit(cache)':>15}"
print(hdr)
print("-" * len(hdr))
for (rw, bs, qd), r in rows.items():
    big = bs.endswith("m")
    def cell(t):
        if t not in r: return f"{'-':>15}"
        iops, mbs = r[t]
        return f"{mbs:>10.0f} MB/s" if big else f"{iops:>10.0f} IOPS"
    name = f"{rw} {bs} QD{qd}"
    k = 1 if big else 0
    ratio_n, ratio_r = ratio(r, "mdkit", "nbdkit", k), ratio(r, "mdkit", "raw", k)
    ratio_aa, ratio_wb = ratio(r, "mdkit", "mdkit-aa", k), ratio(r, "mdkit-wb", "nbdkit", k)
    print(f"{name:<20}{cell('raw')}{cell('mdkit')}{cell('nbdkit')}{ratio_n:>12.2f}x{ratio_r:>9.2f}x{ratio_aa:>6.2f}x |{cell('mdkit-wb')}{ratio_wb:>9.2f}x |{cell('mdkit-buffered')}{cell('nbdkit-cached')}")
print("\nProtocol path only (no device behind either server): mdkit `mem` volume vs `nbdkit memory`")
hdr2 = f"{'workload':<20}{'mdkit(mem)':>15}{'nbdkit(mem)':>15}{'mdkit/nbdkit':>13}{'A/A':>7}"
print(hdr2)
print("-" * len(hdr2))
for (rw, bs, qd), r in rows.items():
    if "mdkit-mem" not in r or "nbdkit-mem" not in r: continue
    big = bs.endswith("m")
    k = 1 if big else 0
    def cell2(t):
        iops, mbs = r[t]
        return f"{mbs:>10.0f} MB/s" if big else f"{iops:>10.0f} IOPS"
    ratio_n, ratio_aa = ratio(r, "mdkit-mem", "nbdkit-mem", k), ratio(r, "mdkit-mem", "mdkit-mem-aa", k)
    print(f"{rw + ' ' + bs + ' QD' + qd:<20}{cell2('mdkit-mem')}{cell2('nbdkit-mem')}{ratio_n:>12.2f}x{ratio_aa:>6.2f}x")
print("\nmdkit = O_DIRECT member (io_uring), writes answered when the member finished them; mdkit(wb) =")
print("the same with write_back = true (plain writes answered once queued on the member, bounded window,")
print("durable at flush); nbdkit = file plugin cache=none; caches dropped before")
print("each raw/mdkit/mdkit(wb)/nbdkit run. Reference only (page cache, warmed during the run): mdkit(buf) =")
print("mdkit with direct = \"off\"; nbdkit(cache) = nbdkit file plugin default cache mode.")
print("A/A = mdkit over a second, identical mdkit service run interleaved with the others (the")
print("control: how far from 1.00x this run puts two identical servers).")
PY
