#!/usr/bin/env bash
# FileDevice (io_uring + O_DIRECT) vs fio --ioengine=io_uring --direct=1 on the same file, in the
# same run, workload by workload (alternating, so both see the same machine state).
#
#   crates/mdkit-io/bench.sh [DIR] [RUNTIME_SECS] [SIZE_MIB]
#
# DIR defaults to /var/tmp (must support O_DIRECT: not tmpfs). The file is fully written first so
# neither side measures block allocation. Prints a table with the mdkit/fio ratio; both are single
# threaded (one tokio current-thread runtime vs one fio job). Needs fio and python3.
set -euo pipefail

dir=${1:-/var/tmp}
runtime=${2:-10}
size_mib=${3:-1024}
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

fio_iops() {
    # shellcheck disable=SC2086
    fio --name=ref --filename="$file" --ioengine=io_uring --direct=1 --size="${size_mib}M" \
        --time_based --runtime="$runtime" --norandommap --randrepeat=0 --output-format=json $1 |
        python3 -c 'import json,sys; j=json.load(sys.stdin)["jobs"][0]; print(round(j["read"]["iops"]+j["write"]["iops"]))'
}

printf "%-18s %12s %12s %8s\n" workload mdkit_iops fio_iops ratio
for w in $order; do
    ours=$("$bench" --file "$file" --runtime-secs "$runtime" --workloads "$w" |
        sed -n 's/.*iops=\([0-9]*\).*/\1/p')
    ref=$(fio_iops "${fio_args[$w]}")
    ratio=$(python3 -c "print(f'{$ours/$ref:.2f}' if $ref else 'n/a')")
    printf "%-18s %12s %12s %8s\n" "$w" "$ours" "$ref" "$ratio"
done
