#!/usr/bin/env bash
# FileDevice (io_uring + O_DIRECT) vs fio --ioengine=io_uring --direct=1 on the same file, in the
# same run, workload by workload (alternating, so both see the same machine state).
#
#   crates/mdkit-io/bench.sh [DIR] [RUNTIME_SECS] [SIZE_MIB] [REPEAT]
#
# DIR defaults to /var/tmp (must support O_DIRECT: not tmpfs). The file is fully written first so
# neither side measures block allocation. Each workload runs REPEAT times (default 3) on each side,
# alternating mdkit/fio; the table shows the median IOPS of each side and their ratio. Both are
# single threaded (one tokio current-thread runtime vs one fio job). Needs fio and python3.
set -euo pipefail

dir=${1:-/var/tmp}
runtime=${2:-10}
size_mib=${3:-1024}
repeat=${4:-3}
file="$dir/mdkit-io-bench.img"
root=$(cd "$(dirname "$0")/../.." && pwd)

command -v fio >/dev/null || { echo "bench.sh: fio not found (apt-get install fio)" >&2; exit 1; }
command -v python3 >/dev/null || { echo "bench.sh: python3 not found" >&2; exit 1; }

cargo build --quiet --release --manifest-path "$root/Cargo.toml" -p mdkit-io --example io_bench
bench="$root/target/release/examples/io_bench"

if [ ! -f "$file" ] || [ "$(stat -c %s "$file")" -ne $((size_mib << 20)) ]; then
    rm -f "$file"
    echo "# preparing $file ($size_mib MiB, fully written)" >&2
    fio --name=prep --filename="$file" --rw=write --bs=1M --size="${size_mib}M" --ioengine=io_uring \
        --direct=1 --iodepth=8 --output=/dev/null
fi
trap 'rm -f "$file"' EXIT

# workload name -> fio arguments
declare -A fio_args=(
    [randread4k-qd1]="--rw=randread --bs=4k --iodepth=1"
    [randread4k-qd32]="--rw=randread --bs=4k --iodepth=32"
    [randwrite4k-qd1]="--rw=randwrite --bs=4k --iodepth=1"
    [randwrite4k-qd32]="--rw=randwrite --bs=4k --iodepth=32"
    [seqwrite1m-qd4]="--rw=write --bs=1M --iodepth=4"
)
order="randread4k-qd1 randread4k-qd32 randwrite4k-qd1 randwrite4k-qd32 seqwrite1m-qd4"

# Prints "<iops> <cpu_us_per_io>" for one fio run.
fio_run() {
    # shellcheck disable=SC2086
    fio --name=ref --filename="$file" --ioengine=io_uring --direct=1 --size="${size_mib}M" \
        --time_based --runtime="$runtime" --norandommap --randrepeat=0 --output-format=json $1 |
        python3 -c '
import json, sys
j = json.load(sys.stdin)["jobs"][0]
ios = j["read"]["total_ios"] + j["write"]["total_ios"]
cpu_us = (j["usr_cpu"] + j["sys_cpu"]) / 100 * j["job_runtime"] * 1000
print(round(j["read"]["iops"] + j["write"]["iops"]), f"{cpu_us / max(ios, 1):.2f}")'
}

# Prints "<iops> <cpu_us_per_io>" for one io_bench run.
mdkit_run() {
    "$bench" --file "$file" --runtime-secs "$runtime" --workloads "$1" |
        sed -n 's/.* iops=\([0-9]*\).*cpu_us_per_io=\([0-9.]*\).*/\1 \2/p'
}

median() { python3 -c 'import statistics,sys; print(statistics.median(float(x) for x in sys.argv[1:]))' "$@"; }

printf "%-18s %11s %11s %6s %13s %13s   %s\n" workload mdkit_iops fio_iops ratio mdkit_cpu_us fio_cpu_us \
    "iops per run (mdkit | fio)"
for w in $order; do
    ours_iops=() ours_cpu=() ref_iops=() ref_cpu=()
    for _ in $(seq "$repeat"); do
        read -r i c < <(mdkit_run "$w")
        ours_iops+=("$i") ours_cpu+=("$c")
        read -r i c < <(fio_run "${fio_args[$w]}")
        ref_iops+=("$i") ref_cpu+=("$c")
    done
    ours=$(median "${ours_iops[@]}")
    ref=$(median "${ref_iops[@]}")
    ratio=$(python3 -c "print(f'{$ours/$ref:.2f}' if $ref else 'n/a')")
    printf "%-18s %11.0f %11.0f %6s %13.2f %13.2f   %s | %s\n" "$w" "$ours" "$ref" "$ratio" \
        "$(median "${ours_cpu[@]}")" "$(median "${ref_cpu[@]}")" "${ours_iops[*]}" "${ref_iops[*]}"
done
echo "(ratio = median mdkit IOPS / median fio IOPS; *_cpu_us = median user+system CPU µs per I/O)"
