#!/usr/bin/env bash
# Remote mirror benchmark (issue 19): raid1 of a local file and a remote NBD export (nbdkit's
# file plugin behind a delaying TCP proxy on loopback, 1 ms and 5 ms added round trip), 4 KiB
# random writes at QD32 through mdkit's NBD export with fio's nbd engine, one run:
#
#   bench/remote.sh                 # defaults below
#   RUNTIME_S=10 SIZE=1G DELAYS_MS="1 5" OUTAGE_S=10 bench/remote.sh
#   REMOTE_QD=64 bench/remote.sh    # remote_queue_depth of the remote member (default: mdkit's)
#   MDKIT=target/suite/mdkit bench/remote.sh   # a binary already built (no cargo build)
#
# Rows per added round trip:
# - `local`     raid1 of two local files (the local-only array: what write-behind aims at);
# - `behind`    raid1 local + remote, remote write-mostly, write_behind = 256 (target: >= 90%
#               of `local`);
# - `sync`      the same without write-behind (every write waits for the remote round trip);
# - `local-aa`  a second local-only array run like `local`: the A/A control (its ratio to
#               `local` is the noise of this run);
# - `ceiling`   fio io_uring O_DIRECT on a local member file itself: the device's own ceiling.
# Then the catch-up: the proxy is stopped for OUTAGE_S seconds under the same workload on
# `behind` (the member fails, the bitmap records), started again; the time from the link's
# return until the automatic re-add's recovery finished, against the bytes written during the
# outage and the bytes the recovery copied (bitmap chunks).
# CATCHUP_MAX_S (default 120) bounds the wait for the catch-up.
# Member files live in WORKDIR (default /var/tmp; must do O_DIRECT). Not part of the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."

RUNTIME_S=${RUNTIME_S:-10}
SIZE=${SIZE:-1G}
DELAYS_MS=${DELAYS_MS:-1 5}
OUTAGE_S=${OUTAGE_S:-10}
# Requests in flight to the remote (`remote_queue_depth`); empty: mdkit's default, 64 or the
# write-behind limit when larger (256 here). Write-behind sustains the local rate only if the
# link carries it: IOPS x RTT requests in flight.
REMOTE_QD=${REMOTE_QD:-}
WORKDIR=${WORKDIR:-/var/tmp}/mdkit-remote-bench
for t in fio nbdkit python3; do command -v "$t" >/dev/null || { echo "remote.sh: $t not found" >&2; exit 1; }; done
if [ -z "${MDKIT:-}" ]; then
    cargo build --release -p mdkit >&2
    MDKIT=target/release/mdkit
fi
MDKIT=$(realpath "$MDKIT")
# The delaying proxy (crates/mdkit-io/examples/delay_proxy.rs): every reply byte RTT late.
# A Python asyncio proxy used before capped fio itself at 11,294 4 KiB writes/s at 1 ms.
cargo build --release -p mdkit-io --example delay_proxy >&2
PROXY=$(realpath target/release/examples/delay_proxy)

rm -rf "$WORKDIR"; mkdir -p "$WORKDIR"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT


fio_iops() { # fio arguments naming the target
    fio --name=w --rw=randwrite --bs=4k --iodepth=32 --time_based --runtime="$RUNTIME_S" --ramp_time=1 \
        --norandommap --size="$SIZE" --output-format=json "$@" 2>/dev/null |
        python3 -c 'import json,sys; t=sys.stdin.read(); j=json.loads(t[t.index("{"):]); print(int(j["jobs"][0]["write"]["iops"]))'
}
nbd_iops() { fio_iops --ioengine=nbd --uri="nbd://127.0.0.1:$PORT/$1"; }

detail() { "$MDKIT" detail "$1" --json --socket "$WORKDIR/data/mdkit.sock"; }
# The row's figure, or INVALID when the remote member was not in sync after the run (the
# array measured its local member alone).
whole() { # iops
    if detail behind | python3 -c 'import json,sys; d=json.load(sys.stdin); sys.exit(d["degraded"] != 0)'; then
        echo "$1"
    else
        echo "INVALID($1)"
    fi
}

wait_port() { for _ in $(seq 100); do python3 -c "import socket,sys; socket.create_connection(('127.0.0.1', $1), 1)" 2>/dev/null && return; sleep 0.1; done; echo "port $1 not up" >&2; exit 1; }
PORT=10931; NBDKIT_PORT=10932; PROXY_PORT=10933
# The remote's file is on tmpfs (REMOTE_DIR): on the local members' disk, the local-only
# rows saturate that disk and an idle remote's bitmap write then waited past
# remote_timeout_ms, failing the member; a degraded `behind` array then measured the local
# member alone (stop 25: "sync" at 31,953 IOPS over a 5 ms round trip, above QD32's 6,400 limit).
REMOTE=${REMOTE_DIR:-/dev/shm}/mdkit-remote-bench.img
truncate -s "$SIZE" "$REMOTE"
nbdkit -f -i 127.0.0.1 -p "$NBDKIT_PORT" --threads 16 file "$REMOTE" &
pids+=($!)
wait_port "$NBDKIT_PORT"

printf '%-8s %-9s %10s %8s\n' "RTT" "ARRAY" "IOPS" "RATIO"
for delay in $DELAYS_MS; do
    "$PROXY" "$PROXY_PORT" "$NBDKIT_PORT" "$delay" & proxy=$!
    pids+=($proxy)
    wait_port "$PROXY_PORT"
    mkdir -p "$WORKDIR/data"
    remote="nbd://127.0.0.1:$PROXY_PORT/"
    cat > "$WORKDIR/mdkit.toml" <<TOML
data_dir = "$WORKDIR/data"
[nbd]
listen = ["127.0.0.1:$PORT"]
[[volume]]
name = "local"
kind = "md"
members = ["l0.img", "l1.img"]
member_size = "$SIZE"
create = true
level = "raid1"
assume_clean = true
[[volume]]
name = "local-aa"
kind = "md"
members = ["a0.img", "a1.img"]
member_size = "$SIZE"
create = true
level = "raid1"
assume_clean = true
[[volume]]
name = "behind"
kind = "md"
members = ["b0.img", "$remote"]
member_size = "$SIZE"
create = true
level = "raid1"
assume_clean = true
write_mostly = ["$remote"]
write_behind = 256
remote_timeout_ms = 1000
$([ -n "$REMOTE_QD" ] && echo "remote_queue_depth = $REMOTE_QD")
$(for v in local local-aa behind; do printf '[[export]]\nname = "%s"\nvolume = "%s"\n' "$v" "$v"; done)
TOML
    "$MDKIT" serve --config "$WORKDIR/mdkit.toml" 2>"$WORKDIR/mdkit-$delay.log" & mdkit=$!
    pids+=($mdkit)
    wait_port "$PORT"
    l=$(nbd_iops local); aa=$(nbd_iops local-aa); b=$(whole "$(nbd_iops behind)")
    "$MDKIT" grow behind --write-behind 0 --socket "$WORKDIR/data/mdkit.sock" >/dev/null
    s=$(whole "$(nbd_iops behind)")
    "$MDKIT" grow behind --write-behind 256 --socket "$WORKDIR/data/mdkit.sock" >/dev/null
    c=$(fio_iops --ioengine=io_uring --direct=1 --filename="$WORKDIR/data/l0.img")
    ratio() { case $1 in INVALID*) echo - ;; *) python3 -c "print(f'{$1/$2:.3f}')" ;; esac; }
    printf '%-8s %-9s %10s %8s\n' "${delay}ms" local "$l" 1.000 "${delay}ms" local-aa "$aa" "$(ratio "$aa" "$l")" \
        "${delay}ms" behind "$b" "$(ratio "$b" "$l")" "${delay}ms" sync "$s" "$(ratio "$s" "$l")" \
        "${delay}ms" ceiling "$c" "$(ratio "$c" "$l")"
    # Catch-up: the link is down for OUTAGE_S under the workload, then back.
    fio --name=w --rw=randwrite --bs=4k --iodepth=32 --time_based --runtime="$OUTAGE_S" --norandommap \
        --size="$SIZE" --output-format=json --ioengine=nbd --uri="nbd://127.0.0.1:$PORT/behind" \
        >"$WORKDIR/outage.json" 2>/dev/null & load=$!
    sleep 0.5
    kill "$proxy"; wait "$proxy" 2>/dev/null || true
    wait "$load" || echo "${delay}ms outage: fio saw an I/O error (see $WORKDIR/outage.json and $WORKDIR/mdkit-$delay.log)"
    written=$(python3 -c 'import json,sys; t=open(sys.argv[1]).read(); print(json.loads(t[t.index("{"):])["jobs"][0]["write"]["io_bytes"])' "$WORKDIR/outage.json")
    "$PROXY" "$PROXY_PORT" "$NBDKIT_PORT" "$delay" & proxy=$!
    pids+=($proxy)
    wait_port "$PROXY_PORT"
    t0=$(date +%s.%N)
    # Done when the remote is back in sync and no recovery runs.
    deadline=$(( $(date +%s) + ${CATCHUP_MAX_S:-120} ))
    st=wait
    while [ "$(date +%s)" -lt "$deadline" ]; do
        st=$(detail behind | python3 -c 'import json,sys
d=json.load(sys.stdin); m=[x for x in d["members"] if x["role"]==1]
ok=m and "in_sync" in m[0]["state"] and d["sync"]["action"]=="idle" and d["degraded"]==0
print("done %d" % d["sync"]["copied_bytes"] if ok else "wait")' || echo wait)
        [ "${st%% *}" = done ] && break
        sleep 0.1
    done
    t1=$(date +%s.%N)
    if [ "${st%% *}" = done ]; then
        echo "${delay}ms catch-up: $(python3 -c "print(f'{$t1-$t0:.2f}')") s after the link returned; $written bytes written during the ${OUTAGE_S} s outage, ${st#done } bytes copied (bitmap chunks)"
    else
        echo "${delay}ms catch-up: NOT caught up ${CATCHUP_MAX_S:-120} s after the link returned ($written bytes written during the outage; see $WORKDIR/mdkit-$delay.log)"
    fi
    kill "$mdkit"; wait "$mdkit" 2>/dev/null || true
    kill "$proxy"; wait "$proxy" 2>/dev/null || true
    rm -rf "$WORKDIR/data"
    # The next round creates its arrays afresh: the remote export must not keep this round's
    # superblock (assembly would take it and leave the new local member out).
    truncate -s 0 "$REMOTE"; truncate -s "$SIZE" "$REMOTE"
done
rm -f "$REMOTE"
