#!/usr/bin/env bash
# md array benchmark: raid0, raid1, raid10, raid5 and raid6 over member files vs the raw member files, same
# files, same run, in process (crates/mdkit-md/examples/md_bench.rs: the Array as a BlockDevice
# on io_uring O_DIRECT file members). Not part of the test suite.
#
#   bench/md.sh                                  # 4 members of 1 GiB, 5 s per measurement
#   MEMBER_MIB=4096 SECS=10 WORKDIR=/srv/bench bench/md.sh
#   LEVELS=raid10 bench/md.sh
#
# Measurements (each level: raw files first, then the array over the same files):
#   seq-write-1m    writes everything once (raw: one stream per file, over files already
#                   written once, before the array and again after it: the mean is the raw
#                   rate, the ratio the A/A control; array: QD SEQ_QD)
#   seq-read-1m     QD SEQ_QD (raw: 4 per file)        rand-read-4k / rand-write-4k  QD QD
#   degraded-*      redundant levels with one member failed
#   rebuild         a fresh member rebuilt (member bytes / time) vs the device's ceiling for it
#                   (a fresh file written once while the files a rebuild reads from are read:
#                   one for raid1/raid10, n - 1 for raid5/6) and vs one fresh file written alone
#   resync          a full resync of a new array over the same files (member bytes / time) vs
#                   the device's ceiling for it (raid1: one file read while the others are
#                   written; raid10 near2: every other file read, the rest written; raid5/6:
#                   every file read, as the parity the rebuild left is consistent)
# "ideal" is the ratio a perfect implementation would reach against the raw aggregate (a raid1
# write goes to every member, raid10 n2 to two, a degraded array reads from one member less),
# so "of ideal" is comparable with upstream md's published fractions beside it.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
ensure_packages python3
ensure_rust

MEMBERS=${MEMBERS:-4}
MEMBER_MIB=${MEMBER_MIB:-1024}
SECS=${SECS:-5}
QD=${QD:-32}
SEQ_QD=${SEQ_QD:-16}
LEVELS=${LEVELS:-raid0,raid1,raid10,raid5,raid6}
WORKDIR=${WORKDIR:-/var/tmp/mdkit-bench-md}

bench_workdir "$WORKDIR"

cargo build --release -p mdkit-md --example md_bench >&2
out=$(target/release/examples/md_bench --dir "$WORKDIR" --levels "$LEVELS" --members "$MEMBERS" \
      --member-mib "$MEMBER_MIB" --secs "$SECS" --qd "$QD" --seq-qd "$SEQ_QD")

MEMBERS=$MEMBERS python3 - "$out" <<'PY'
import os, sys
n = int(os.environ["MEMBERS"])
rows = {}
for line in sys.argv[1].splitlines():
    if not line.startswith("result "):
        continue
    kv = dict(w.split("=", 1) for w in line.split()[1:])
    rows[(kv["level"], kv["target"], kv["test"])] = kv
# Ideal fraction of the raw aggregate, per level and test.
copies = {"raid0": 1, "raid1": n, "raid10": 2}
parity = {"raid4": 1, "raid5": 1, "raid6": 2}
def ideal(level, test):
    if test.startswith("degraded"):
        return (n - 1) / n
    if level in parity:
        p = parity[level]
        if test == "rand-write-4k":
            return 1 / (2 + 2 * p)  # read-modify-write: read data + P(+Q), write them back
        if test.startswith("seq"):
            return (n - p) / n      # parity chunks carry no user data
        return 1.0
    c = copies[level]
    if "write" in test:
        return 1 / c
    return 1.0
upstream = {
    ("raid0", "seq-read-1m"): "md raid0 4xNVMe 512K read 23 GiB/s = 0.85 of 4x one disk (anchors 4.8)",
    ("raid0", "rand-read-4k"): "md raid0 4xNVMe 4K read 666k IOPS < one disk 828k (anchors 4.8)",
    ("raid1", "rand-write-4k"): "md raid1 2xNVMe+bitmap 4K randrw 538k vs one disk 577k = 0.93 (anchors 4.7)",
    ("raid10", "rand-read-4k"): "md raid10 4xNVMe 4K randread 7.0 -> 9.3 GiB/s after lock work (anchors 4.6, no raw)",
    ("raid5", "seq-write-1m"): "md raid5 9 HDD seq write 600-1150 MB/s of 1440 theory = 0.42-0.80 (anchors 4.2)",
    ("raid6", "rand-write-4k"): "md raid6 4+2 ramdisk 4K RMW +17% with 4 stripe threads (anchors 4.4, no raw)",
}
print(f"{'level':<7} {'test':<22} {'mdkit':>12} {'raw':>12} {'ratio':>6} {'ideal':>6} {'of ideal':>8}  upstream md")
for (level, target, test), kv in sorted(rows.items(), key=lambda x: (x[0][0], x[0][2])):
    if target != "mdkit":
        continue
    unit = "iops" if "4k" in test else "mbps"
    val = float(kv[unit])
    if test in ("rebuild", "resync"):
        # Against the device's own ceiling for the pass first (the files it reads read and the
        # files it writes written at once, all on this one device), then one file alone.
        # The ceiling is measured before and after the pass: their mean is the ceiling, their
        # ratio the A/A control.
        c1, c2 = rows.get((level, "raw", f"{test}-ceiling")), rows.get((level, "raw", f"{test}-ceiling-again"))
        if c1 and c2:
            v1, v2 = float(c1["mbps"]), float(c2["mbps"])
            cv = (v1 + v2) / 2
            print(f"{level:<7} {test + '-vs-ceiling':<22} {val:>7.0f} MB/s {cv:>7.0f} MB/s {val / cv:>6.2f} {1.0:>6.2f} {val / cv:>8.2f}  target >= 0.90 of the ceiling (A/A {v2 / v1:.2f})")
        raw = rows.get((level, "raw", "seq-write-1m-one-file"))
        rawv = float(raw["mbps"]) if raw else 0
        idl = 1.0
    else:
        base = test.replace("degraded-", "")
        raw = rows.get((level, "raw", base))
        rawv = float(raw[unit]) if raw else 0
        idl = ideal(level, test)
        again = rows.get((level, "raw", "seq-write-1m-again")) if test == "seq-write-1m" else None
        if raw and again:
            # The raw pass before the array's and again at the end: their mean is the raw
            # rate, their ratio the A/A control.
            v2 = float(again[unit])
            aa = f"A/A {v2 / rawv:.2f}"
            rawv = (rawv + v2) / 2
            upstream[(level, test)] = (aa + "; " + upstream.get((level, test), "")).rstrip("; ")
    ratio = val / rawv if rawv else 0
    u = "IOPS" if unit == "iops" else "MB/s"
    print(f"{level:<7} {test:<22} {val:>7.0f} {u:<4} {rawv:>7.0f} {u:<4} {ratio:>6.2f} {idl:>6.2f} {ratio/idl:>8.2f}  {upstream.get((level, test), '')}")
PY
