#!/usr/bin/env bash
# md arrays vs the raw member files in short alternating windows: issue 17's two device-bound
# ratios (1 MiB sequential writes against the raw aggregate, a rebuild against the device's own
# ceiling for it) for a device whose speed drifts faster than bench/md.sh's one raw pass before
# and one after (on the 2-vCPU VMs those two disagreed by up to 1.6x). Not part of the test suite.
#
#   bench/md-pairs.sh                          # raid5 and raid6, 4 members of 1 GiB, 6 cycles
#   LEVELS=raid1,raid6 CYCLES=10 MEMBER_MIB=2048 bench/md-pairs.sh
#   BITMAP=none MEMBERS=6 LEVELS=raid6 bench/md-pairs.sh   # arrays without the internal bitmap
#   LEVELS=raid6 SWEEP=md:16:bitmap,raw:524288:16 bench/md-pairs.sh   # decompose a seq-write gap
#
# Method (crates/mdkit-md/examples/support/paired.rs): windows run back to back as
#   seq-write   R X R A R X ... R   R = the raw files filled once, X = an array over the same
#                                   files filled once, A = the raw files again (the A/A control)
#   rebuild     C B C A C B ... C   C = the device's ceiling for a rebuild (the files it reads
#                                   read while a fresh file is written), B = a rebuild onto a
#                                   fresh member, A = the ceiling again (the A/A control)
# Each target window is divided by the geometric mean of the reference windows right before
# and after it; the table gives the median and quartiles of those ratios. "of ideal" divides
# the sequential write by what a perfect implementation reaches against the raw aggregate
# ((n - parity)/n for raid5/6, 1/copies for mirrors), as bench/md.sh does.
#
# SWEEP replaces both tests with sequential-write windows of several shapes, each between two
# reference windows: raw:BYTES:PER_FILE (the raw files written with BYTES requests, PER_FILE in
# flight on each; raw:524288:16 is the member pattern of an array of 512 KiB chunks at client
# depth 16) and md:QD:bitmap|nobitmap (an array filled at client depth QD). The table then
# gives each shape's ratio to the reference: what the member pattern costs on this device, and
# what the array adds on top of it.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
ensure_packages python3
ensure_rust

MEMBERS=${MEMBERS:-4}
MEMBER_MIB=${MEMBER_MIB:-1024}
CYCLES=${CYCLES:-6}
SEQ_QD=${SEQ_QD:-16}
LEVELS=${LEVELS:-raid5,raid6}
WORKDIR=${WORKDIR:-/var/tmp/mdkit-bench-md}
BITMAP=${BITMAP:-internal}
SWEEP=${SWEEP:-}

bench_workdir "$WORKDIR"

cargo build --release -p mdkit-md --example md_bench >&2
out=$(target/release/examples/md_bench --dir "$WORKDIR" --levels "$LEVELS" --members "$MEMBERS" \
      --member-mib "$MEMBER_MIB" --seq-qd "$SEQ_QD" --paired "$CYCLES" $([ "$BITMAP" = none ] && echo --no-bitmap) ${SWEEP:+--sweep "$SWEEP"})

MEMBERS=$MEMBERS CYCLES=$CYCLES BITMAP=$BITMAP SWEEP=$SWEEP python3 - "$out" <<'PY'
import os, statistics, sys
n = int(os.environ["MEMBERS"])
groups = {}
for line in sys.argv[1].splitlines():
    if not line.startswith("pair "):
        continue
    kv = dict(w.split("=", 1) for w in line.split()[1:])
    groups.setdefault((kv["level"], kv["test"], kv["target"]), []).append(float(kv["ratio"]))
def ideal(level, test):
    if test != "seq-write-1m":
        return 1.0
    return {"raid0": 1.0, "raid1": 1 / n, "raid10": 0.5, "raid4": (n - 1) / n, "raid5": (n - 1) / n,
            "raid6": (n - 2) / n}[level]
def summary(v):
    if len(v) < 2:
        return v[0], v[0], v[0]
    q = statistics.quantiles(v, n=4, method="inclusive")
    return statistics.median(v), q[0], q[2]
if os.environ["SWEEP"]:
    print(f"{n} members, {os.environ['CYCLES']} cycles; ratio = window / geometric mean of the raw 1 MiB x 4-per-file windows beside it")
    print(f"{'level':<7} {'window':<20} {'ratio (q1-q3)':>20} {'of ideal':>9}")
    for (level, test, target) in sorted(groups):
        m, q1, q3 = summary(groups[(level, test, target)])
        idl = ideal(level, test) if target.startswith("md-") else 1.0
        print(f"{level:<7} {target:<20} {m:>8.2f} ({q1:.2f}-{q3:.2f}) {m / idl:>9.2f}")
    sys.exit(0)
print(f"{n} members, bitmap {os.environ['BITMAP']}, {os.environ['CYCLES']} cycles; ratio = window / geometric mean of the reference windows beside it")
print(f"{'level':<7} {'test':<14} {'mdkit/ref (q1-q3)':>22} {'ideal':>6} {'of ideal':>9} {'A/A (q1-q3)':>20}  target")
for (level, test, target) in sorted(groups):
    if target != "mdkit":
        continue
    m, q1, q3 = summary(groups[(level, test, "mdkit")])
    a, a1, a3 = summary(groups.get((level, test, "aa"), [float("nan")]))
    idl = ideal(level, test)
    goal = ">= 0.90 of (n - parity)/n of raw" if test == "seq-write-1m" else ">= 0.90 of the ceiling"
    print(f"{level:<7} {test:<14} {m:>8.2f} ({q1:.2f}-{q3:.2f})    {idl:>6.2f} {m / idl:>9.2f} {a:>6.2f} ({a1:.2f}-{a3:.2f})  {goal}")
PY
