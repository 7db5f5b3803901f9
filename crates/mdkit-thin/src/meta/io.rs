//! The metadata engine's view of its device: whole 4 KiB blocks, synchronous.
//!
//! [`MetaIo`] has three implementations:
//! - [`FileMetaIo`]: a plain `std::fs::File` (offline tools, `mdkit thin check FILE`, tests);
//! - [`DeviceMetaIo`]: any `mdkit_io::BlockDevice`, bridged from async with
//!   `Handle::block_on`. Call it from a dedicated (non-runtime) thread: the pool runtime runs
//!   metadata work on its own worker thread, like dm-thin's worker;
//! - [`MemMetaIo`]: RAM, with counters and a write hook for tests and simulations.
//!
//! Every write is one or more whole, aligned 4 KiB blocks (runs of adjacent blocks are merged
//! into one request, up to [`MAX_WRITE_RUN_BLOCKS`]).

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use mdkit_io::{DeviceLock, DeviceRef, IoBuf, SharedBuf, WriteFlags};
use parking_lot::Mutex;

use crate::meta::block::{BLOCK_SIZE, BlockBuf};

/// Longest run of adjacent blocks merged into one write request (1 MiB).
pub const MAX_WRITE_RUN_BLOCKS: usize = 256;
/// Write requests kept in flight by [`DeviceMetaIo`].
const MAX_WRITES_IN_FLIGHT: usize = 32;

/// Synchronous whole-block access to a metadata device.
pub trait MetaIo: Send + Sync {
    /// Name used in errors (a path or device name).
    fn name(&self) -> &str;
    /// Device size in 4 KiB blocks.
    fn nr_blocks(&self) -> u64;
    /// Reads block `block` into `out`.
    fn read_block(&self, block: u64, out: &mut BlockBuf) -> io::Result<()>;
    /// Writes the given blocks (any order, no duplicates). Durable only after `flush`.
    fn write_blocks(&self, blocks: &[(u64, &BlockBuf)]) -> io::Result<()>;
    /// Makes every completed write durable.
    fn flush(&self) -> io::Result<()>;
}

/// Splits sorted `(block, data)` pairs into runs of adjacent blocks, each at most
/// [`MAX_WRITE_RUN_BLOCKS`] long, and calls `f(first_block, concatenated_bytes)` per run.
fn for_each_run(blocks: &[(u64, &BlockBuf)], mut f: impl FnMut(u64, &[u8]) -> io::Result<()>) -> io::Result<()> {
    let mut sorted: Vec<(u64, &BlockBuf)> = blocks.to_vec();
    sorted.sort_unstable_by_key(|(b, _)| *b);
    let mut run: Vec<u8> = Vec::with_capacity(MAX_WRITE_RUN_BLOCKS * BLOCK_SIZE);
    let mut run_start = 0u64;
    let mut run_len = 0u64;
    for (b, data) in sorted {
        if run_len > 0 && (b != run_start + run_len || run_len as usize >= MAX_WRITE_RUN_BLOCKS) {
            f(run_start, &run)?;
            run.clear();
            run_len = 0;
        }
        if run_len == 0 {
            run_start = b;
        }
        run.extend_from_slice(data);
        run_len += 1;
    }
    if run_len > 0 {
        f(run_start, &run)?;
    }
    Ok(())
}

fn out_of_range(name: &str, block: u64, nr_blocks: u64) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("{name}: metadata block {block} is beyond the end of the device ({nr_blocks} blocks)"),
    )
}

//------------------------------------------------------------------------------------------------

/// Metadata on a plain file or block device through `std::fs::File` (pread/pwrite, fdatasync).
pub struct FileMetaIo {
    name: String,
    file: File,
    nr_blocks: u64,
    /// Held while open for writing: a device a running service (another process) writes is
    /// refused, and none opens this one meanwhile (see `mdkit_io::lock`).
    _lock: Option<DeviceLock>,
}

impl FileMetaIo {
    /// Opens `path`; its size (rounded down to 4 KiB) is the metadata device size. `writable`
    /// takes the device's exclusive lock first: a device another process holds (a running
    /// pool) fails with `ResourceBusy` ([`mdkit_io::lock::is_busy`]) before anything is read.
    pub fn open(path: &Path, writable: bool) -> io::Result<FileMetaIo> {
        let name = path.display().to_string();
        let file = std::fs::OpenOptions::new().read(true).write(writable).open(path)?;
        let lock = writable.then(|| DeviceLock::exclusive(&file, &name)).transpose()?;
        let mut io = FileMetaIo::from_file(file, name)?;
        io._lock = lock;
        Ok(io)
    }

    pub fn from_file(file: File, name: impl Into<String>) -> io::Result<FileMetaIo> {
        let name = name.into();
        let meta = file.metadata()?;
        let size_bytes = if meta.file_type().is_file() {
            meta.len()
        } else {
            // Block devices report 0 in metadata(); seek to the end instead.
            use std::io::Seek;
            let mut f = &file;
            f.seek(io::SeekFrom::End(0))?
        };
        Ok(FileMetaIo { name, file, nr_blocks: size_bytes / BLOCK_SIZE as u64, _lock: None })
    }
}

impl MetaIo for FileMetaIo {
    fn name(&self) -> &str {
        &self.name
    }

    fn nr_blocks(&self) -> u64 {
        self.nr_blocks
    }

    fn read_block(&self, block: u64, out: &mut BlockBuf) -> io::Result<()> {
        if block >= self.nr_blocks {
            return Err(out_of_range(&self.name, block, self.nr_blocks));
        }
        self.file.read_exact_at(out, block * BLOCK_SIZE as u64)
    }

    fn write_blocks(&self, blocks: &[(u64, &BlockBuf)]) -> io::Result<()> {
        if let Some((b, _)) = blocks.iter().find(|(b, _)| *b >= self.nr_blocks) {
            return Err(out_of_range(&self.name, *b, self.nr_blocks));
        }
        for_each_run(blocks, |start, bytes| self.file.write_all_at(bytes, start * BLOCK_SIZE as u64))
    }

    fn flush(&self) -> io::Result<()> {
        self.file.sync_data()
    }
}

//------------------------------------------------------------------------------------------------

/// Metadata on an `mdkit_io::BlockDevice`. Every call blocks the calling thread on `handle`;
/// it must not be called from inside an async task (that returns an error instead of
/// deadlocking or panicking).
///
/// Its size follows the device's current size, so a metadata device grown while the pool runs
/// (see `Pool::resize_metadata`) becomes usable without reopening.
pub struct DeviceMetaIo {
    dev: DeviceRef,
    handle: tokio::runtime::Handle,
}

impl DeviceMetaIo {
    pub fn new(dev: DeviceRef, handle: tokio::runtime::Handle) -> DeviceMetaIo {
        DeviceMetaIo { dev, handle }
    }

    fn check_thread(&self) -> io::Result<()> {
        if tokio::runtime::Handle::try_current().is_ok() {
            return Err(io::Error::other(format!(
                "{}: metadata I/O issued from inside the async runtime; run the metadata engine on a dedicated thread",
                self.dev.name()
            )));
        }
        Ok(())
    }
}

impl MetaIo for DeviceMetaIo {
    fn name(&self) -> &str {
        self.dev.name()
    }

    fn nr_blocks(&self) -> u64 {
        self.dev.topology().size_bytes / BLOCK_SIZE as u64
    }

    fn read_block(&self, block: u64, out: &mut BlockBuf) -> io::Result<()> {
        self.check_thread()?;
        let nr_blocks = self.nr_blocks();
        if block >= nr_blocks {
            return Err(out_of_range(self.dev.name(), block, nr_blocks));
        }
        let (buf, r) =
            self.handle.block_on(self.dev.read(block * BLOCK_SIZE as u64, IoBuf::uninit_contents(BLOCK_SIZE)));
        r?;
        out.copy_from_slice(buf.as_slice());
        Ok(())
    }

    fn write_blocks(&self, blocks: &[(u64, &BlockBuf)]) -> io::Result<()> {
        self.check_thread()?;
        let nr_blocks = self.nr_blocks();
        if let Some((b, _)) = blocks.iter().find(|(b, _)| *b >= nr_blocks) {
            return Err(out_of_range(self.dev.name(), *b, nr_blocks));
        }
        let mut runs: Vec<(u64, SharedBuf)> = Vec::new();
        for_each_run(blocks, |start, bytes| {
            runs.push((start * BLOCK_SIZE as u64, SharedBuf::from_slice(bytes)));
            Ok(())
        })?;
        self.handle.block_on(async {
            let mut set = tokio::task::JoinSet::new();
            let mut first_err: Option<io::Error> = None;
            for (offset_bytes, buf) in runs {
                while set.len() >= MAX_WRITES_IN_FLIGHT {
                    if let Some(r) = set.join_next().await {
                        keep_first_error(&mut first_err, r);
                    }
                }
                let dev = self.dev.clone();
                set.spawn(async move { dev.write(offset_bytes, buf, WriteFlags::NONE).await });
            }
            while let Some(r) = set.join_next().await {
                keep_first_error(&mut first_err, r);
            }
            first_err.map_or(Ok(()), Err)
        })
    }

    fn flush(&self) -> io::Result<()> {
        self.check_thread()?;
        self.handle.block_on(self.dev.flush())
    }
}

fn keep_first_error(first: &mut Option<io::Error>, r: Result<io::Result<()>, tokio::task::JoinError>) {
    let e = match r {
        Ok(Ok(())) => return,
        Ok(Err(e)) => e,
        Err(join) => io::Error::other(format!("metadata write task failed: {join}")),
    };
    if first.is_none() {
        *first = Some(e);
    }
}

//------------------------------------------------------------------------------------------------

/// A write observed by [`MemMetaIo`]'s hook: `Some(blocks)` for a write, `None` for a flush.
pub type WriteHook = Box<dyn Fn(Option<&[(u64, &BlockBuf)]>) -> io::Result<()> + Send + Sync>;

/// Metadata in RAM (sparse), with I/O counters and an optional hook that sees (and may fail)
/// every write and flush before it is applied.
pub struct MemMetaIo {
    name: String,
    nr_blocks: u64,
    blocks: Mutex<std::collections::HashMap<u64, Box<BlockBuf>>>,
    hook: Mutex<Option<Arc<WriteHook>>>,
    pub reads: AtomicU64,
    pub writes: AtomicU64,
    pub flushes: AtomicU64,
}

impl MemMetaIo {
    pub fn new(name: impl Into<String>, nr_blocks: u64) -> MemMetaIo {
        MemMetaIo {
            name: name.into(),
            nr_blocks,
            blocks: Mutex::new(std::collections::HashMap::new()),
            hook: Mutex::new(None),
            reads: AtomicU64::new(0),
            writes: AtomicU64::new(0),
            flushes: AtomicU64::new(0),
        }
    }

    /// A device holding a copy of `image` (length rounded down to whole blocks).
    pub fn from_image(name: impl Into<String>, image: &[u8]) -> MemMetaIo {
        let io = MemMetaIo::new(name, (image.len() / BLOCK_SIZE) as u64);
        {
            let mut m = io.blocks.lock();
            for (i, chunk) in image.chunks_exact(BLOCK_SIZE).enumerate() {
                if chunk.iter().any(|&b| b != 0) {
                    let mut blk = Box::new([0u8; BLOCK_SIZE]);
                    blk.copy_from_slice(chunk);
                    m.insert(i as u64, blk);
                }
            }
        }
        io
    }

    /// The whole device contents.
    pub fn to_image(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.nr_blocks as usize * BLOCK_SIZE];
        for (&b, data) in self.blocks.lock().iter() {
            let off = b as usize * BLOCK_SIZE;
            v[off..off + BLOCK_SIZE].copy_from_slice(&data[..]);
        }
        v
    }

    /// Installs (or removes) the write/flush hook.
    pub fn set_hook(&self, hook: Option<WriteHook>) {
        *self.hook.lock() = hook.map(Arc::new);
    }

    /// Direct access for tests that corrupt blocks on purpose.
    pub fn poke(&self, block: u64, data: &BlockBuf) {
        self.blocks.lock().insert(block, Box::new(*data));
    }

    pub fn peek(&self, block: u64) -> Box<BlockBuf> {
        self.blocks.lock().get(&block).cloned().unwrap_or_else(|| Box::new([0u8; BLOCK_SIZE]))
    }
}

impl MetaIo for MemMetaIo {
    fn name(&self) -> &str {
        &self.name
    }

    fn nr_blocks(&self) -> u64 {
        self.nr_blocks
    }

    fn read_block(&self, block: u64, out: &mut BlockBuf) -> io::Result<()> {
        if block >= self.nr_blocks {
            return Err(out_of_range(&self.name, block, self.nr_blocks));
        }
        self.reads.fetch_add(1, Ordering::Relaxed);
        match self.blocks.lock().get(&block) {
            Some(b) => out.copy_from_slice(&b[..]),
            None => out.fill(0),
        }
        Ok(())
    }

    fn write_blocks(&self, blocks: &[(u64, &BlockBuf)]) -> io::Result<()> {
        if let Some((b, _)) = blocks.iter().find(|(b, _)| *b >= self.nr_blocks) {
            return Err(out_of_range(&self.name, *b, self.nr_blocks));
        }
        let hook = self.hook.lock().clone();
        if let Some(h) = hook {
            h(Some(blocks))?;
        }
        self.writes.fetch_add(blocks.len() as u64, Ordering::Relaxed);
        let mut m = self.blocks.lock();
        for (b, data) in blocks {
            m.insert(*b, Box::new(**data));
        }
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        let hook = self.hook.lock().clone();
        if let Some(h) = hook {
            h(None)?;
        }
        self.flushes.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

impl<T: MetaIo + ?Sized> MetaIo for Arc<T> {
    fn name(&self) -> &str {
        (**self).name()
    }
    fn nr_blocks(&self) -> u64 {
        (**self).nr_blocks()
    }
    fn read_block(&self, block: u64, out: &mut BlockBuf) -> io::Result<()> {
        (**self).read_block(block, out)
    }
    fn write_blocks(&self, blocks: &[(u64, &BlockBuf)]) -> io::Result<()> {
        (**self).write_blocks(blocks)
    }
    fn flush(&self) -> io::Result<()> {
        (**self).flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_merge_adjacent_blocks_only() {
        let a = [1u8; BLOCK_SIZE];
        let b = [2u8; BLOCK_SIZE];
        let c = [3u8; BLOCK_SIZE];
        let mut seen = Vec::new();
        for_each_run(&[(5, &b), (4, &a), (9, &c)], |start, bytes| {
            seen.push((start, bytes.len() / BLOCK_SIZE, bytes[0]));
            Ok(())
        })
        .unwrap();
        assert_eq!(seen, vec![(4, 2, 1), (9, 1, 3)]);
    }

    #[test]
    fn file_io_roundtrip_and_range_check() {
        let f = tempfile::tempfile().unwrap();
        f.set_len(8 * BLOCK_SIZE as u64).unwrap();
        let io = FileMetaIo::from_file(f, "tmp").unwrap();
        assert_eq!(io.nr_blocks(), 8);
        let x = [7u8; BLOCK_SIZE];
        io.write_blocks(&[(3, &x), (2, &x)]).unwrap();
        io.flush().unwrap();
        let mut out = [0u8; BLOCK_SIZE];
        io.read_block(3, &mut out).unwrap();
        assert_eq!(out, x);
        assert!(io.read_block(8, &mut out).is_err());
        assert!(io.write_blocks(&[(8, &x)]).is_err());
    }

    #[test]
    fn device_io_over_mem_device_from_a_plain_thread() {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).build().unwrap();
        let dev: DeviceRef = Arc::new(mdkit_io::MemDevice::new("mem", 16 * BLOCK_SIZE as u64));
        let io = DeviceMetaIo::new(dev, rt.handle().clone());
        let x = [9u8; BLOCK_SIZE];
        io.write_blocks(&[(1, &x), (2, &x), (7, &x)]).unwrap();
        io.flush().unwrap();
        let mut out = [0u8; BLOCK_SIZE];
        io.read_block(7, &mut out).unwrap();
        assert_eq!(out, x);
        // From inside the runtime it refuses instead of panicking.
        let io = Arc::new(io);
        let io2 = io.clone();
        let r = rt.block_on(async move {
            let mut o = [0u8; BLOCK_SIZE];
            io2.read_block(1, &mut o)
        });
        assert!(r.is_err());
    }
}
