#!/usr/bin/env bash
# mdkit over NBD vs the raw file, in short alternating windows: for a device whose speed drifts
# faster than bench/nbd.sh's rounds (on the 2-vCPU VMs the raw file's 4 KiB QD32 rate moved
# between 32k and 84k IOPS in consecutive 5 s windows), a ratio is only as good as the raw
# measurement next to it. Not part of the test suite.
#
#   bench/nbd-pairs.sh                              # 4 KiB random reads, QD32, one connection
#   CYCLES=30 WINDOW_S=3 RW=randread BS=4k QD=32 bench/nbd-pairs.sh
#
# Method: windows run back to back as  raw T1 raw T2 raw T3 raw T1 ...  where the targets
# rotate through
#   mdkit   `mdkit serve`, a file volume (O_DIRECT, io_uring) on the file, fio's nbd engine
#   aa      a second, identical `mdkit serve` on the same file (the A/A control of the server)
#   raw'    the raw file again (the A/A control of the method: raw judged against raw)
# Each target window is divided by the geometric mean of the raw windows right before and
# after it, and each target's ratios are summarised by their median (and quartiles). raw' shows
# how far the method puts the raw file from itself; aa/mdkit how far it puts two identical
# servers. Raw = fio io_uring O_DIRECT on the file: the ceiling.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
ensure_packages python3
ensure_rust

CYCLES=${CYCLES:-20}
WINDOW_S=${WINDOW_S:-3}
RAMP_S=${RAMP_S:-1}
RW=${RW:-randread}
BS=${BS:-4k}
QD=${QD:-32}
SIZE=${SIZE:-2G}
WORKDIR=${WORKDIR:-/var/tmp/mdkit-bench-nbd}
PORT=${PORT:-10881}
AA_PORT=${AA_PORT:-10882}
IDLE_POLL_US=${IDLE_POLL_US:-100}

bench_mdkit_and_file "$WORKDIR" "$SIZE"

trap kill_pids EXIT

for port in "$PORT" "$AA_PORT"; do
    bench_file_config "$WORKDIR/pairs-$port.toml" "$WORKDIR/pairs-$port" "$port" "$IDLE_POLL_US" "$FILE"
    "$MDKIT" serve --config "$WORKDIR/pairs-$port.toml" 2>"$WORKDIR/pairs-$port.log" &
    pids+=($!)
    wait_export "nbd://127.0.0.1:$port/bench"
done

# window TARGET INDEX -> appends "INDEX TARGET IOPS MB/s" to the results
results=$WORKDIR/pairs.txt
: > "$results"
window() {
    local target=$1 i=$2 out="$WORKDIR/pairs-$2.json" eng
    case $target in
        raw|raw2) eng=(--ioengine=io_uring --direct=1 "--filename=$FILE") ;;
        mdkit) eng=(--ioengine=nbd "--uri=nbd://127.0.0.1:$PORT/bench") ;;
        aa) eng=(--ioengine=nbd "--uri=nbd://127.0.0.1:$AA_PORT/bench") ;;
    esac
    fio --name="w$i" "${eng[@]}" --rw="$RW" --bs="$BS" --iodepth="$QD" --size="$SIZE" \
        --runtime="$WINDOW_S" --ramp_time="$RAMP_S" --time_based --norandommap --randrepeat=0 \
        --output-format=json --output="$out" >/dev/null 2>&1
    python3 - "$out" "$i" "$target" "$RW" >> "$results" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))["jobs"][0]
d = j["write"] if "write" in sys.argv[4] else j["read"]
print(sys.argv[2], sys.argv[3], d["iops"], d["bw_bytes"] / 1e6)
PY
}

targets=(mdkit aa raw2)
i=0
window raw $i
for c in $(seq 0 $((CYCLES - 1))); do
    for t in "${targets[@]}"; do
        log "cycle $((c + 1))/$CYCLES: $t"
        i=$((i + 1)); window "$t" $i
        i=$((i + 1)); window raw $i
    done
done

python3 - "$results" "$CYCLES" "$WINDOW_S" "$RW $BS QD$QD" "$IDLE_POLL_US" <<'PY'
import math, statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
seq = [(t, float(iops)) for _, t, iops, _ in rows]
ratios = {}
raws = []
for k, (t, v) in enumerate(seq):
    if t == "raw":
        raws.append(v)
        continue
    before, after = seq[k - 1][1], seq[k + 1][1]
    ratios.setdefault(t, []).append(v / math.sqrt(before * after))
def q(xs):
    s = sorted(xs)
    return statistics.median(s), s[len(s) // 4], s[(3 * len(s)) // 4]
print(f"\n{sys.argv[4]}, one connection; {sys.argv[2]} cycles of {sys.argv[3]} s windows; "
      f"raw {min(raws):.0f}-{max(raws):.0f} IOPS (median {statistics.median(raws):.0f}); mdkit nbd.idle_poll_us = {sys.argv[5]}")
print(f"{'target':<28}{'median':>8}{'q1':>8}{'q3':>8}  (target IOPS / geometric mean of the raw windows beside it)")
names = {"mdkit": "mdkit / raw", "aa": "mdkit (2nd server) / raw", "raw2": "raw / raw (method A/A)"}
for t in ("mdkit", "aa", "raw2"):
    m, lo, hi = q(ratios[t])
    print(f"{names[t]:<28}{m:>8.2f}{lo:>8.2f}{hi:>8.2f}")
m1, m2 = statistics.median(ratios["mdkit"]), statistics.median(ratios["aa"])
print(f"server A/A (2nd / 1st): {m2 / m1:.2f}; target for 4 KiB QD32 reads: mdkit / raw >= 0.90")
PY
