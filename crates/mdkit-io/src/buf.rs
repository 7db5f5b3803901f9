//! Owned, 4 KiB-aligned I/O buffers.
//!
//! io_uring and O_DIRECT need memory that stays put, aligned, until the kernel is done with it,
//! whatever happens to the future that asked for the I/O. So buffers are *owned*: they move into
//! a device call and come back with its completion. Two views exist over one aligned allocation:
//!
//! ```text
//!   IoBuf      unique, mutable view of [start, start+len)   -> reads fill it
//!   SharedBuf  shared, immutable view (Clone)                -> writes send it, to many members
//! ```
//!
//! An `IoBuf` can be split into disjoint `IoBuf`s (one per member read) and rejoined with
//! `unsplit`; `freeze` turns it into a `SharedBuf` without copying, and `SharedBuf::slice` cuts
//! sub-views for striping. Views never overlap a mutable view, which is what makes the raw
//! pointer access below sound.
//!
//! Allocations come from a small bounded pool per power-of-two size class, because a fresh
//! 1 MiB aligned allocation costs page faults on every request.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::fmt;
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::OnceLock;

use crossbeam_queue::ArrayQueue;

/// Alignment of every buffer: the largest logical block size we serve (4 KiB), which also
/// satisfies O_DIRECT on 512-byte devices.
pub const BUF_ALIGN: usize = 4096;

/// Size classes kept in the pool: 4 KiB << 0 ..= 4 KiB << 13 (32 MiB).
const POOL_CLASSES: usize = 14;
/// Total bytes the pool may keep per class (bounded memory, whatever the workload).
const POOL_BYTES_PER_CLASS: usize = 32 << 20;
/// Cap on buffers per class (small classes would otherwise keep thousands).
const POOL_MAX_BUFFERS_PER_CLASS: usize = 1024;

struct Alloc {
    ptr: NonNull<u8>,
    capacity_bytes: usize,
}

// SAFETY: `Alloc` is a plain heap allocation; concurrent access is governed by the views
// (`IoBuf` is unique over its range, `SharedBuf` is read-only), never by `Alloc` itself.
unsafe impl Send for Alloc {}
// SAFETY: see above; `Alloc` exposes no interior mutability of its own.
unsafe impl Sync for Alloc {}

impl Alloc {
    fn layout(capacity_bytes: usize) -> Layout {
        Layout::from_size_align(capacity_bytes, BUF_ALIGN).expect("buffer layout")
    }

    fn new(capacity_bytes: usize) -> Alloc {
        assert!(capacity_bytes > 0 && capacity_bytes.is_multiple_of(BUF_ALIGN));
        if let Some(class) = pool_class(capacity_bytes)
            && let Some(a) = pool().classes[class].pop()
        {
            debug_assert_eq!(a.capacity_bytes, capacity_bytes);
            return a;
        }
        // SAFETY: the layout has non-zero size (asserted above).
        let ptr = unsafe { alloc_zeroed(Self::layout(capacity_bytes)) };
        let ptr = NonNull::new(ptr).unwrap_or_else(|| std::alloc::handle_alloc_error(Self::layout(capacity_bytes)));
        Alloc { ptr, capacity_bytes }
    }
}

impl Drop for Alloc {
    fn drop(&mut self) {
        if let Some(class) = pool_class(self.capacity_bytes) {
            let a = Alloc { ptr: self.ptr, capacity_bytes: self.capacity_bytes };
            match pool().classes[class].push(a) {
                Ok(()) => {
                    // Ownership moved into the pool; make this husk inert.
                    self.capacity_bytes = 0;
                    return;
                }
                Err(a) => std::mem::forget(a),
            }
        }
        if self.capacity_bytes != 0 {
            // SAFETY: allocated in `Alloc::new` with exactly this layout, freed once.
            unsafe { dealloc(self.ptr.as_ptr(), Self::layout(self.capacity_bytes)) };
        }
    }
}

struct Pool {
    classes: Vec<ArrayQueue<Alloc>>,
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| Pool {
        classes: (0..POOL_CLASSES)
            .map(|c| {
                let per = (POOL_BYTES_PER_CLASS / (BUF_ALIGN << c)).clamp(1, POOL_MAX_BUFFERS_PER_CLASS);
                ArrayQueue::new(per)
            })
            .collect(),
    })
}

fn pool_class(capacity_bytes: usize) -> Option<usize> {
    if !capacity_bytes.is_power_of_two() || capacity_bytes < BUF_ALIGN {
        return None;
    }
    let class = (capacity_bytes / BUF_ALIGN).trailing_zeros() as usize;
    (class < POOL_CLASSES).then_some(class)
}

fn capacity_for(len: usize) -> usize {
    let aligned = len.max(1).next_multiple_of(BUF_ALIGN);
    if aligned <= BUF_ALIGN << (POOL_CLASSES - 1) { aligned.next_power_of_two() } else { aligned }
}

//------------------------------------------------------------------------------------------------

/// A unique, mutable view of part of an aligned allocation. The start of a fresh buffer is
/// 4 KiB aligned; sub-views produced by `split_*` are aligned where the split offset is.
pub struct IoBuf {
    alloc: Arc<Alloc>,
    start: usize,
    len: usize,
}

impl IoBuf {
    /// A buffer of `len` bytes, all zero.
    pub fn zeroed(len: usize) -> IoBuf {
        let mut b = IoBuf::uninit_contents(len);
        b.as_mut_slice().fill(0);
        b
    }

    /// A buffer of `len` bytes whose contents are unspecified (but initialised memory: pooled
    /// buffers hold old data). Use when the buffer is about to be filled completely.
    pub fn uninit_contents(len: usize) -> IoBuf {
        IoBuf { alloc: Arc::new(Alloc::new(capacity_for(len))), start: 0, len }
    }

    /// A buffer holding a copy of `data`.
    pub fn from_slice(data: &[u8]) -> IoBuf {
        let mut b = IoBuf::uninit_contents(data.len());
        b.as_mut_slice().copy_from_slice(data);
        b
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: [start, start+len) is inside the allocation and no mutable view overlaps it
        // except `self`, which is borrowed shared here.
        unsafe { std::slice::from_raw_parts(self.alloc.ptr.as_ptr().add(self.start), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: this view is the only one covering [start, start+len) (views are created
        // disjoint by `split_*` and never cloned) and `self` is borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.alloc.ptr.as_ptr().add(self.start), self.len) }
    }

    /// Raw pointer for handing to the kernel; valid for `len()` bytes while `self` lives.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        // SAFETY: start <= capacity.
        unsafe { self.alloc.ptr.as_ptr().add(self.start) }
    }

    /// Shrink the view to its first `len` bytes (the tail is dropped).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Splits off `[at, len)` and returns it; `self` keeps `[0, at)`. Panics if `at > len`.
    pub fn split_off(&mut self, at: usize) -> IoBuf {
        assert!(at <= self.len, "split_off {at} beyond {}", self.len);
        let tail = IoBuf { alloc: self.alloc.clone(), start: self.start + at, len: self.len - at };
        self.len = at;
        tail
    }

    /// Splits off `[0, at)` and returns it; `self` keeps `[at, len)`. Panics if `at > len`.
    pub fn split_to(&mut self, at: usize) -> IoBuf {
        assert!(at <= self.len, "split_to {at} beyond {}", self.len);
        let head = IoBuf { alloc: self.alloc.clone(), start: self.start, len: at };
        self.start += at;
        self.len -= at;
        head
    }

    /// Rejoins `other`, which must be the view directly after `self` in the same allocation
    /// (as produced by `split_off`); otherwise `other` is handed back.
    pub fn unsplit(&mut self, other: IoBuf) -> Result<(), IoBuf> {
        if Arc::ptr_eq(&self.alloc, &other.alloc) && self.start + self.len == other.start {
            self.len += other.len;
            Ok(())
        } else if self.is_empty() {
            *self = other;
            Ok(())
        } else {
            Err(other)
        }
    }

    /// Turns the view into an immutable, shareable one without copying.
    pub fn freeze(self) -> SharedBuf {
        SharedBuf { alloc: self.alloc, start: self.start, len: self.len }
    }
}

impl fmt::Debug for IoBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IoBuf({} bytes @ {})", self.len, self.start)
    }
}

//------------------------------------------------------------------------------------------------

/// An immutable, cheaply clonable view of part of an aligned allocation; what writes carry.
#[derive(Clone)]
pub struct SharedBuf {
    alloc: Arc<Alloc>,
    start: usize,
    len: usize,
}

impl SharedBuf {
    /// A shared buffer holding a copy of `data`.
    pub fn from_slice(data: &[u8]) -> SharedBuf {
        IoBuf::from_slice(data).freeze()
    }

    /// A shared buffer of `len` zero bytes.
    pub fn zeroed(len: usize) -> SharedBuf {
        IoBuf::zeroed(len).freeze()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: in bounds; no mutable view overlaps a frozen range (freeze consumed it).
        unsafe { std::slice::from_raw_parts(self.alloc.ptr.as_ptr().add(self.start), self.len) }
    }

    pub fn as_ptr(&self) -> *const u8 {
        // SAFETY: start <= capacity.
        unsafe { self.alloc.ptr.as_ptr().add(self.start) }
    }

    /// A sub-view; panics if `range` is outside this view.
    pub fn slice(&self, range: Range<usize>) -> SharedBuf {
        assert!(range.start <= range.end && range.end <= self.len, "slice {range:?} of {}", self.len);
        SharedBuf { alloc: self.alloc.clone(), start: self.start + range.start, len: range.len() }
    }

    /// Back to a mutable view when this is the only view of the allocation.
    pub fn try_into_mut(self) -> Result<IoBuf, SharedBuf> {
        if Arc::strong_count(&self.alloc) == 1 {
            Ok(IoBuf { alloc: self.alloc, start: self.start, len: self.len })
        } else {
            Err(self)
        }
    }

    /// A mutable copy (always succeeds; copies unless this is the only view).
    pub fn into_mut(self) -> IoBuf {
        self.try_into_mut().unwrap_or_else(|s| IoBuf::from_slice(s.as_slice()))
    }
}

impl fmt::Debug for SharedBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SharedBuf({} bytes @ {})", self.len, self.start)
    }
}

impl AsRef<[u8]> for SharedBuf {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl AsRef<[u8]> for IoBuf {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

//------------------------------------------------------------------------------------------------

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fresh_buffers_are_aligned_and_zeroed() {
        for len in [1usize, 512, 4096, 4097, 65536, 1 << 20, (32 << 20) + 4096] {
            let b = IoBuf::zeroed(len);
            assert_eq!(b.len(), len);
            assert_eq!(b.as_slice().as_ptr() as usize % BUF_ALIGN, 0);
            assert!(b.as_slice().iter().all(|&x| x == 0));
        }
    }

    #[test]
    fn split_fill_unsplit_roundtrip() {
        let mut b = IoBuf::zeroed(3 * 4096);
        let mut c = b.split_off(4096);
        let d = c.split_off(4096);
        assert_eq!((b.len(), c.len(), d.len()), (4096, 4096, 4096));
        b.as_mut_slice().fill(1);
        c.as_mut_slice().fill(2);
        let mut d = d;
        d.as_mut_slice().fill(3);
        b.unsplit(c).unwrap();
        b.unsplit(d).unwrap();
        assert_eq!(b.len(), 3 * 4096);
        assert!(b.as_slice()[..4096].iter().all(|&x| x == 1));
        assert!(b.as_slice()[4096..8192].iter().all(|&x| x == 2));
        assert!(b.as_slice()[8192..].iter().all(|&x| x == 3));
    }

    #[test]
    fn unsplit_refuses_foreign_or_non_adjacent_views() {
        let mut a = IoBuf::zeroed(8192);
        let b = IoBuf::zeroed(4096);
        assert!(a.unsplit(b).is_err());
        let mut x = IoBuf::zeroed(3 * 4096);
        let mut y = x.split_off(4096);
        let z = y.split_off(4096);
        assert!(x.unsplit(z).is_err());
    }

    #[test]
    fn freeze_slice_and_back() {
        let b = IoBuf::from_slice(&[7u8; 8192]).freeze();
        let s = b.slice(4096..8192);
        assert_eq!(s.len(), 4096);
        assert!(s.as_slice().iter().all(|&x| x == 7));
        assert!(s.clone().try_into_mut().is_err());
        drop(b);
        let m = s.try_into_mut().expect("sole view");
        assert_eq!(m.len(), 4096);
    }

    #[test]
    fn pooled_buffers_are_reused() {
        let p = IoBuf::zeroed(1 << 20).as_slice().as_ptr() as usize;
        let q = IoBuf::zeroed(1 << 20).as_slice().as_ptr() as usize;
        // Not guaranteed under parallel tests, but the pool must at least hand out aligned memory.
        assert_eq!(p % BUF_ALIGN, 0);
        assert_eq!(q % BUF_ALIGN, 0);
    }
}
