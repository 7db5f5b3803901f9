//! Allocation status of a device range ([`BlockDevice::block_status`]): runs of bytes that are
//! allocated or not, and known to read as zeroes or not. The NBD `base:allocation` context is
//! this, one to one (HOLE = bit 0, ZERO = bit 1).
//!
//! The contract every implementation keeps (what [`ExtentList`] enforces):
//! - extents are contiguous from the requested offset, each longer than zero, in order;
//! - together they cover a prefix of the range, never more than the range, and at least one
//!   byte of it (a caller asks again from where the answer stopped);
//! - at most the caller's `max_extents`; adjacent extents with equal flags are merged;
//! - "allocated, contents unknown" ([`ExtentFlags::DATA`]) is always a correct answer, so a
//!   device that knows nothing (an md array, a decorator) reports that.
//!
//! [`BlockDevice::block_status`]: crate::BlockDevice::block_status

use std::io;
use std::os::fd::RawFd;

/// State of a run of bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ExtentFlags {
    /// Not allocated in the backend: a write there may need space (NBD_STATE_HOLE).
    pub hole: bool,
    /// Reads return zeroes (NBD_STATE_ZERO).
    pub zero: bool,
}

impl ExtentFlags {
    /// Allocated, contents unknown: the answer that is never wrong.
    pub const DATA: ExtentFlags = ExtentFlags { hole: false, zero: false };
    /// Unallocated and reading as zeroes (a sparse file's hole, an unmapped thin block).
    pub const HOLE_ZERO: ExtentFlags = ExtentFlags { hole: true, zero: true };

    /// The NBD `base:allocation` bits.
    pub fn nbd_bits(self) -> u32 {
        u32::from(self.hole) | (u32::from(self.zero) << 1)
    }

    /// What a run made of runs with `self` and `other` can claim: both must hold (nbdkit's
    /// rule for coarsening extents to an alignment).
    pub fn and(self, other: ExtentFlags) -> ExtentFlags {
        ExtentFlags { hole: self.hole && other.hole, zero: self.zero && other.zero }
    }
}

/// A run of `len_bytes` bytes with one state: [`ExtentFlags`] for allocation, `bool` for
/// "changed" in [`BlockDevice::changed_since`](crate::BlockDevice::changed_since).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent<F = ExtentFlags> {
    pub len_bytes: u64,
    pub flags: F,
}

/// Builds a block-status answer for `[offset, offset + len)` that keeps the contract above:
/// pushes past the range are clipped, equal neighbours merged, zero lengths ignored, and
/// [`ExtentList::push`] says when the answer is complete (range covered or count reached).
#[derive(Debug)]
pub struct ExtentList<F = ExtentFlags> {
    len_bytes: u64,
    covered_bytes: u64,
    max_extents: usize,
    extents: Vec<Extent<F>>,
}

impl<F: Copy + PartialEq> ExtentList<F> {
    /// An empty answer for a range of `len_bytes`, with at most `max_extents` (at least 1).
    pub fn new(len_bytes: u64, max_extents: usize) -> ExtentList<F> {
        ExtentList { len_bytes, covered_bytes: 0, max_extents: max_extents.max(1), extents: Vec::new() }
    }

    /// Bytes covered so far (the offset, relative to the range start, of the next push).
    pub fn covered_bytes(&self) -> u64 {
        self.covered_bytes
    }

    /// Whether nothing more can be added: the range is covered, or the list is full and its
    /// last extent cannot grow.
    pub fn is_done(&self) -> bool {
        self.covered_bytes >= self.len_bytes
    }

    /// Appends `len_bytes` with `flags` after what is there. Returns false once the answer is
    /// complete (the caller stops looking).
    pub fn push(&mut self, len_bytes: u64, flags: F) -> bool {
        let len = len_bytes.min(self.len_bytes - self.covered_bytes);
        if len == 0 {
            return !self.is_done();
        }
        let full = self.extents.len() == self.max_extents;
        match self.extents.last_mut() {
            Some(last) if last.flags == flags => last.len_bytes += len,
            _ if full => {
                // Full: the answer ends here; the caller asks again from this offset.
                self.len_bytes = self.covered_bytes;
                return false;
            }
            _ => self.extents.push(Extent { len_bytes: len, flags }),
        }
        self.covered_bytes += len;
        !self.is_done()
    }

    /// The extents; when nothing was pushed (an empty range), none.
    pub fn finish(self) -> Vec<Extent<F>> {
        self.extents
    }
}

/// Checks a block-status range against a device of `size_bytes` (no alignment needed):
/// `InvalidInput` naming the device when it runs past the end or overflows.
pub fn check_status_range(name: &str, size_bytes: u64, offset_bytes: u64, len_bytes: u64) -> io::Result<()> {
    if offset_bytes.checked_add(len_bytes).is_some_and(|end| end <= size_bytes) {
        return Ok(());
    }
    Err(io::Error::new(
        io::ErrorKind::InvalidInput,
        format!(
            "{name}: block status of {len_bytes} bytes at offset {offset_bytes}: beyond the end of the device ({size_bytes} bytes)"
        ),
    ))
}

/// Block status of a regular file by `SEEK_DATA` / `SEEK_HOLE`: holes are
/// [`ExtentFlags::HOLE_ZERO`], data is [`ExtentFlags::DATA`]. Boundaries the filesystem reports
/// inside a `granularity_bytes` block are rounded so that every extent but the last is a
/// multiple of it; a block holding any data counts as data. `name` is used in errors.
pub fn seek_extents(
    name: &str,
    fd: RawFd,
    offset_bytes: u64,
    len_bytes: u64,
    granularity_bytes: u64,
    max_extents: usize,
) -> io::Result<Vec<Extent>> {
    let g = granularity_bytes.max(1);
    let end = offset_bytes + len_bytes;
    let mut list = ExtentList::new(len_bytes, max_extents);
    let mut pos = offset_bytes;
    while pos < end {
        let data_at = match lseek(fd, pos, libc::SEEK_DATA) {
            Ok(d) => d.min(end),
            // No data at or after `pos`: the rest is a hole.
            Err(e) if e.raw_os_error() == Some(libc::ENXIO) => end,
            Err(e) => return Err(seek_error(name, e, pos)),
        };
        // Round the hole's end down: a partial block at its end holds data.
        let hole_end = if data_at >= end { end } else { (data_at / g * g).max(pos) };
        if hole_end > pos && !list.push(hole_end - pos, ExtentFlags::HOLE_ZERO) {
            break;
        }
        pos = hole_end;
        if pos >= end {
            break;
        }
        // From the data itself: `pos` may still be in a hole that shares a block with it.
        let hole_at = match lseek(fd, data_at.max(pos), libc::SEEK_HOLE) {
            Ok(h) => h.min(end),
            Err(e) if e.raw_os_error() == Some(libc::ENXIO) => end,
            Err(e) => return Err(seek_error(name, e, data_at)),
        };
        // Round the data's end up: a partial block at its end holds data.
        let data_end = hole_at.div_ceil(g).saturating_mul(g).min(end).max(pos + 1);
        if !list.push(data_end - pos, ExtentFlags::DATA) {
            break;
        }
        pos = data_end;
    }
    Ok(list.finish())
}

fn lseek(fd: RawFd, offset: u64, whence: i32) -> io::Result<u64> {
    let off = libc::off_t::try_from(offset).map_err(|_| io::Error::from_raw_os_error(libc::EOVERFLOW))?;
    // SAFETY: lseek takes no pointers; SEEK_DATA/SEEK_HOLE only read the file's extent map.
    // (It moves the file offset, which this crate never uses: every I/O carries its offset.)
    let r = unsafe { libc::lseek(fd, off, whence) };
    if r < 0 { Err(io::Error::last_os_error()) } else { Ok(r as u64) }
}

fn seek_error(name: &str, e: io::Error, pos: u64) -> io::Error {
    io::Error::new(e.kind(), format!("{name}: block status: SEEK_DATA/SEEK_HOLE at offset {pos}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Seek, SeekFrom, Write};
    use std::os::fd::AsRawFd;

    const D: ExtentFlags = ExtentFlags::DATA;
    const H: ExtentFlags = ExtentFlags::HOLE_ZERO;

    fn e(len_bytes: u64, flags: ExtentFlags) -> Extent {
        Extent { len_bytes, flags }
    }

    #[test]
    fn list_merges_clips_and_stops_at_the_count() {
        let mut l = ExtentList::new(100, 2);
        assert!(l.push(10, D));
        assert!(l.push(0, H));
        assert!(l.push(10, D));
        assert!(l.push(30, H));
        // Third distinct extent: the list is full, the answer ends at 50.
        assert!(!l.push(5, D));
        assert!(l.is_done());
        assert_eq!(l.covered_bytes(), 50);
        assert_eq!(l.finish(), vec![e(20, D), e(30, H)]);

        let mut l = ExtentList::new(100, 8);
        assert!(l.push(60, H));
        assert!(!l.push(60, D), "clipped to the range, and complete");
        assert_eq!(l.finish(), vec![e(60, H), e(40, D)]);
        assert_eq!(ExtentList::<bool>::new(0, 1).finish(), vec![]);
    }

    #[test]
    fn flags_map_to_nbd_bits_and_coarsen_by_and() {
        assert_eq!((D.nbd_bits(), H.nbd_bits()), (0, 3));
        assert_eq!(ExtentFlags { hole: true, zero: false }.nbd_bits(), 1);
        assert_eq!(H.and(D), D);
        assert_eq!(H.and(H), H);
    }

    #[test]
    fn seek_extents_reports_holes_and_data_of_a_sparse_file() {
        let mut f = tempfile::tempfile().unwrap();
        f.set_len(4 << 20).unwrap();
        f.seek(SeekFrom::Start(1 << 20)).unwrap();
        f.write_all(&[7u8; 128 << 10]).unwrap();
        f.sync_all().unwrap();
        let fd = f.as_raw_fd();
        // (The temp directory's filesystem reports holes: ext4, xfs, btrfs and tmpfs do.)
        let v = seek_extents("t", fd, 0, 4 << 20, 4096, 16).unwrap();
        assert_eq!(v, vec![e(1 << 20, H), e(128 << 10, D), e((4 << 20) - (1 << 20) - (128 << 10), H)]);
        // From inside the data, bounded: one extent, then ask again.
        assert_eq!(seek_extents("t", fd, (1 << 20) + 4096, 3 << 20, 4096, 1).unwrap(), vec![e((128 << 10) - 4096, D)]);
        // Entirely inside a hole near the end, and a hole running to the range end.
        assert_eq!(seek_extents("t", fd, 3 << 20, 1 << 20, 4096, 16).unwrap(), vec![e(1 << 20, H)]);
        // A granularity coarser than the filesystem's: partial blocks count as data.
        let v = seek_extents("t", fd, 0, 4 << 20, 1 << 20, 16).unwrap();
        assert_eq!(v, vec![e(1 << 20, H), e(1 << 20, D), e(2 << 20, H)]);
    }
}
