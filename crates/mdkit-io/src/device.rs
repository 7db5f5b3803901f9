//! The one block-device abstraction every layer speaks: member files, RAM disks, decorators,
//! md arrays and thin volumes all implement [`BlockDevice`], so any of them can stack on any
//! other and the NBD front end serves whichever it is given.
//!
//! Contract (every implementation, checked by [`check_io`]):
//! - offsets and lengths are bytes, multiples of `topology().logical_block_bytes`;
//! - a request must lie inside `[0, size_bytes)`; anything else fails with `InvalidInput`
//!   (reads) or `InvalidInput` (writes) and touches nothing — the process never panics on it;
//! - `write` with `fua` completes only when the data is durable; `flush` completes only when
//!   every write that *completed before the flush was issued* is durable;
//! - the buffer given to `read` comes back with the result, filled on success;
//! - a future may be dropped before it completes: the I/O then still runs to completion (the
//!   device keeps the buffer alive), its result is discarded.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;

use crate::buf::{IoBuf, SharedBuf};
use crate::extent::{Extent, ExtentFlags};

/// Boxed future returned by device operations (dyn-compatible, `Send`).
pub type IoFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Result of a read: the buffer always comes back, filled on `Ok`.
pub type ReadResult = (IoBuf, io::Result<()>);

/// Rejoins the results of a read split into pieces (`IoBuf::split_to`, in order) into one
/// buffer: `rest` is what remained after the splits (empty), `parts` the pieces' results in
/// order. The first error wins. Adjacent views of one allocation rejoin without copying; a
/// piece that is not adjacent (a backend that replaced the buffer) is copied, never dropped.
pub fn join_read_parts(rest: IoBuf, parts: impl IntoIterator<Item = ReadResult>) -> ReadResult {
    let mut whole = rest;
    let mut result = Ok(());
    for (part, r) in parts {
        if let Err(e) = r
            && result.is_ok()
        {
            result = Err(e);
        }
        if let Err(part) = whole.unsplit(part) {
            let mut joined = Vec::with_capacity(whole.len() + part.len());
            joined.extend_from_slice(whole.as_slice());
            joined.extend_from_slice(part.as_slice());
            whole = IoBuf::from_slice(&joined);
        }
    }
    (whole, result)
}

/// Shape and capabilities of a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Topology {
    /// Usable size in bytes (a multiple of `logical_block_bytes`).
    pub size_bytes: u64,
    /// Smallest addressable unit (512 or 4096).
    pub logical_block_bytes: u32,
    /// Smallest unit the device writes without an internal read-modify-write.
    pub physical_block_bytes: u32,
    /// Preferred I/O size; never smaller than 4096 for members (upstream md lesson 1).
    pub optimal_io_bytes: u32,
    /// Largest single request accepted.
    pub max_io_bytes: u32,
    /// FUA writes are native (otherwise the device emulates them with write + flush).
    pub supports_fua: bool,
    /// The device has a volatile cache, so `flush` matters.
    pub volatile_cache: bool,
    pub supports_discard: bool,
    pub supports_write_zeroes: bool,
    /// Discards are rounded inward to this granularity (bytes); 0 when unsupported.
    pub discard_granularity_bytes: u32,
    pub rotational: bool,
}

impl Topology {
    /// A plain 4 KiB-native device of `size_bytes` with every capability.
    pub fn simple(size_bytes: u64) -> Topology {
        Topology {
            size_bytes,
            logical_block_bytes: 512,
            physical_block_bytes: 4096,
            optimal_io_bytes: 4096,
            max_io_bytes: 32 << 20,
            supports_fua: true,
            volatile_cache: true,
            supports_discard: true,
            supports_write_zeroes: true,
            discard_granularity_bytes: 4096,
            rotational: false,
        }
    }

    pub fn sectors(&self) -> u64 {
        self.size_bytes / 512
    }
}

/// Flags on a write.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WriteFlags {
    /// Force Unit Access: complete only once durable.
    pub fua: bool,
}

impl WriteFlags {
    pub const NONE: WriteFlags = WriteFlags { fua: false };
    pub const FUA: WriteFlags = WriteFlags { fua: true };
}

/// Flags on a write-zeroes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ZeroFlags {
    pub fua: bool,
    /// The range must stay allocated (NBD NO_HOLE): do not punch/unmap.
    pub no_unmap: bool,
}

/// The block-device interface. Implementations must be cheap to call concurrently from many
/// tasks; each bounds its own in-flight work.
pub trait BlockDevice: Send + Sync + 'static {
    /// Human-readable name used in errors, traces and metrics (a path, "raid5:md0", ...).
    fn name(&self) -> &str;

    fn topology(&self) -> Topology;

    fn read(&self, offset_bytes: u64, buf: IoBuf) -> IoFuture<'_, ReadResult>;

    fn write(&self, offset_bytes: u64, buf: SharedBuf, flags: WriteFlags) -> IoFuture<'_, io::Result<()>>;

    fn flush(&self) -> IoFuture<'_, io::Result<()>>;

    /// Advisory unmap; content of the range is undefined afterwards until rewritten.
    fn discard(&self, offset_bytes: u64, len_bytes: u64) -> IoFuture<'_, io::Result<()>>;

    /// The range reads back as zeroes afterwards.
    fn write_zeroes(&self, offset_bytes: u64, len_bytes: u64, flags: ZeroFlags) -> IoFuture<'_, io::Result<()>>;

    /// Which parts of `[offset_bytes, offset_bytes + len_bytes)` are allocated and which read
    /// as zeroes: at most `max_extents` extents from `offset_bytes` covering a prefix of the
    /// range (see [`crate::extent`] for the contract). The range must lie inside the device;
    /// it need not be aligned. The default, for devices that cannot tell, is one allocated
    /// extent over the whole range, which is always correct.
    fn block_status(
        &self,
        offset_bytes: u64,
        len_bytes: u64,
        max_extents: usize,
    ) -> IoFuture<'_, io::Result<Vec<Extent>>> {
        let _ = (offset_bytes, max_extents);
        let all = if len_bytes == 0 { vec![] } else { vec![Extent { len_bytes, flags: ExtentFlags::DATA }] };
        Box::pin(std::future::ready(Ok(all)))
    }

    /// Which parts of the range differ from `base`, an earlier point-in-time version of this
    /// device that the device itself knows (a thin volume: a snapshot's thin id). `true` means
    /// changed (or not known to be unchanged). Same shape rules as [`Self::block_status`]; a
    /// zero-length range just checks that `base` can be compared against. Default:
    /// `Unsupported`.
    /// Reads the device's size again (a member file grown under the open device, a grown
    /// block device) and returns it in bytes; the device only grows. Default: the size does
    /// not change.
    fn refresh_size(&self) -> io::Result<u64> {
        Ok(self.topology().size_bytes)
    }

    fn changed_since(
        &self,
        base: u64,
        offset_bytes: u64,
        len_bytes: u64,
        max_extents: usize,
    ) -> IoFuture<'_, io::Result<Vec<Extent<bool>>>> {
        let _ = (base, offset_bytes, len_bytes, max_extents);
        let e = io::Error::new(
            io::ErrorKind::Unsupported,
            format!("{}: changed-block tracking is not supported by this device", self.name()),
        );
        Box::pin(std::future::ready(Err(e)))
    }
}

/// Shared handle used to stack devices chosen at run time.
pub type DeviceRef = Arc<dyn BlockDevice>;

/// Which operation a request is, for validation messages, traces and fault rules.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum IoOp {
    Read,
    Write,
    Flush,
    Discard,
    WriteZeroes,
}

impl IoOp {
    pub fn as_str(self) -> &'static str {
        match self {
            IoOp::Read => "read",
            IoOp::Write => "write",
            IoOp::Flush => "flush",
            IoOp::Discard => "discard",
            IoOp::WriteZeroes => "write_zeroes",
        }
    }
}

impl IoOp {
    /// Every operation, in declaration order (the order of [`PerOp`] fields).
    pub const ALL: [IoOp; 5] = [IoOp::Read, IoOp::Write, IoOp::Flush, IoOp::Discard, IoOp::WriteZeroes];

    /// Whether the operation changes device contents.
    pub fn modifies(self) -> bool {
        matches!(self, IoOp::Write | IoOp::Discard | IoOp::WriteZeroes)
    }
}

/// One value per operation kind (counters, histograms), indexed by [`IoOp`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PerOp<T> {
    pub read: T,
    pub write: T,
    pub flush: T,
    pub discard: T,
    pub write_zeroes: T,
}

impl<T> PerOp<T> {
    pub fn get(&self, op: IoOp) -> &T {
        match op {
            IoOp::Read => &self.read,
            IoOp::Write => &self.write,
            IoOp::Flush => &self.flush,
            IoOp::Discard => &self.discard,
            IoOp::WriteZeroes => &self.write_zeroes,
        }
    }

    pub fn get_mut(&mut self, op: IoOp) -> &mut T {
        match op {
            IoOp::Read => &mut self.read,
            IoOp::Write => &mut self.write,
            IoOp::Flush => &mut self.flush,
            IoOp::Discard => &mut self.discard,
            IoOp::WriteZeroes => &mut self.write_zeroes,
        }
    }

    /// `(op, value)` pairs in [`IoOp::ALL`] order.
    pub fn iter(&self) -> impl Iterator<Item = (IoOp, &T)> {
        IoOp::ALL.into_iter().map(move |op| (op, self.get(op)))
    }
}

/// Validates a request against a device's topology; every implementation calls this first.
/// Returns `InvalidInput` naming the device, op, offset and length.
pub fn check_io(name: &str, topo: &Topology, op: IoOp, offset_bytes: u64, len_bytes: u64) -> io::Result<()> {
    let lbs = u64::from(topo.logical_block_bytes.max(1));
    let fail = |why: &str| {
        Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{name}: {} of {len_bytes} bytes at offset {offset_bytes}: {why}", op.as_str()),
        ))
    };
    if !offset_bytes.is_multiple_of(lbs) || !len_bytes.is_multiple_of(lbs) {
        return fail(&format!("not aligned to the {lbs}-byte logical block"));
    }
    let Some(end) = offset_bytes.checked_add(len_bytes) else {
        return fail("offset + length overflows");
    };
    if end > topo.size_bytes {
        return fail(&format!("beyond the end of the device ({} bytes)", topo.size_bytes));
    }
    if matches!(op, IoOp::Read | IoOp::Write) && len_bytes > u64::from(topo.max_io_bytes) {
        return fail(&format!("longer than the {}-byte maximum I/O", topo.max_io_bytes));
    }
    Ok(())
}

/// An `io::Error` for an operation that the device does not support.
pub fn unsupported(name: &str, op: IoOp) -> io::Error {
    io::Error::new(io::ErrorKind::Unsupported, format!("{name}: {} is not supported", op.as_str()))
}

/// Convenience wrappers for callers that hold plain slices (tests, metadata code). They copy.
pub trait BlockDeviceExt: BlockDevice {
    /// Reads `len` bytes at `offset_bytes` into a fresh buffer. A read that comes back short
    /// is a typed [`IoErrorKind::ShortRead`](crate::IoErrorKind) error, never a shorter vector.
    fn read_vec(&self, offset_bytes: u64, len: usize) -> IoFuture<'_, io::Result<Vec<u8>>> {
        Box::pin(async move {
            let (buf, r) = self.read(offset_bytes, IoBuf::uninit_contents(len)).await;
            r?;
            if buf.len() != len {
                let e = crate::DeviceError::new(
                    crate::IoErrorKind::ShortRead,
                    self.name(),
                    IoOp::Read,
                    offset_bytes,
                    len as u64,
                )
                .detail(format!("{} of {len} bytes", buf.len()));
                return Err(e.into());
            }
            Ok(buf.as_slice().to_vec())
        })
    }

    /// [`read_vec`](Self::read_vec) for metadata (superblocks, bitmaps, logs) read outside the
    /// data path: a failed or short read is tried once more before its error is returned, so
    /// one transient fault does not turn a member away at assembly or re-add (what is read is
    /// validated by its own checks anyway).
    fn read_metadata(&self, offset_bytes: u64, len: usize) -> IoFuture<'_, io::Result<Vec<u8>>> {
        Box::pin(async move {
            match self.read_vec(offset_bytes, len).await {
                Ok(v) => Ok(v),
                Err(e) => {
                    tracing::warn!(
                        device = self.name(),
                        offset_bytes,
                        len,
                        "metadata read failed, trying once more: {e}"
                    );
                    self.read_vec(offset_bytes, len).await
                }
            }
        })
    }

    /// Writes a copy of `data` at `offset_bytes`.
    fn write_slice<'a>(&'a self, offset_bytes: u64, data: &[u8], flags: WriteFlags) -> IoFuture<'a, io::Result<()>> {
        let buf = SharedBuf::from_slice(data);
        self.write(offset_bytes, buf, flags)
    }
}

impl<T: BlockDevice + ?Sized> BlockDeviceExt for T {}

impl<T: BlockDevice + ?Sized> BlockDevice for Arc<T> {
    fn name(&self) -> &str {
        (**self).name()
    }
    fn topology(&self) -> Topology {
        (**self).topology()
    }
    fn read(&self, offset_bytes: u64, buf: IoBuf) -> IoFuture<'_, ReadResult> {
        (**self).read(offset_bytes, buf)
    }
    fn write(&self, offset_bytes: u64, buf: SharedBuf, flags: WriteFlags) -> IoFuture<'_, io::Result<()>> {
        (**self).write(offset_bytes, buf, flags)
    }
    fn flush(&self) -> IoFuture<'_, io::Result<()>> {
        (**self).flush()
    }
    fn discard(&self, offset_bytes: u64, len_bytes: u64) -> IoFuture<'_, io::Result<()>> {
        (**self).discard(offset_bytes, len_bytes)
    }
    fn write_zeroes(&self, offset_bytes: u64, len_bytes: u64, flags: ZeroFlags) -> IoFuture<'_, io::Result<()>> {
        (**self).write_zeroes(offset_bytes, len_bytes, flags)
    }
    fn block_status(
        &self,
        offset_bytes: u64,
        len_bytes: u64,
        max_extents: usize,
    ) -> IoFuture<'_, io::Result<Vec<Extent>>> {
        (**self).block_status(offset_bytes, len_bytes, max_extents)
    }
    fn changed_since(
        &self,
        base: u64,
        offset_bytes: u64,
        len_bytes: u64,
        max_extents: usize,
    ) -> IoFuture<'_, io::Result<Vec<Extent<bool>>>> {
        (**self).changed_since(base, offset_bytes, len_bytes, max_extents)
    }
    fn refresh_size(&self) -> io::Result<u64> {
        (**self).refresh_size()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_io_rejects_misaligned_out_of_range_and_overflow() {
        let t = Topology::simple(1 << 20);
        assert!(check_io("d", &t, IoOp::Read, 0, 4096).is_ok());
        assert!(check_io("d", &t, IoOp::Read, (1 << 20) - 512, 512).is_ok());
        for (off, len) in [(1, 512), (0, 511), ((1 << 20) - 512, 1024), (u64::MAX - 511, 512)] {
            let e = check_io("d", &t, IoOp::Write, off, len).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{off} {len}");
        }
        assert!(check_io("d", &t, IoOp::Read, 0, 64 << 20).is_err());
        assert!(check_io("d", &t, IoOp::Discard, 0, 1 << 20).is_ok());
    }

    #[test]
    fn join_read_parts_rejoins_in_order_copies_strangers_and_keeps_the_first_error() {
        let mut buf = IoBuf::zeroed(3 * 4096);
        let mut parts = Vec::new();
        for i in 0..3u8 {
            let mut p = buf.split_to(4096);
            p.as_mut_slice().fill(i + 1);
            parts.push(p);
        }
        // A backend that returned a fresh buffer for the middle piece.
        let stranger = IoBuf::from_slice(&[9u8; 4096]);
        let results = vec![
            (parts.remove(0), Ok(())),
            (stranger, Err(io::Error::other("first"))),
            (parts.remove(0), Ok(())),
            (parts.remove(0), Err(io::Error::other("second"))),
        ];
        let (whole, r) = join_read_parts(buf, results);
        assert_eq!(r.unwrap_err().to_string(), "first");
        let v = whole.as_slice();
        assert_eq!(v.len(), 4 * 4096);
        assert!(v[..4096].iter().all(|&x| x == 1));
        assert!(v[4096..8192].iter().all(|&x| x == 9));
        assert!(v[8192..12288].iter().all(|&x| x == 2));
        assert!(v[12288..].iter().all(|&x| x == 3));
        // Adjacent pieces come back as the caller's own allocation, uncopied.
        let mut buf = IoBuf::zeroed(8192);
        let start = buf.as_slice().as_ptr();
        let a = buf.split_to(4096);
        let b = buf.split_to(4096);
        let (whole, r) = join_read_parts(buf, vec![(a, Ok(())), (b, Ok(()))]);
        assert!(r.is_ok() && whole.len() == 8192 && whole.as_slice().as_ptr() == start);
    }
}
