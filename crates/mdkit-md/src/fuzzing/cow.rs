//! A copy-on-write view of a template member for `md_assemble`: reads fall through to the
//! shared template until a page is written, so an input pays for the pages its edits and the
//! assembly write (superblocks, bitmap, the test write), not for a copy of every template page.

use std::collections::HashMap;
use std::io;
use std::sync::{Arc, Mutex, MutexGuard};

use mdkit_io::{BlockDevice, IoBuf, IoFuture, IoOp, MemDevice, ReadResult, SharedBuf, Topology, WriteFlags, ZeroFlags};

const PAGE_BYTES: usize = 4096;
const ZERO_PAGE: [u8; PAGE_BYTES] = [0; PAGE_BYTES];

type Page = Box<[u8; PAGE_BYTES]>;

/// One member of one input: the template's pages plus the pages this input wrote.
pub(super) struct CowDevice {
    name: String,
    base: Arc<MemDevice>,
    written: Mutex<HashMap<u64, Page>>,
}

impl CowDevice {
    pub(super) fn new(name: String, base: Arc<MemDevice>) -> CowDevice {
        CowDevice { name, base, written: Mutex::new(HashMap::new()) }
    }

    fn written(&self) -> MutexGuard<'_, HashMap<u64, Page>> {
        self.written.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Calls `f(page, byte in page, range of the buffer)` for each page `[offset, +len)` touches.
    fn for_pages(offset_bytes: u64, len_bytes: usize, mut f: impl FnMut(u64, usize, std::ops::Range<usize>)) {
        let mut done = 0usize;
        while done < len_bytes {
            let pos = offset_bytes + done as u64;
            let in_page = (pos % PAGE_BYTES as u64) as usize;
            let n = (PAGE_BYTES - in_page).min(len_bytes - done);
            f(pos / PAGE_BYTES as u64, in_page, done..done + n);
            done += n;
        }
    }

    pub(super) fn read_bytes(&self, offset_bytes: u64, out: &mut [u8]) {
        let written = self.written();
        Self::for_pages(offset_bytes, out.len(), |page, at, r| match written.get(&page) {
            Some(p) => out[r.clone()].copy_from_slice(&p[at..at + r.len()]),
            None => self.base.read_bytes(offset_bytes + r.start as u64, &mut out[r]),
        });
    }

    pub(super) fn write_bytes(&self, offset_bytes: u64, data: &[u8]) {
        let mut written = self.written();
        Self::for_pages(offset_bytes, data.len(), |page, at, r| {
            let p = written.entry(page).or_insert_with(|| {
                let mut p: Page = Box::new(ZERO_PAGE);
                self.base.read_bytes(page * PAGE_BYTES as u64, &mut p[..]);
                p
            });
            p[at..at + r.len()].copy_from_slice(&data[r]);
        });
    }

    fn zero_bytes(&self, offset_bytes: u64, len_bytes: u64) {
        let mut at = offset_bytes;
        while at < offset_bytes + len_bytes {
            let n = (offset_bytes + len_bytes - at).min(PAGE_BYTES as u64);
            self.write_bytes(at, &ZERO_PAGE[..n as usize]);
            at += n;
        }
    }

    fn check(&self, op: IoOp, offset_bytes: u64, len_bytes: u64) -> io::Result<()> {
        mdkit_io::check_io(&self.name, &self.base.topology(), op, offset_bytes, len_bytes)
    }
}

impl BlockDevice for CowDevice {
    fn name(&self) -> &str {
        &self.name
    }

    fn topology(&self) -> Topology {
        self.base.topology()
    }

    fn read(&self, offset_bytes: u64, mut buf: IoBuf) -> IoFuture<'_, ReadResult> {
        let r = self.check(IoOp::Read, offset_bytes, buf.len() as u64);
        if r.is_ok() {
            self.read_bytes(offset_bytes, buf.as_mut_slice());
        }
        Box::pin(std::future::ready((buf, r)))
    }

    fn write(&self, offset_bytes: u64, buf: SharedBuf, _flags: WriteFlags) -> IoFuture<'_, io::Result<()>> {
        let r = self.check(IoOp::Write, offset_bytes, buf.len() as u64);
        if r.is_ok() {
            self.write_bytes(offset_bytes, buf.as_slice());
        }
        Box::pin(std::future::ready(r))
    }

    fn flush(&self) -> IoFuture<'_, io::Result<()>> {
        Box::pin(std::future::ready(Ok(())))
    }

    fn discard(&self, offset_bytes: u64, len_bytes: u64) -> IoFuture<'_, io::Result<()>> {
        let r = self.check(IoOp::Discard, offset_bytes, len_bytes);
        if r.is_ok() {
            self.zero_bytes(offset_bytes, len_bytes);
        }
        Box::pin(std::future::ready(r))
    }

    fn write_zeroes(&self, offset_bytes: u64, len_bytes: u64, _flags: ZeroFlags) -> IoFuture<'_, io::Result<()>> {
        let r = self.check(IoOp::WriteZeroes, offset_bytes, len_bytes);
        if r.is_ok() {
            self.zero_bytes(offset_bytes, len_bytes);
        }
        Box::pin(std::future::ready(r))
    }
}
