#!/usr/bin/env bash
# raid5/raid6 write benchmark: stripe_size 4 KiB, 64 KiB and the default, against the raw member
# files, same files, one run, in process (crates/mdkit-md/examples/raid5_bench.rs: the Array on
# io_uring O_DIRECT file members, a tracer under every member). Not part of the test suite.
#
#   bench/raid5.sh                                # raid5 on 4 members, raid6 on 6; 1 GiB each
#   MEMBER_MIB=4096 SECS=10 WORKDIR=/srv/bench bench/raid5.sh
#
# Per level: the raw files (1 MiB sequential writes to every member at once, RAW_QD per file),
# then the array (created --assume-clean, chunk 512 KiB, no bitmap) for each stripe_size:
#   rand4k  4 KiB random writes, QD 32 (RMW/RCW: each write reads and writes one stripe unit)
#   seq1m   1 MiB sequential writes, SEQ_QD in flight (full stripes: no member reads)
# Targets (issue 6): at the default stripe_size, rand4k >= 6x the 64 KiB result, and seq1m >= 90%
# of (n - parity)/n of the raw aggregate. Member reads/writes per client write come from the
# trace (full-stripe writes read nothing).
# Disk ceiling for the rand4k ratio: a 4 KiB random write costs the same number of member I/Os
# at both stripe sizes (RCW or RMW: reads and writes of one stripe unit each), so how far the
# ratio can go is set by the members' 4 KiB mixed random IOPS. The script measures the members'
# own 50/50 random read/write rate on the same files (fio io_uring O_DIRECT, CEIL_QD in flight
# over all members, 4 KiB and 64 KiB), prints how much of it each setting uses, and the ratio
# the default would reach with the members at their 4 KiB ceiling.
# A/A control: the raw sequential pass and the 4 KiB ceiling run again after the arrays; the
# ratios use the mean of the two passes and the table prints after / before (how far the device
# drifted during the level).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
ensure_packages python3 fio
ensure_rust

MEMBER_MIB=${MEMBER_MIB:-1024}
SECS=${SECS:-5}
QD=${QD:-32}
SEQ_QD=${SEQ_QD:-8}
RAW_QD=${RAW_QD:-4}
CEIL_QD=${CEIL_QD:-64}
WORKDIR=${WORKDIR:-/var/tmp/mdkit-bench-raid5}
LEVELS=${LEVELS:-"5:4 6:6"}

bench_workdir "$WORKDIR"

cargo build --release -p mdkit-md --example raid5_bench >&2
BENCH=target/release/examples/raid5_bench

max_members=0
for lm in $LEVELS; do n=${lm#*:}; [ "$n" -gt "$max_members" ] && max_members=$n; done
for i in $(seq 0 $((max_members - 1))); do
    written_file "$WORKDIR/raid5-bench-m$i.img" "$MEMBER_MIB"
done

# ceiling N BS -> "iops=..." of 50/50 random read/write over the first N member files
ceiling() {
    local files
    files=$(for i in $(seq 0 $(($1 - 1))); do printf '%s:' "$WORKDIR/raid5-bench-m$i.img"; done)
    fio --name=ceiling --ioengine=io_uring --direct=1 --rw=randrw --rwmixread=50 --bs="$2" \
        --iodepth=$((CEIL_QD / 2)) --numjobs=2 --group_reporting --filename="${files%:}" \
        --size=$((MEMBER_MIB * $1))M --runtime="$SECS" --time_based --norandommap --randrepeat=0 \
        --output-format=json --output="$WORKDIR/ceiling.json" >/dev/null 2>&1
    python3 -c 'import json,sys; j=json.load(open(sys.argv[1]))["jobs"][0]; print("iops=%.0f" % (j["read"]["iops"] + j["write"]["iops"]))' "$WORKDIR/ceiling.json"
}

out=$WORKDIR/results.txt
: > "$out"
for lm in $LEVELS; do
    level=${lm%:*}; n=${lm#*:}
    log "raid$level on $n members: raw files"
    echo "$($BENCH raw --dir "$WORKDIR" --members "$n" --qd "$RAW_QD" --secs "$SECS" --member-mib "$MEMBER_MIB") level=raid$level" >> "$out"
    log "raid$level on $n members: disk ceiling, random read/write 4 KiB and 64 KiB"
    echo "mode=ceiling level=raid$level bs=4096 $(ceiling "$n" 4k)" >> "$out"
    echo "mode=ceiling level=raid$level bs=65536 $(ceiling "$n" 64k)" >> "$out"
    for ss in 4096 65536 default; do
        for wl in rand4k seq1m; do
            if [ $wl = rand4k ]; then q=$QD; else q=$SEQ_QD; fi
            log "raid$level on $n members: $wl stripe_size=$ss QD$q"
            line=$($BENCH array --dir "$WORKDIR" --level "$level" --members "$n" --workload $wl --stripe-size $ss \
                --qd "$q" --secs "$SECS" --member-mib "$MEMBER_MIB")
            echo "$line requested=$ss" >> "$out"
        done
    done
    # The A/A controls: the raw pass and the 4 KiB ceiling again after the arrays; the tables use
    # the mean of both passes and print their ratio.
    log "raid$level on $n members: raw files and 4 KiB ceiling again (A/A)"
    echo "$($BENCH raw --dir "$WORKDIR" --members "$n" --qd "$RAW_QD" --secs "$SECS" --member-mib "$MEMBER_MIB") level=raid$level again=1" >> "$out"
    echo "mode=ceiling level=raid$level bs=4096 again=1 $(ceiling "$n" 4k)" >> "$out"
done

python3 - "$out" <<'PY'
import sys
rows = [dict(kv.split("=", 1) for kv in l.split()) for l in open(sys.argv[1]) if l.strip()]
print()
print("* = the default stripe_size")
print(f"{'level':<6} {'n':>2} {'workload':<8} {'stripe_size':>11} {'result':>14} {'rd/wr':>6} {'wr/wr':>6} {'cpu us':>7}  note")
for level in dict.fromkeys(r["level"] for r in rows):
    raws = [r for r in rows if r["mode"] == "raw" and r["level"] == level]
    raw = raws[0]
    arr = [r for r in rows if r["mode"] == "array" and r["level"] == level]
    n = int(raw["members"]); parity = 2 if level == "raid6" else 1
    raw_mbps = sum(float(r["mbps"]) for r in raws) / len(raws)
    raw_aa = f"; A/A {float(raws[1]['mbps']) / float(raws[0]['mbps']):.2f} (after / before)" if len(raws) > 1 else ""
    ideal = raw_mbps * (n - parity) / n
    print(f"{level:<6} {n:>2} {'raw seq':<8} {'-':>11} {raw_mbps:>9.0f} MB/s {'':>6} {'':>6} {'':>7}  {n} files x QD{raw['qd_per_file']}; (n-p)/n of it = {ideal:.0f} MB/s{raw_aa}")
    get = {}
    for r in arr:
        get[(r["workload"], r["requested"])] = r
        val = f"{float(r['iops']):>9.0f} IOPS" if r["workload"] == "rand4k" else f"{float(r['mbps']):>9.0f} MB/s"
        print(f"{level:<6} {n:>2} {r['workload']:<8} {(r['stripe_size'] + ('*' if r['requested'] == 'default' else '')):>11} {val} {float(r['member_reads_per_write']):>6.2f} {float(r['member_writes_per_write']):>6.2f} {float(r['cpu_us_per_write']):>7.1f}  "
              f"full={r['full_stripe_runs']} rmw={r['rmw_runs']} rcw={r['rcw_runs']} writes<4K={r['writes_below_4k']}")
    d = get[("rand4k", "default")]
    k64 = get[("rand4k", "65536")]
    ratio = float(d["iops"]) / float(k64["iops"])
    print(f"  -> rand4k default ({d['stripe_size']}) / 64 KiB = {ratio:.2f}x (target >= 6x; kernel e2368582: dbench on 4-SSD raid5,"
          f" 4 KiB vs 64 KiB stripe_size 1.22x the operations)")
    ceil = {r["bs"]: float(r["iops"]) for r in rows if r["mode"] == "ceiling" and r["level"] == level and "again" not in r}
    again = [float(r["iops"]) for r in rows if r["mode"] == "ceiling" and r["level"] == level and "again" in r]
    if again and "4096" in ceil:
        print(f"  -> 4 KiB ceiling before the arrays {ceil['4096']:.0f} IOPS, after {again[0]:.0f} (A/A {again[0] / ceil['4096']:.2f}); their mean is used")
        ceil["4096"] = (ceil["4096"] + again[0]) / 2
    if "4096" in ceil and "65536" in ceil:
        ios4 = float(d["member_reads_per_write"]) + float(d["member_writes_per_write"])
        ios64 = float(k64["member_reads_per_write"]) + float(k64["member_writes_per_write"])
        best4 = ceil["4096"] / ios4  # client writes/s with the members at their 4 KiB ceiling
        print(f"  -> disk ceiling (50/50 random read/write on the same files): {ceil['4096']:.0f} IOPS at 4 KiB, {ceil['65536']:.0f} at 64 KiB"
              f" (ratio {ceil['4096'] / ceil['65536']:.2f}x); mdkit uses {float(d['iops']) * ios4 / ceil['4096']:.0%} of the 4 KiB ceiling and"
              f" {float(k64['iops']) * ios64 / ceil['65536']:.0%} of the 64 KiB one. With the 4 KiB side at its ceiling ({best4:.0f} writes/s)"
              f" the ratio to this 64 KiB result would be {best4 / float(k64['iops']):.2f}x")
    s = get[("seq1m", "default")]
    frac = float(s["mbps"]) / ideal
    print(f"  -> seq1m default = {float(s['mbps']):.0f} MB/s = {frac:.0%} of (n-p)/n raw (target >= 90%), member reads per write {float(s['member_reads_per_write']):.2f}")
PY
