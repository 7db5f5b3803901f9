//! A sparse in-memory device: 4 KiB pages allocated on first write, absent pages read as zero.
//!
//! Pages live in shards keyed by page index, each behind its own short lock, so concurrent
//! requests to different regions do not contend. It completes every operation immediately,
//! which makes it the deterministic base of the simulated disks (see `crash`, `fault`).

use std::collections::HashMap;
use std::io;

use parking_lot::Mutex;

use crate::buf::{IoBuf, SharedBuf};
use crate::device::{BlockDevice, IoFuture, IoOp, ReadResult, Topology, WriteFlags, ZeroFlags, check_io};
use crate::extent::{Extent, ExtentFlags, ExtentList, check_status_range};

const PAGE_BYTES: usize = 4096;
const SHARDS: usize = 64;

type Page = Box<[u8; PAGE_BYTES]>;

pub struct MemDevice {
    name: String,
    topology: Topology,
    shards: Vec<Mutex<HashMap<u64, Page>>>,
}

impl MemDevice {
    /// A zero-filled device of `size_bytes` (rounded down to 512) with 512-byte logical blocks.
    pub fn new(name: impl Into<String>, size_bytes: u64) -> MemDevice {
        MemDevice::with_topology(name, Topology::simple(size_bytes - size_bytes % 512))
    }

    pub fn with_topology(name: impl Into<String>, topology: Topology) -> MemDevice {
        MemDevice { name: name.into(), topology, shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect() }
    }

    /// A device whose contents are a copy of `image` (length rounded down to 512).
    pub fn from_image(name: impl Into<String>, image: &[u8]) -> MemDevice {
        let d = MemDevice::new(name, image.len() as u64);
        d.write_bytes(0, &image[..d.topology.size_bytes as usize]);
        d
    }

    fn shard(&self, page: u64) -> &Mutex<HashMap<u64, Page>> {
        &self.shards[(page as usize) % SHARDS]
    }

    /// Synchronous copy-out of `[offset, offset + out.len())`; no alignment requirement.
    pub fn read_bytes(&self, offset_bytes: u64, out: &mut [u8]) {
        let mut done = 0usize;
        while done < out.len() {
            let pos = offset_bytes + done as u64;
            let page = pos / PAGE_BYTES as u64;
            let in_page = (pos % PAGE_BYTES as u64) as usize;
            let n = (PAGE_BYTES - in_page).min(out.len() - done);
            let shard = self.shard(page).lock();
            match shard.get(&page) {
                Some(p) => out[done..done + n].copy_from_slice(&p[in_page..in_page + n]),
                None => out[done..done + n].fill(0),
            }
            done += n;
        }
    }

    /// Synchronous copy-in; no alignment requirement. All-zero writes to absent pages stay sparse.
    pub fn write_bytes(&self, offset_bytes: u64, data: &[u8]) {
        let mut done = 0usize;
        while done < data.len() {
            let pos = offset_bytes + done as u64;
            let page = pos / PAGE_BYTES as u64;
            let in_page = (pos % PAGE_BYTES as u64) as usize;
            let n = (PAGE_BYTES - in_page).min(data.len() - done);
            let src = &data[done..done + n];
            let mut shard = self.shard(page).lock();
            if let Some(p) = shard.get_mut(&page) {
                p[in_page..in_page + n].copy_from_slice(src);
            } else if src.iter().any(|&b| b != 0) {
                let mut p: Page = Box::new([0u8; PAGE_BYTES]);
                p[in_page..in_page + n].copy_from_slice(src);
                shard.insert(page, p);
            }
            done += n;
        }
    }

    /// Drops whole pages inside the range and zeroes the partial ones.
    pub fn zero_bytes(&self, offset_bytes: u64, len_bytes: u64) {
        let end = offset_bytes + len_bytes;
        let mut pos = offset_bytes;
        while pos < end {
            let page = pos / PAGE_BYTES as u64;
            let in_page = (pos % PAGE_BYTES as u64) as usize;
            let n = ((PAGE_BYTES - in_page) as u64).min(end - pos) as usize;
            let mut shard = self.shard(page).lock();
            if n == PAGE_BYTES {
                shard.remove(&page);
            } else if let Some(p) = shard.get_mut(&page) {
                p[in_page..in_page + n].fill(0);
            }
            pos += n as u64;
        }
    }

    /// The whole device contents as one vector (tests and crash images).
    pub fn to_image(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.topology.size_bytes as usize];
        for shard in &self.shards {
            for (&page, p) in shard.lock().iter() {
                let off = page as usize * PAGE_BYTES;
                let n = PAGE_BYTES.min(v.len() - off);
                v[off..off + n].copy_from_slice(&p[..n]);
            }
        }
        v
    }

    /// A copy of this device (contents and topology) under a new name; only allocated pages are
    /// copied, so it stays as sparse as the original.
    pub fn snapshot(&self, name: impl Into<String>) -> MemDevice {
        let copy = MemDevice::with_topology(name, self.topology);
        for (from, to) in self.shards.iter().zip(&copy.shards) {
            let pages = from.lock();
            let mut dst = to.lock();
            for (&page, p) in pages.iter() {
                dst.insert(page, p.clone());
            }
        }
        copy
    }

    /// True when both devices have the same size and contents.
    pub fn same_contents(&self, other: &MemDevice) -> bool {
        if self.topology.size_bytes != other.topology.size_bytes {
            return false;
        }
        let pages_of = |d: &MemDevice| {
            let mut v: Vec<u64> = d.shards.iter().flat_map(|s| s.lock().keys().copied().collect::<Vec<_>>()).collect();
            v.sort_unstable();
            v
        };
        let mut pages = pages_of(self);
        pages.extend(pages_of(other));
        pages.sort_unstable();
        pages.dedup();
        let (mut a, mut b) = ([0u8; PAGE_BYTES], [0u8; PAGE_BYTES]);
        for page in pages {
            let off = page * PAGE_BYTES as u64;
            let n = (PAGE_BYTES as u64).min(self.topology.size_bytes - off) as usize;
            self.read_bytes(off, &mut a[..n]);
            other.read_bytes(off, &mut b[..n]);
            if a[..n] != b[..n] {
                return false;
            }
        }
        true
    }

    fn page_extents(&self, offset_bytes: u64, len_bytes: u64, max_extents: usize) -> Vec<Extent> {
        let mut list = ExtentList::new(len_bytes, max_extents);
        let end = offset_bytes + len_bytes;
        let mut pos = offset_bytes;
        while pos < end {
            let page = pos / PAGE_BYTES as u64;
            let n = (page + 1) * PAGE_BYTES as u64 - pos;
            let present = self.shard(page).lock().contains_key(&page);
            let flags = if present { ExtentFlags::DATA } else { ExtentFlags::HOLE_ZERO };
            if !list.push(n, flags) {
                break;
            }
            pos += n;
        }
        list.finish()
    }

    /// Bytes backed by allocated pages.
    pub fn allocated_bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.lock().len() as u64).sum::<u64>() * PAGE_BYTES as u64
    }
}

impl BlockDevice for MemDevice {
    fn name(&self) -> &str {
        &self.name
    }

    fn topology(&self) -> Topology {
        self.topology
    }

    fn read(&self, offset_bytes: u64, mut buf: IoBuf) -> IoFuture<'_, ReadResult> {
        let r = check_io(&self.name, &self.topology, IoOp::Read, offset_bytes, buf.len() as u64);
        if r.is_ok() {
            self.read_bytes(offset_bytes, buf.as_mut_slice());
        }
        Box::pin(std::future::ready((buf, r)))
    }

    fn write(&self, offset_bytes: u64, buf: SharedBuf, _flags: WriteFlags) -> IoFuture<'_, io::Result<()>> {
        let r = check_io(&self.name, &self.topology, IoOp::Write, offset_bytes, buf.len() as u64);
        if r.is_ok() {
            self.write_bytes(offset_bytes, buf.as_slice());
        }
        Box::pin(std::future::ready(r))
    }

    fn flush(&self) -> IoFuture<'_, io::Result<()>> {
        Box::pin(std::future::ready(Ok(())))
    }

    fn discard(&self, offset_bytes: u64, len_bytes: u64) -> IoFuture<'_, io::Result<()>> {
        let r = check_io(&self.name, &self.topology, IoOp::Discard, offset_bytes, len_bytes);
        if r.is_ok() {
            self.zero_bytes(offset_bytes, len_bytes);
        }
        Box::pin(std::future::ready(r))
    }

    fn write_zeroes(&self, offset_bytes: u64, len_bytes: u64, _flags: ZeroFlags) -> IoFuture<'_, io::Result<()>> {
        let r = check_io(&self.name, &self.topology, IoOp::WriteZeroes, offset_bytes, len_bytes);
        if r.is_ok() {
            self.zero_bytes(offset_bytes, len_bytes);
        }
        Box::pin(std::future::ready(r))
    }

    /// Absent pages are holes that read as zeroes; present pages are data.
    fn block_status(
        &self,
        offset_bytes: u64,
        len_bytes: u64,
        max_extents: usize,
    ) -> IoFuture<'_, io::Result<Vec<Extent>>> {
        let r = check_status_range(&self.name, self.topology.size_bytes, offset_bytes, len_bytes)
            .map(|()| self.page_extents(offset_bytes, len_bytes, max_extents));
        Box::pin(std::future::ready(r))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::BlockDeviceExt;

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(f)
    }

    #[test]
    fn sparse_roundtrip_and_zeroes() {
        block_on(async {
            let d = MemDevice::new("mem", 1 << 20);
            assert_eq!(d.read_vec(0, 8192).await.unwrap(), vec![0u8; 8192]);
            d.write_slice(512, &[5u8; 1024], WriteFlags::NONE).await.unwrap();
            let v = d.read_vec(0, 4096).await.unwrap();
            assert!(v[..512].iter().all(|&b| b == 0));
            assert!(v[512..1536].iter().all(|&b| b == 5));
            assert!(v[1536..].iter().all(|&b| b == 0));
            assert_eq!(d.allocated_bytes(), 4096);
            d.write_zeroes(0, 4096, ZeroFlags::default()).await.unwrap();
            assert_eq!(d.allocated_bytes(), 0);
        });
    }

    #[test]
    fn bad_requests_fail_and_change_nothing() {
        block_on(async {
            let d = MemDevice::new("mem", 1 << 20);
            assert!(d.write_slice(1 << 20, &[1u8; 512], WriteFlags::NONE).await.is_err());
            assert!(d.write_slice(100, &[1u8; 512], WriteFlags::NONE).await.is_err());
            assert_eq!(d.allocated_bytes(), 0);
        });
    }
}
