#!/usr/bin/env bash
# Thin-volume benchmark: a fully provisioned thin volume vs a plain volume over a raw data file
# of the same size, same filesystem, same run — in process and over NBD. Not part of the test
# suite.
#
#   bench/thin.sh                       # 1 GiB data files; 61 pairs of 1 s runs in process,
#                                       # 41 pairs of 1 s runs over NBD (~15 min in all)
#   NBD_REPS=15 REPS=21 bench/thin.sh   # quicker, wider intervals
#   REPS=0 bench/thin.sh                # NBD only
#   SIZE_MIB=4096 RUNTIME_S=5 WORKDIR=/srv/bench bench/thin.sh
#
# Why many short pairs: this VM's disk drifts by 10-30% from one second to the next. With a
# few long pairs (5 s x 7) the median ratio moved between 0.93 and 1.03 from run to run; with
# many 1 s pairs a pair spans two seconds of drift, not ten, and the median of 40-60 of them
# is pinned to within about +-2% (each table prints the 95% bootstrap interval of its median).
#
# 1. In process (crates/mdkit-thin/examples/thin_bench.rs): the pool runtime's ThinVolume and
#    the plain FileDevice on one data file, same workload generator: 4 KiB random writes with
#    FUA on every write (the O_SYNC case), without FUA, 4 KiB random reads, QD 32; and the
#    first-write provisioning rate with and without zeroing of new blocks. REPS runs per side,
#    alternating (plain-thin, thin-plain, ...); the ratio is the median of the per-run ratios.
#    The load runs on two data-path threads as in `mdkit serve` (a current-thread runtime and an
#    io_uring per thread). For a profile of one side: thin_bench --workloads read --profile thin.
# 2. Over NBD: one `mdkit serve` exports `thin` (a thin volume of a pool whose data device is
#    thin-data.img, fully provisioned by writing it once before measuring) and `plain` (kind =
#    "file" over that same thin-data.img: the raw data device, so both sides hit the same file,
#    the same extents and the same host cache; plain's writes scribble over thin's data, which
#    the benchmark does not read back). fio's nbd engine, one connection, QD 32: randwrite, randwrite with
#    an NBD FLUSH after every write (fio --fsync=1: fio's nbd engine cannot send FUA, so this is
#    the O_SYNC case over NBD), randread. Each rep runs both sides, in alternating order
#    (plain-thin, thin-plain, ...) so drift of this disk does not favour one side; NBD_REPS
#    short pairs (one fio process per workload, the runs as stonewalled jobs back to back),
#    and the ratio reported is the median of the per-pair ratios (a host-disk stall in one run
#    moves one pair, not the result), with its 95% bootstrap interval.
# Target (issue 5): thin >= 97% of plain for each. The fast path (mapped, unshared blocks: no
# deferral, no metadata commit) is what makes that possible — dm-thin's lesson from upstream
# (anchors-perf.md: "dm thin: fast path for sync/FUA writes to provisioned blocks").
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
ensure_packages python3 fio libnbd-bin
ensure_rust

SIZE_MIB=${SIZE_MIB:-1024}
RUNTIME_S=${RUNTIME_S:-1}
RAMP_S=${RAMP_S:-250ms}
INPROC_S=${INPROC_S:-1}
REPS=${REPS:-61}
NBD_REPS=${NBD_REPS:-41}
PORT=${PORT:-10881}
WORKDIR=${WORKDIR:-/var/tmp/mdkit-bench-thin}

bench_workdir "$WORKDIR"

# Two builds: target flags such as --example select targets in every listed package, so one
# command with --example would leave the mdkit binary stale.
cargo build --release -p mdkit --bin mdkit >&2
cargo build --release -p mdkit-thin --example thin_bench >&2
MDKIT=$PWD/target/release/mdkit

inproc="(skipped: REPS=0)"
if [ "$REPS" -gt 0 ]; then
    log "in process: thin volume vs plain data file ($SIZE_MIB MiB, ${INPROC_S}s per run, $REPS reps)"
    inproc=$(target/release/examples/thin_bench --dir "$WORKDIR/inproc" --size-mib "$SIZE_MIB" --seconds "$INPROC_S" \
        --reps "$REPS" --qd 32 --direct require)
fi

# NBD: a fresh pool each run of the script; both data files fully written first.
nbd=$WORKDIR/nbd
rm -rf "$nbd"; mkdir -p "$nbd"
for f in thin-data.img; do
    dd if=/dev/zero of="$nbd/$f" bs=1M count="$SIZE_MIB" oflag=direct status=none
done
meta_mib=$(( SIZE_MIB / 64 + 8 ))
cat > "$nbd/mdkit.toml" <<TOML
data_dir = "$nbd"
[nbd]
listen = ["127.0.0.1:$PORT"]
[[volume]]
name = "plain"
kind = "file"
path = "thin-data.img"
direct = "require"
[[volume]]
name = "pool"
kind = "thin-pool"
metadata = "thin-meta.img"
metadata_size = "${meta_mib}MiB"
create = true
data = "thin-data.img"
direct = "require"
[[volume]]
name = "thin"
kind = "thin"
pool = "pool"
id = 0
size = "${SIZE_MIB}MiB"
create = true
[[export]]
name = "plain"
volume = "plain"
[[export]]
name = "thin"
volume = "thin"
TOML
"$MDKIT" serve --config "$nbd/mdkit.toml" 2>"$nbd/mdkit.log" &
pid=$!
trap 'kill $pid 2>/dev/null || true; wait 2>/dev/null || true' EXIT
for _ in $(seq 100); do nbdinfo --size "nbd://127.0.0.1:$PORT/thin" >/dev/null 2>&1 && break; sleep 0.1; done
log "provisioning every block of the thin volume (one sequential pass)"
fio --name=provision --ioengine=nbd --uri="nbd://127.0.0.1:$PORT/thin" --rw=write --bs=1m --iodepth=8 \
    --size="${SIZE_MIB}M" --end_fsync=1 >/dev/null
"$MDKIT" thin status pool --socket "$nbd/mdkit.sock" >&2

# One fio process per workload: NBD_REPS pairs of stonewalled jobs, each pair in alternating
# order, so the whole series runs back to back without a process start between runs.
for w in "randwrite 0" "randwrite 1" "randread 0"; do
    set -- $w
    job=$nbd/$1-$2.fio
    cat > "$job" <<FIO
[global]
ioengine=nbd
rw=$1
fsync=$2
bs=4k
iodepth=32
size=${SIZE_MIB}M
runtime=$RUNTIME_S
ramp_time=$RAMP_S
time_based
norandommap
randrepeat=0
stonewall
FIO
    for rep in $(seq "$NBD_REPS"); do
        order="plain thin"; [ $((rep % 2)) -eq 0 ] && order="thin plain"
        for t in $order; do printf '[%s-%s]\nuri=nbd://127.0.0.1:%s/%s\n' "$t" "$rep" "$PORT" "$t" >> "$job"; done
    done
    log "nbd: $1 fsync=$2, $NBD_REPS alternating pairs of ${RUNTIME_S}s runs"
    fio --output-format=json --output="$nbd/$1-$2.json" "$job" >/dev/null
done
status=$("$MDKIT" thin status pool --json --socket "$nbd/mdkit.sock")

echo
echo "== in process (thin_bench) =="
echo "$inproc"
python3 - "$nbd" "$status" <<'PY'
import json, sys, statistics, collections, random
rows = collections.defaultdict(dict)
for (rw, fsync) in [("randwrite", "0"), ("randwrite", "1"), ("randread", "0")]:
    for j in json.load(open(f"{sys.argv[1]}/{rw}-{fsync}.json"))["jobs"]:
        target, rep = j["jobname"].split("-")
        rows[(rw, fsync, target)][rep] = j["write" if "write" in rw else "read"]["iops"]
def median_interval(v, resamples=4000):
    # 95% bootstrap interval of the median (percentile method, fixed seed).
    rng = random.Random(0x5eed)
    meds = sorted(statistics.median(rng.choices(v, k=len(v))) for _ in range(resamples))
    return meds[resamples * 25 // 1000], meds[resamples * 975 // 1000 - 1]
st = json.loads(sys.argv[2])
print("\n== over NBD (fio nbd engine, 1 connection, QD32, 4 KiB; IOPS medians, thin/plain = median of per-pair ratios) ==")
print(f"{'workload':<32}{'plain IOPS':>11}{'thin IOPS':>11}{'thin/plain':>11}  {'95% interval':<14}{'pairs (min-max)':<17} target  upstream dm-thin/linear")
for (rw, fsync) in [("randwrite", "0"), ("randwrite", "1"), ("randread", "0")]:
    pl = rows[(rw, fsync, "plain")]; th = rows[(rw, fsync, "thin")]
    ratios = [th[r] / pl[r] for r in pl if r in th and pl[r] > 0]
    p = statistics.median(pl.values()); t = statistics.median(th.values())
    name = rw + (" + flush each (O_SYNC)" if fsync == "1" else "")
    up = "0.45 before, 1.00 after the O_SYNC fast path (204k/451k -> 450k/451k)" if fsync == "1" else "-"
    spread = f"{len(ratios)} ({min(ratios):.0%}-{max(ratios):.0%})"
    # The interval says how far this run's pairs pin the median down.
    lo, hi = median_interval(ratios)
    interval = f"{lo:.1%}-{hi:.1%}"
    print(f"{name:<32}{p:>11.0f}{t:>11.0f}{statistics.median(ratios):>10.1%}  {interval:<14}{spread:<17} >= 97%  {up}")
c = st["counters"]
print(f"pool after the runs: {st['status']}")
print(f"  commits={c['commits']} fast_writes={c['fast_writes']} fast_reads={c['fast_reads']} slow_ops={c['slow_ops']} provisions={c['provisions']}")
PY
