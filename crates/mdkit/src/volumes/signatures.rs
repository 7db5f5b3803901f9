//! What a device already holds, before mdkit formats it: the signatures of the file systems,
//! volume managers and partition tables an operator is most likely to point `create` at by
//! mistake (mdadm asks "appears to contain an ext2fs file system, continue?" from libblkid).
//! Only well-known magic numbers at fixed offsets are probed; finding none proves nothing.

use mdkit_io::{BlockDevice, BlockDeviceExt};

/// How many bytes from the start of a device the probes read (btrfs' superblock ends before).
const PROBE_BYTES: usize = 68 << 10;

/// One probe: `magic` at `offset_bytes` means `what`.
struct Probe {
    what: &'static str,
    offset_bytes: usize,
    magic: &'static [u8],
}

const PROBES: &[Probe] = &[
    Probe { what: "an ext2/3/4 file system", offset_bytes: 1024 + 56, magic: &[0x53, 0xef] },
    Probe { what: "an XFS file system", offset_bytes: 0, magic: b"XFSB" },
    Probe { what: "a btrfs file system", offset_bytes: (64 << 10) + 64, magic: b"_BHRfS_M" },
    Probe { what: "a LUKS volume", offset_bytes: 0, magic: b"LUKS\xba\xbe" },
    Probe { what: "an LVM2 physical volume", offset_bytes: 512, magic: b"LABELONE" },
    Probe { what: "a GPT partition table", offset_bytes: 512, magic: b"EFI PART" },
    Probe { what: "a swap area", offset_bytes: 4096 - 10, magic: b"SWAPSPACE2" },
    Probe { what: "an NTFS file system", offset_bytes: 3, magic: b"NTFS    " },
    Probe { what: "a squashfs image", offset_bytes: 0, magic: b"hsqs" },
    Probe { what: "an ISO 9660 image", offset_bytes: 32769, magic: b"CD001" },
    // dm-thin metadata: the superblock's magic (27022010) at byte 32.
    Probe { what: "thin-pool metadata", offset_bytes: 32, magic: &27_022_010u64.to_le_bytes() },
];

/// The first signature found in `head` (a device's first bytes), if any.
pub fn identify(head: &[u8]) -> Option<&'static str> {
    let found = PROBES
        .iter()
        .find(|p| head.get(p.offset_bytes..p.offset_bytes + p.magic.len()) == Some(p.magic))
        .map(|p| p.what);
    found.or_else(|| boot_sector(head))
}

/// A DOS partition table or a FAT boot sector: the 0x55AA boot signature with a partition
/// entry or a FAT jump instruction beside it.
fn boot_sector(head: &[u8]) -> Option<&'static str> {
    if head.get(510..512) != Some(&[0x55, 0xaa]) {
        return None;
    }
    if head.get(0x36..0x39) == Some(b"FAT") || head.get(0x52..0x55) == Some(b"FAT") {
        return Some("a FAT file system");
    }
    let partitions = &head[446..510];
    partitions.iter().any(|&b| b != 0).then_some("a DOS partition table")
}

/// What `dev` holds, probing its first bytes (`None` too when it cannot be read or is
/// shorter than the probes: the format that follows reports its own errors).
pub async fn probe(dev: &dyn BlockDevice) -> Option<&'static str> {
    let len = usize::try_from(dev.topology().size_bytes).unwrap_or(usize::MAX).min(PROBE_BYTES);
    let len = len - len % 4096;
    if len == 0 {
        return None;
    }
    let head = dev.read_vec(0, len).await.ok()?;
    identify(&head)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_probe_is_found_and_zeros_are_nothing() {
        assert_eq!(identify(&vec![0u8; PROBE_BYTES]), None);
        for p in PROBES {
            let mut head = vec![0u8; PROBE_BYTES];
            head[p.offset_bytes..p.offset_bytes + p.magic.len()].copy_from_slice(p.magic);
            assert_eq!(identify(&head), Some(p.what));
        }
    }

    #[test]
    fn a_boot_signature_needs_partitions_or_fat_beside_it() {
        let mut head = vec![0u8; 4096];
        head[510] = 0x55;
        head[511] = 0xaa;
        assert_eq!(identify(&head), None, "a bare boot signature");
        head[446 + 4] = 0x83; // a Linux partition entry
        assert_eq!(identify(&head), Some("a DOS partition table"));
        head[0x36..0x39].copy_from_slice(b"FAT");
        assert_eq!(identify(&head), Some("a FAT file system"));
    }

    #[test]
    fn short_input_is_nothing() {
        assert_eq!(identify(&[0x53]), None);
        assert_eq!(identify(&[]), None);
    }
}
