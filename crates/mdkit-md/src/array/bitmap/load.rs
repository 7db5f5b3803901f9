//! Loading a bitmap from the members (md_bitmap_load / md_bitmap_init_from_disk) and creating a
//! new one.

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use mdkit_io::BlockDeviceExt;
use parking_lot::{Mutex, RwLock};
use tokio::sync::Notify;

use super::chunks::ChunkState;
use super::pages::{MemberIo, Page, chunk_slot};
use super::{
    BitmapArrayInfo, BitmapMember, DEFAULT_FLUSH_CHUNKS, DEFAULT_IDLE_REGION_BYTES, FailFn, Inner, PAGE_BYTES,
    Settings, Stats, WriteIntentBitmap,
};
use crate::format::bitmap::{BITMAP_SUPER_BYTES, BitmapGeometry, BitmapSuper, MDADM_DEFAULT_DAEMON_SLEEP_SECS, state};
use crate::format::format_uuid;

/// Largest single read while loading (bitmaps are read in pieces of at most this).
const LOAD_READ_BYTES: u64 = 1 << 20;

/// Parameters of a new bitmap ([`WriteIntentBitmap::create`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BitmapCreate {
    /// Bytes of the sync domain per bit (power of two, at least 512).
    pub chunk_bytes: u32,
    /// Daemon period in seconds (the superblock's `daemon_sleep`, at least 1).
    pub daemon_sleep_secs: u32,
    /// `write_behind` (0..=16383).
    pub write_behind: u32,
    /// `sectors_reserved` recorded in the bitmap superblock (mdadm writes 0).
    pub sectors_reserved: u32,
    /// Start with every bit set (what mdadm writes; the chunks below `resync_offset` are not
    /// needed) or every bit clear (an array created in sync with nothing written yet).
    pub all_dirty: bool,
}

impl BitmapCreate {
    /// mdadm's defaults for a chunk size: 5 s daemon period, write-behind 0, all bits set.
    pub fn new(chunk_bytes: u32) -> BitmapCreate {
        BitmapCreate {
            chunk_bytes,
            daemon_sleep_secs: MDADM_DEFAULT_DAEMON_SLEEP_SECS,
            write_behind: 0,
            sectors_reserved: 0,
            all_dirty: true,
        }
    }
}

fn invalid(array: &BitmapArrayInfo, why: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("{}: write-intent bitmap: {why}", array.name))
}

/// One member as read at load.
struct MemberRead {
    member: BitmapMember,
    /// The superblock when it is valid and belongs to this array.
    header: Option<BitmapSuper>,
    /// The whole area (pages × 4 KiB) when the header is valid and every page read.
    area: Option<Vec<u8>>,
}

pub(super) async fn load(
    members: Vec<BitmapMember>,
    array: BitmapArrayInfo,
    on_member_error: FailFn,
) -> io::Result<WriteIntentBitmap> {
    if members.is_empty() {
        return Err(invalid(&array, "no member to load the bitmap from"));
    }
    let mut reads = Vec::with_capacity(members.len());
    let mut problems: Vec<String> = Vec::new();
    for m in members {
        let at = m.bitmap_offset_bytes;
        let name = m.dev.name().to_string();
        let head = match m.dev.read_metadata(at, PAGE_BYTES as usize).await {
            Ok(b) => b,
            Err(e) => {
                let e = io::Error::new(e.kind(), format!("{name}: reading the bitmap superblock at byte {at}: {e}"));
                problems.push(e.to_string());
                on_member_error(m.slot, &e);
                continue;
            }
        };
        let header = match BitmapSuper::decode(&head) {
            Ok(sb) if sb.uuid == array.set_uuid => Some(sb),
            Ok(sb) => {
                problems.push(format!(
                    "{name}: bitmap uuid {} does not match the array uuid {}",
                    format_uuid(&sb.uuid),
                    format_uuid(&array.set_uuid)
                ));
                None
            }
            Err(e) => {
                problems.push(format!("{name}: bitmap superblock at byte {at}: {e}"));
                None
            }
        };
        reads.push(MemberRead { member: m, header, area: None });
    }
    let reference = reads.iter().filter_map(|r| r.header.clone()).max_by_key(|h| h.events).ok_or_else(|| {
        invalid(&array, format!("no member holds a valid bitmap for this array ({})", problems.join("; ")))
    })?;
    // A grow cut between the members' bitmap writes leaves chunk sizes that disagree: the
    // newest bitmap is the reference, the others' bits mean other ranges and are not used,
    // and every chunk is synced (their dirty regions are not known in the reference's terms).
    let mut chunks_disagree = false;
    for r in &mut reads {
        if let Some(h) = &r.header
            && h.chunk_bytes != reference.chunk_bytes
        {
            tracing::warn!(
                "{}: {}: bitmap chunk {} bytes, the newest bitmap has {} bytes: its bits are not used and every chunk is synced",
                array.name,
                r.member.dev.name(),
                h.chunk_bytes,
                reference.chunk_bytes
            );
            r.header = None;
            chunks_disagree = true;
        }
    }
    // The kernel sizes the bitmap from the array (resync_max_sectors), not from sync_size.
    let geo = BitmapGeometry::new(reference.chunk_bytes, array.sync_size_sectors).map_err(|e| invalid(&array, e))?;
    let pages = geo.pages();
    let area_bytes = pages * PAGE_BYTES;
    let mut ios = Vec::with_capacity(reads.len());
    for r in &mut reads {
        let mut m = r.member.clone();
        if reference.sectors_reserved != 0 {
            m.space_bytes = m.space_bytes.min(u64::from(reference.sectors_reserved) * 512);
        }
        ios.push(Arc::new(MemberIo::new(m, geo.storage_bytes(), pages, &array.name)?));
        if r.header.is_none() {
            continue;
        }
        match read_area(&r.member, area_bytes).await {
            Ok(a) => r.area = Some(a),
            Err(e) => {
                on_member_error(r.member.slot, &e);
                ios.pop();
            }
        }
    }
    let Some(reference_area) =
        reads.iter().find(|r| r.header.as_ref() == Some(&reference)).and_then(|r| r.area.clone())
    else {
        return Err(invalid(&array, "the member with the newest bitmap could not be read"));
    };

    // Union of the bits; padding and the header bytes as the reference has them.
    let bits_end = geo.storage_bytes() as usize;
    let mut image = reference_area;
    for a in reads.iter().filter_map(|r| r.area.as_ref()) {
        for (dst, src) in image[BITMAP_SUPER_BYTES..bits_end].iter_mut().zip(&a[BITMAP_SUPER_BYTES..bits_end]) {
            *dst |= *src;
        }
    }
    let stale = reference.events < array.events || reference.state & state::STALE != 0 || chunks_disagree;
    if stale {
        tracing::warn!(
            "{}: bitmap is out of date ({} < {}) or stale: every chunk needs sync",
            array.name,
            reference.events,
            array.events
        );
        for c in 0..geo.chunks() {
            crate::format::bitmap::set_bit(&mut image, &geo, c, true);
        }
    }
    // Pages some member must get again: its bits differ from the union, or its copy is unusable.
    let mut rewrite: Vec<bool> = (0..pages).map(|p| p == 0 || stale).collect();
    for r in &reads {
        for (p, slot) in rewrite.iter_mut().enumerate() {
            let lo = (p * PAGE_BYTES as usize).max(BITMAP_SUPER_BYTES);
            let hi = ((p + 1) * PAGE_BYTES as usize).min(bits_end);
            if lo < hi && r.area.as_ref().is_none_or(|a| a[lo..hi] != image[lo..hi]) {
                *slot = true;
            }
        }
    }

    let mut header = reference.clone();
    header.events = array.events;
    header.events_cleared = if stale { array.events } else { reference.events_cleared.min(array.events) };
    header.state &= !(state::STALE | state::WRITE_ERROR);
    header.sync_size_sectors = array.sync_size_sectors;
    // Dirty bits need sync from resync_offset on; from 0 when degraded and bits may have been
    // kept for a missing member (md_bitmap_load).
    let needed_from =
        if !array.degraded || header.events_cleared == array.events { array.resync_offset_sectors } else { 0 };
    let inner =
        build_inner(&array, geo, header, &image, ios, on_member_error, |c| stale || needed(&geo, c, needed_from));
    let bitmap = WriteIntentBitmap::start(inner.clone());
    let need = inner.join_round_pages(rewrite.iter().enumerate().filter(|(_, w)| **w).map(|(p, _)| p), true);
    inner.wait_round(need).await?;
    tracing::info!(
        "{}: bitmap loaded: {} chunks of {} bytes, {} dirty, {} needed{}",
        array.name,
        geo.chunks(),
        geo.chunk_bytes,
        bitmap.stats().dirty_chunks,
        bitmap.stats().needed_chunks,
        if problems.is_empty() { String::new() } else { format!(" ({})", problems.join("; ")) }
    );
    Ok(bitmap)
}

/// Whether chunk `c` needs sync when dirty bits count from `from_sector` (kernel:
/// `(c + 1) << chunkshift >= start`).
fn needed(geo: &BitmapGeometry, c: u64, from_sector: u64) -> bool {
    u128::from(c + 1) * u128::from(geo.chunk_sectors()) >= u128::from(from_sector)
}

async fn read_area(m: &BitmapMember, area_bytes: u64) -> io::Result<Vec<u8>> {
    let mut area = Vec::with_capacity(area_bytes as usize);
    let mut off = 0;
    while off < area_bytes {
        let len = (area_bytes - off).min(LOAD_READ_BYTES);
        let at = m.bitmap_offset_bytes + off;
        let piece =
            m.dev.read_metadata(at, len as usize).await.map_err(|e| {
                io::Error::new(e.kind(), format!("{}: reading the bitmap at byte {at}: {e}", m.dev.name()))
            })?;
        if piece.len() as u64 != len {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "{}: reading the bitmap at byte {at}: short read: {} of {len} bytes",
                    m.dev.name(),
                    piece.len()
                ),
            ));
        }
        area.extend_from_slice(&piece);
        off += len;
    }
    Ok(area)
}

pub(super) async fn create(
    members: Vec<BitmapMember>,
    array: BitmapArrayInfo,
    params: BitmapCreate,
    on_member_error: FailFn,
) -> io::Result<WriteIntentBitmap> {
    if members.is_empty() {
        return Err(invalid(&array, "no member to write the bitmap to"));
    }
    let geo = BitmapGeometry::new(params.chunk_bytes, array.sync_size_sectors).map_err(|e| invalid(&array, e))?;
    let mut header = BitmapSuper::new(array.set_uuid, params.chunk_bytes, array.sync_size_sectors);
    header.events = array.events;
    header.events_cleared = array.events;
    header.daemon_sleep_secs = params.daemon_sleep_secs;
    header.write_behind = params.write_behind;
    header.sectors_reserved = params.sectors_reserved;
    header.validate().map_err(|e| invalid(&array, e))?;
    let pages = geo.pages();
    let ios = members
        .into_iter()
        .map(|m| MemberIo::new(m, geo.storage_bytes(), pages, &array.name).map(Arc::new))
        .collect::<io::Result<Vec<_>>>()?;
    let mut image = vec![0u8; (pages * PAGE_BYTES) as usize];
    if params.all_dirty {
        image.fill(0xff);
    }
    header.write_header(&mut image).map_err(|e| invalid(&array, e))?;
    let inner = build_inner(&array, geo, header, &image, ios, on_member_error, |c| {
        needed(&geo, c, array.resync_offset_sectors)
    });
    let bitmap = WriteIntentBitmap::start(inner.clone());
    inner.write_all_pages().await?;
    Ok(bitmap)
}

/// The shared state for a bitmap whose area (pages × 4 KiB, header included) is `image` and
/// whose bits are durable on every member in `ios`.
fn build_inner(
    array: &BitmapArrayInfo,
    geo: BitmapGeometry,
    header: BitmapSuper,
    image: &[u8],
    ios: Vec<Arc<MemberIo>>,
    on_member_error: FailFn,
    is_needed: impl Fn(u64) -> bool,
) -> Arc<Inner> {
    debug_assert_eq!(image.len() as u64, geo.pages() * PAGE_BYTES);
    let pages: Box<[Page]> = image.chunks_exact(PAGE_BYTES as usize).map(Page::new).collect();
    let daemon_sleep_ms = u64::from(header.daemon_sleep_secs.max(1)) * 1000;
    let inner = Arc::new(Inner {
        name: array.name.clone(),
        geo,
        pages,
        header: Mutex::new(header),
        members: RwLock::new(Arc::new(ios)),
        on_member_error,
        degraded: AtomicBool::new(array.degraded),
        events_recorded: AtomicU64::new(array.events),
        settings: Settings {
            daemon_sleep_ms: AtomicU64::new(daemon_sleep_ms),
            flush_chunks: AtomicU64::new(DEFAULT_FLUSH_CHUNKS),
            idle_region_bytes: AtomicU64::new(DEFAULT_IDLE_REGION_BYTES),
            can_clear: AtomicBool::new(true),
        },
        idle_dirty: Default::default(),
        kick: Notify::new(),
        kick_pending: AtomicBool::new(false),
        retime: Notify::new(),
        stop: Notify::new(),
        stopped: AtomicBool::new(false),
        rounds: Default::default(),
        sweep_lock: tokio::sync::Mutex::new(()),
        runtime: tokio::runtime::Handle::current(),
        stats: Stats::default(),
    });
    for c in 0..geo.chunks() {
        if crate::format::bitmap::test_bit(image, &geo, c) != Some(true) {
            continue;
        }
        let s = ChunkState::DURABLE | if is_needed(c) { ChunkState::NEEDED } else { 0 };
        let (p, bit) = chunk_slot(c);
        inner.pages[p].chunk_block()[bit].store(s, Ordering::Relaxed);
        inner.account(c, 0, s);
    }
    inner
}
