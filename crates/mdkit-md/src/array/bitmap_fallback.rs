//! The interim write-intent bitmap runtime, used until the batched bitmap component
//! (`array/bitmap.rs`, issue 4) replaces it behind the same calls.
//!
//! It is the simplest thing that is never wrong: before the first write after assembly it sets
//! *every* bit and writes the whole bitmap area durably (FUA) to every working member, and it
//! never clears a bit. The bitmap therefore always says "everything may be dirty": after a crash
//! the whole array is resynced (as without a bitmap), a re-added member is recovered in full,
//! and the kernel, which honours the bits, does the same. What it does keep exact is the bitmap
//! superblock's `events` (written before every md superblock, md_update_sb order), so neither
//! the kernel nor mdkit treats the bitmap as stale.

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use mdkit_io::SharedBuf;
use parking_lot::Mutex;

use super::core::ArrayCore;
use super::io::join_all;
use super::member::Member;
use crate::format::METADATA_BLOCK_BYTES;
use crate::format::bitmap::{BITMAP_SUPER_BYTES, BitmapSuper};

/// See the module documentation.
pub struct FallbackBitmap {
    header: Mutex<BitmapSuper>,
    /// Page 0 as read at load (header + the first bits), kept so header updates do not change
    /// bits before they are all set.
    page0: Mutex<Vec<u8>>,
    area_bytes: u64,
    /// `bitmap_offset` from the superblock (sectors from the superblock, signed).
    location_sectors: i32,
    all_set: AtomicBool,
    init: tokio::sync::Mutex<()>,
}

impl FallbackBitmap {
    /// From the bitmap superblock and page 0 read from a member (validated by the caller).
    pub fn new(header: BitmapSuper, page0: Vec<u8>, location_sectors: i32) -> io::Result<FallbackBitmap> {
        let geo = header.geometry().map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
        if page0.len() != METADATA_BLOCK_BYTES {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "bitmap page 0 must be 4 KiB"));
        }
        Ok(FallbackBitmap {
            header: Mutex::new(header),
            page0: Mutex::new(page0),
            area_bytes: geo.area_bytes(),
            location_sectors,
            all_set: AtomicBool::new(false),
            init: tokio::sync::Mutex::new(()),
        })
    }

    pub fn header(&self) -> BitmapSuper {
        self.header.lock().clone()
    }

    /// Bytes of the bitmap area (superblock + bits, whole 4 KiB pages).
    pub fn area_bytes(&self) -> u64 {
        self.area_bytes
    }

    /// Whether every bit is set on disk (after the first write).
    pub fn all_bits_set(&self) -> bool {
        self.all_set.load(Ordering::Acquire)
    }

    /// The whole area: current header, every bit set.
    fn full_area(&self) -> io::Result<Vec<u8>> {
        let mut area = vec![0xffu8; self.area_bytes as usize];
        let h = self.header.lock().clone();
        h.write_header(&mut area).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
        Ok(area)
    }

    fn page0_with_header(&self) -> io::Result<Vec<u8>> {
        let mut p = if self.all_bits_set() { vec![0xffu8; METADATA_BLOCK_BYTES] } else { self.page0.lock().clone() };
        let h = self.header.lock().clone();
        h.write_header(&mut p[..BITMAP_SUPER_BYTES])
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
        Ok(p)
    }

    fn offset_bytes(m: &Member) -> Option<u64> {
        m.superblock().bitmap_sector().map(|s| s * 512)
    }

    /// Before any data write: every bit durable on every working member. Members whose bitmap
    /// write fails are failed; the caller settles failures before acknowledging writes.
    pub async fn start_write(&self, a: &ArrayCore) -> io::Result<()> {
        if self.all_bits_set() {
            return Ok(());
        }
        let _g = self.init.lock().await;
        if self.all_bits_set() {
            return Ok(());
        }
        let area = SharedBuf::from_slice(&self.full_area()?);
        let members = a.slots().working_members();
        let ok = self.write_to(a, &members, |_| area.clone()).await;
        if ok == 0 {
            return Err(io::Error::other(format!(
                "{}: the write-intent bitmap could not be written to any member",
                a.name()
            )));
        }
        self.all_set.store(true, Ordering::Release);
        Ok(())
    }

    /// Writes the whole area (all bits set) to a member joining the array.
    pub async fn initialise_member(&self, a: &ArrayCore, m: &Arc<Member>) -> io::Result<()> {
        let area = SharedBuf::from_slice(&self.full_area()?);
        let off = Self::offset_bytes(m)
            .ok_or_else(|| io::Error::other(format!("{}: member {} has no bitmap offset", a.name(), m.name())))?;
        a.member_write_meta(m, off, area).await
    }

    /// md_update_sb order: the bitmap superblock gets the new event count first. Returns the
    /// members whose write failed (the caller fails them).
    pub async fn write_events(
        &self,
        a: &ArrayCore,
        members: &[Arc<Member>],
        events: u64,
    ) -> io::Result<Vec<(Arc<Member>, io::Error)>> {
        self.header.lock().events = events;
        let page = SharedBuf::from_slice(&self.page0_with_header()?);
        let results = join_all(members.iter().map(|m| {
            let page = page.clone();
            async move {
                match Self::offset_bytes(m) {
                    Some(off) => a.member_write_meta(m, off, page).await,
                    None => Err(io::Error::other(format!("{}: member {} has no bitmap offset", a.name(), m.name()))),
                }
            }
        }))
        .await;
        Ok(members.iter().cloned().zip(results).filter_map(|(m, r)| r.err().map(|e| (m, e))).collect())
    }

    async fn write_to(&self, a: &ArrayCore, members: &[Arc<Member>], data: impl Fn(&Member) -> SharedBuf) -> usize {
        let results = join_all(members.iter().map(|m| {
            let buf = data(m);
            async move {
                match Self::offset_bytes(m) {
                    Some(off) => a.member_write_meta(m, off, buf).await,
                    None => Err(io::Error::other(format!("{}: member {} has no bitmap offset", a.name(), m.name()))),
                }
            }
        }))
        .await;
        let mut ok = 0;
        for (m, r) in members.iter().zip(results) {
            match r {
                Ok(()) => ok += 1,
                Err(e) => {
                    a.fail_member(m, &format!("bitmap write failed: {e}"));
                }
            }
        }
        ok
    }

    /// Attributes under md's `bitmap/` names.
    pub fn attributes(&self) -> Vec<(&'static str, String)> {
        let h = self.header.lock().clone();
        vec![
            ("bitmap/location", format!("{:+}", self.location_sectors)),
            ("bitmap/chunksize", h.chunk_bytes.to_string()),
            ("bitmap/time_base", h.daemon_sleep_secs.to_string()),
            ("bitmap/metadata", "internal".to_string()),
            ("bitmap/events", h.events.to_string()),
            ("bitmap/events_cleared", h.events_cleared.to_string()),
            ("bitmap/mode", "all-bits-set (interim: full resync after a crash)".to_string()),
        ]
    }
}
