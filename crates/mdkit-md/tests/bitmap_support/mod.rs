//! Shared fixtures for the write-intent bitmap tests: member layout, array description, a
//! failure recorder and the write-intent oracle.
//!
//! Member layout (all simulated members):
//! ```text
//!  0      4 KiB     8 KiB (BITMAP_OFFSET)          DATA_BASE (1 MiB)
//!  | free | "sb"   | bitmap sb + bits ... (space)  | data stand-ins: chunk c at DATA_BASE + c * 4 KiB
//! ```
//! A "data write" in these tests is one 4 KiB write per member at the chunk's stand-in block,
//! issued between `start_write` and `end_write` exactly as a personality issues its member
//! writes; the oracle recognises them by offset.
#![allow(dead_code)] // each test binary uses a different subset

use std::collections::HashMap;
use std::io;
use std::sync::Arc;

use mdkit_io::{BlockDevice, DeviceRef, IoBuf, IoFuture, ReadResult, SharedBuf, Topology, WriteFlags, ZeroFlags};
use mdkit_md::array::bitmap::{BitmapArrayInfo, BitmapMember, FailFn};
use mdkit_md::format::bitmap::BitmapGeometry;
use mdkit_md::format::superblock::MAX_SECTOR;
use parking_lot::Mutex;

pub const BITMAP_OFFSET: u64 = 8192;
pub const DATA_BASE: u64 = 1 << 20;
pub const UUID: [u8; 16] = [0x5e, 0x1f, 0x00, 0x42, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12];

/// Sectors per chunk in the sync domain for a chunk of `chunk_bytes`.
pub fn chunk_sectors(chunk_bytes: u32) -> u64 {
    u64::from(chunk_bytes) / 512
}

/// An array description with `chunks` chunks of `chunk_bytes`.
pub fn array_info(chunks: u64, chunk_bytes: u32) -> BitmapArrayInfo {
    BitmapArrayInfo {
        name: "md-test".into(),
        set_uuid: UUID,
        events: 10,
        resync_offset_sectors: MAX_SECTOR,
        sync_size_sectors: chunks * chunk_sectors(chunk_bytes),
        degraded: false,
    }
}

/// Device size that holds the data stand-ins of `chunks` chunks.
pub fn device_bytes(chunks: u64) -> u64 {
    DATA_BASE + chunks * 4096 + (1 << 20)
}

/// The sync-domain sector range of chunk `c`.
pub fn chunk_range(c: u64, chunk_bytes: u32) -> std::ops::Range<u64> {
    let s = chunk_sectors(chunk_bytes);
    c * s..(c + 1) * s
}

pub fn member(slot: u32, dev: DeviceRef, space_bytes: u64) -> BitmapMember {
    BitmapMember { slot, dev, bitmap_offset_bytes: BITMAP_OFFSET, space_bytes }
}

/// Records member failures reported by the bitmap.
#[derive(Clone, Default)]
pub struct Failures(pub Arc<Mutex<Vec<(u32, String)>>>);

impl Failures {
    pub fn callback(&self) -> FailFn {
        let me = self.clone();
        Arc::new(move |slot, e| me.0.lock().push((slot, e.to_string())))
    }

    pub fn slots(&self) -> Vec<u32> {
        self.0.lock().iter().map(|(s, _)| *s).collect()
    }
}

/// Issues the data stand-in writes of chunk `c` to every device (what a mirror does).
pub async fn data_write(devs: &[DeviceRef], c: u64, fua: bool) -> io::Result<()> {
    let buf = SharedBuf::from_slice(&[c as u8 | 1; 4096]);
    let flags = if fua { WriteFlags::FUA } else { WriteFlags::NONE };
    for d in devs {
        d.write(DATA_BASE + c * 4096, buf.clone(), flags).await?;
    }
    Ok(())
}

pub async fn flush_all(devs: &[DeviceRef]) -> io::Result<()> {
    for d in devs {
        d.flush().await?;
    }
    Ok(())
}

/// Reads chunk `c`'s bit from `dev`'s bitmap area as it is on the device now.
pub fn bit_on(area: &[u8], geo: &BitmapGeometry, c: u64) -> bool {
    mdkit_md::format::bitmap::test_bit(area, geo, c).expect("chunk inside the bitmap")
}

//------------------------------------------------------------------------------------------------
// The write-intent oracle.

/// One write to a bitmap block as the oracle tracks it.
struct BlockWrite {
    complete_seq: u64,
    data: Vec<u8>,
    durable: bool,
}

#[derive(Default)]
struct MemberTrack {
    /// Per bitmap block offset: completed writes (oldest first).
    blocks: HashMap<u64, Vec<BlockWrite>>,
    /// Outstanding flushes: completion sequence at their issue.
    flush_tokens: Vec<u64>,
}

impl MemberTrack {
    fn durable(&self, block: u64) -> Option<&[u8]> {
        self.blocks.get(&block)?.iter().rev().find(|w| w.durable).map(|w| w.data.as_slice())
    }
}

#[derive(Default)]
struct OracleState {
    seq: u64,
    members: Vec<MemberTrack>,
    /// Members whose copy must hold the bit (in the array); a failed member is removed.
    required: Vec<bool>,
    violations: Vec<String>,
    data_writes_checked: u64,
}

/// Checks the write-intent guarantee on the members it wraps: when a data stand-in write is
/// issued to any member, the covering bit must be durable (FUA write completed, or a completed
/// flush issued after the write completed) in the bitmap of every required member. Initial
/// contents (before wrapping) count as durable: pass them with [`Oracle::seed`].
#[derive(Clone)]
pub struct Oracle {
    state: Arc<Mutex<OracleState>>,
    geo: BitmapGeometry,
}

impl Oracle {
    pub fn new(geo: BitmapGeometry) -> Oracle {
        Oracle { state: Arc::new(Mutex::new(OracleState::default())), geo }
    }

    /// Wraps a device as the next member.
    pub fn wrap(&self, inner: DeviceRef) -> OracleDevice {
        let mut s = self.state.lock();
        s.members.push(MemberTrack::default());
        s.required.push(true);
        OracleDevice { oracle: self.clone(), member: s.members.len() - 1, inner }
    }

    /// Records the initial durable content of a bitmap block of `member`.
    pub fn seed(&self, member: usize, block_offset: u64, data: Vec<u8>) {
        let mut s = self.state.lock();
        s.members[member].blocks.insert(block_offset, vec![BlockWrite { complete_seq: 0, data, durable: true }]);
    }

    /// Whether `member` must hold every bit from now on.
    pub fn set_required(&self, member: usize, required: bool) {
        self.state.lock().required[member] = required;
    }

    pub fn violations(&self) -> Vec<String> {
        self.state.lock().violations.clone()
    }

    /// Fails with the number of violations and the first few.
    pub fn assert_clean(&self) {
        let v = self.violations();
        assert!(v.is_empty(), "{} write-intent violations, first: {:#?}", v.len(), &v[..v.len().min(8)]);
    }

    pub fn data_writes_checked(&self) -> u64 {
        self.state.lock().data_writes_checked
    }

    fn is_bitmap(&self, offset: u64) -> bool {
        (BITMAP_OFFSET..BITMAP_OFFSET + self.geo.pages() * 4096).contains(&offset)
    }

    fn on_issue(&self, member: usize, offset: u64, len: u64) {
        if offset < DATA_BASE {
            return;
        }
        let mut s = self.state.lock();
        s.data_writes_checked += 1;
        for c in (offset - DATA_BASE) / 4096..(offset + len - DATA_BASE).div_ceil(4096) {
            if c >= self.geo.chunks() {
                continue;
            }
            let loc = self.geo.bit_location(c);
            let block = BITMAP_OFFSET + loc.page_index * 4096;
            let byte = (loc.byte_in_area - loc.page_index * 4096) as usize;
            for m in 0..s.members.len() {
                if !s.required[m] {
                    continue;
                }
                let ok = s.members[m].durable(block).is_some_and(|d| d[byte] & loc.mask != 0);
                if !ok {
                    let v = format!(
                        "data write to chunk {c} issued on member {member} (seq {}) while its bit is not durable on member {m}",
                        s.seq
                    );
                    s.violations.push(v);
                }
            }
        }
    }

    fn on_write_done(&self, member: usize, offset: u64, data: &[u8], fua: bool) {
        if !self.is_bitmap(offset) {
            return;
        }
        let mut s = self.state.lock();
        s.seq += 1;
        let seq = s.seq;
        for (i, block) in data.chunks(4096).enumerate() {
            let at = offset + i as u64 * 4096;
            let list = s.members[member].blocks.entry(at).or_default();
            list.push(BlockWrite { complete_seq: seq, data: block.to_vec(), durable: fua });
            // Keep the list short: everything before the newest durable entry is irrelevant.
            if let Some(k) = list.iter().rposition(|w| w.durable) {
                list.drain(..k);
            }
        }
    }

    fn on_flush_issue(&self, member: usize) -> u64 {
        let mut s = self.state.lock();
        s.seq += 1;
        let token = s.seq;
        s.members[member].flush_tokens.push(token);
        token
    }

    fn on_flush_done(&self, member: usize, token: u64) {
        let mut s = self.state.lock();
        let m = &mut s.members[member];
        m.flush_tokens.retain(|&t| t != token);
        for list in m.blocks.values_mut() {
            for w in list.iter_mut().filter(|w| w.complete_seq < token) {
                w.durable = true;
            }
            if let Some(k) = list.iter().rposition(|w| w.durable) {
                list.drain(..k);
            }
        }
    }
}

/// A member wrapped by the [`Oracle`]; every request yields once between issue and completion
/// so requests overlap.
pub struct OracleDevice {
    oracle: Oracle,
    member: usize,
    inner: DeviceRef,
}

impl BlockDevice for OracleDevice {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn topology(&self) -> Topology {
        self.inner.topology()
    }

    fn read(&self, offset_bytes: u64, buf: IoBuf) -> IoFuture<'_, ReadResult> {
        self.inner.read(offset_bytes, buf)
    }

    fn write(&self, offset_bytes: u64, buf: SharedBuf, flags: WriteFlags) -> IoFuture<'_, io::Result<()>> {
        Box::pin(async move {
            self.oracle.on_issue(self.member, offset_bytes, buf.len() as u64);
            tokio::task::yield_now().await;
            let r = self.inner.write(offset_bytes, buf.clone(), flags).await;
            if r.is_ok() {
                self.oracle.on_write_done(self.member, offset_bytes, buf.as_slice(), flags.fua);
            }
            r
        })
    }

    fn flush(&self) -> IoFuture<'_, io::Result<()>> {
        Box::pin(async move {
            let token = self.oracle.on_flush_issue(self.member);
            tokio::task::yield_now().await;
            let r = self.inner.flush().await;
            if r.is_ok() {
                self.oracle.on_flush_done(self.member, token);
            }
            r
        })
    }

    fn discard(&self, offset_bytes: u64, len_bytes: u64) -> IoFuture<'_, io::Result<()>> {
        self.inner.discard(offset_bytes, len_bytes)
    }

    fn write_zeroes(&self, offset_bytes: u64, len_bytes: u64, flags: ZeroFlags) -> IoFuture<'_, io::Result<()>> {
        self.inner.write_zeroes(offset_bytes, len_bytes, flags)
    }
}

/// A current-thread runtime with the clock paused (time jumps when every task waits), so
/// daemon periods cost nothing and runs are deterministic.
pub fn paused_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build().expect("runtime")
}
