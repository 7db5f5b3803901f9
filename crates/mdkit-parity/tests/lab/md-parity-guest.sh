#!/bin/bash
# Guest half of the kernel parity cross-check (tests/kernel_crosscheck.rs), run by the lab's
# run.sh inside the Debian 6.1 kernel. Member disks, in this order:
#   vda..vdf  md0  raid6, 6 members, chunk 64 KiB, left-symmetric
#   vdg..vdk  md1  raid6, 5 members, chunk 16 KiB, left-symmetric
#   vdl..vdo  md2  raid5, 4 members, chunk 32 KiB, left-symmetric
#
#   md-parity-guest.sh create   kernel creates the arrays, writes random data (full stripes,
#                               then scattered 4 KiB writes that take the read-modify-write /
#                               reconstruct-write paths), runs a check, stops; prints MDINFO
#   md-parity-guest.sh verify   host has rewritten data + parity; assemble, check, hash the
#                               array contents, fail members and hash the degraded reads
#
# Output lines for the host start with a keyword (MDINFO, MISMATCH, SHA, SHA-DEGRADED).
set -euo pipefail

ARRAYS="md0 md1 md2"
members() {
    case $1 in
        md0) echo /dev/vda /dev/vdb /dev/vdc /dev/vdd /dev/vde /dev/vdf ;;
        md1) echo /dev/vdg /dev/vdh /dev/vdi /dev/vdj /dev/vdk ;;
        md2) echo /dev/vdl /dev/vdm /dev/vdn /dev/vdo ;;
    esac
}
level() { case $1 in md0|md1) echo 6 ;; md2) echo 5 ;; esac; }
chunk_kib() { case $1 in md0) echo 64 ;; md1) echo 16 ;; md2) echo 32 ;; esac; }

check_array() {   # check_array NAME: run sync_action=check, print MISMATCH NAME COUNT
    local md=/sys/block/$1/md t=0
    echo check >"$md/sync_action"
    sleep 0.2
    while [ "$(cat "$md/sync_action")" != idle ]; do
        sleep 0.2; t=$((t + 1))
        [ $t -lt 1500 ] || { echo "check of $1 did not finish" >&2; exit 1; }
    done
    echo "MISMATCH $1 $(cat "$md/mismatch_cnt")"
}

create() {
    for a in $ARRAYS; do
        # shellcheck disable=SC2046
        mdadm --create "/dev/$a" --run --quiet --metadata=1.2 --level="$(level "$a")" \
            --raid-devices=$(members "$a" | wc -w) --chunk="$(chunk_kib "$a")" \
            --layout=left-symmetric --bitmap=none --assume-clean $(members "$a")
    done
    cat /proc/mdstat
    for a in $ARRAYS; do
        local n data_disks stripe_bytes size_bytes
        n=$(members "$a" | wc -w)
        [ "$(level "$a")" = 5 ] && data_disks=$((n - 1)) || data_disks=$((n - 2))
        stripe_bytes=$((data_disks * $(chunk_kib "$a") * 1024))
        size_bytes=$(blockdev --getsize64 "/dev/$a")
        # Full-stripe writes: the kernel's gen_syndrome / xor_blocks over whole stripes.
        dd if=/dev/urandom of="/dev/$a" bs="$stripe_bytes" count=$((size_bytes / stripe_bytes)) \
            iflag=fullblock oflag=direct status=none
        # Scattered single-page writes: read-modify-write (xor_syndrome) or reconstruct-write.
        local pages=$((size_bytes / 4096))
        for _ in $(seq 1 40); do
            dd if=/dev/urandom of="/dev/$a" bs=4096 count=1 seek=$(( (RANDOM * 32768 + RANDOM) % pages )) \
                oflag=direct conv=notrunc status=none
        done
        check_array "$a"
        local first
        first=$(members "$a" | cut -d' ' -f1)
        echo "MDINFO $a level=$(level "$a") raid_disks=$n" \
            "chunk_bytes=$(cat "/sys/block/$a/md/chunk_size")" \
            "layout=$(cat "/sys/block/$a/md/layout")" \
            "component_kib=$(cat "/sys/block/$a/md/component_size")" \
            "data_offset_sectors=$(mdadm --examine "$first" | awk '/Data Offset/ {print $4}')" \
            "array_bytes=$size_bytes"
    done
    for a in $ARRAYS; do mdadm --stop "/dev/$a"; done
}

verify() {
    for a in $ARRAYS; do
        # shellcheck disable=SC2046
        mdadm --assemble --run --quiet "/dev/$a" $(members "$a")
    done
    cat /proc/mdstat
    for a in $ARRAYS; do
        check_array "$a"
        echo "SHA $a $(dd if="/dev/$a" bs=1M iflag=direct status=none | sha256sum | cut -d' ' -f1)"
    done
    # Degraded reads: the kernel rebuilds from the host-written parity. md0 loses two members
    # (every stripe then misses two of data/P/Q, in all combinations across the rotation);
    # md2 (raid5) loses one.
    mdadm /dev/md0 --fail /dev/vda --fail /dev/vdc >/dev/null
    mdadm /dev/md2 --fail /dev/vdm >/dev/null
    echo 3 >/proc/sys/vm/drop_caches
    for a in md0 md2; do
        echo "SHA-DEGRADED $a $(dd if="/dev/$a" bs=1M iflag=direct status=none | sha256sum | cut -d' ' -f1)"
    done
    for a in $ARRAYS; do mdadm --stop "/dev/$a"; done
}

case ${1:-} in
    create) create ;;
    verify) verify ;;
    *) echo "usage: $0 create|verify" >&2; exit 2 ;;
esac
