//! The md write-intent bitmap (internal, classic: versions 3 and 4).
//!
//! ```text
//!  at super_offset + bitmap_offset (sectors), written identically to every active member:
//!  byte 0                256                         storage_bytes    area_bytes
//!  | bitmap_super_t 256 | bit 0 (chunk 0) ... bit N-1 |  (0xff / unused) |
//!  |<------------- page 0 (4 KiB) ------------->|<-- page 1 ...
//! ```
//! One bit per chunk, little-endian bit order (bit k is byte k/8, mask 1 << (k%8)), bits start
//! right after the 256-byte superblock; I/O is done in whole 4 KiB pages.
//!
//! ```text
//!  off size field            off size field
//!    0    4 magic "bitm"      52    4 chunksize (bytes, power of 2, >= 512)
//!    4    4 version (3/4)     56    4 daemon_sleep (seconds)
//!    8   16 uuid (= set_uuid) 60    4 write_behind (0..16383)
//!   24    8 events            64    4 sectors_reserved
//!   32    8 events_cleared    68    4 nodes (clustered only)
//!   40    8 sync_size (sect)  72   64 cluster_name
//!   48    4 state            136  120 pad
//! ```
//! Sources: drivers/md/md-bitmap.c (md_bitmap_read_sb, file_page_index/offset), mdadm bitmap.h
//! and super1.c (add_internal_bitmap1, calc_bitmap_size, write_bitmap1); formats.md section 2.

use super::{METADATA_BLOCK_BYTES, SECTOR_BYTES, le_u32, le_u64, put_u32, put_u64};

/// "bitm" read as a little-endian u32.
pub const BITMAP_MAGIC: u32 = 0x6d74_6962;
/// Size of `bitmap_super_t`.
pub const BITMAP_SUPER_BYTES: usize = 256;
/// Version 3: bits in host order (identical to version 4 on little-endian hosts).
pub const VERSION_HOSTENDIAN: u32 = 3;
/// Version 4: bits in little-endian order (what mdadm and the kernel write).
pub const VERSION_LITTLE_ENDIAN: u32 = 4;
/// Version 5: md-cluster, one bitmap per node.
pub const VERSION_CLUSTERED: u32 = 5;
/// Version 6: the lockless bitmap (llbitmap, one state byte per chunk).
pub const VERSION_LOCKLESS: u32 = 6;
/// Largest write_behind (and per-chunk pending counter) the kernel accepts.
pub const COUNTER_MAX: u32 = 16383;
/// Smallest chunk the kernel accepts (bytes).
pub const MIN_CHUNK_BYTES: u32 = 512;
/// mdadm's default chunk floor for internal bitmaps (64 MiB).
pub const MDADM_DEFAULT_CHUNK_BYTES: u32 = 64 << 20;
/// mdadm's default daemon_sleep (DEFAULT_BITMAP_DELAY, seconds).
pub const MDADM_DEFAULT_DAEMON_SLEEP_SECS: u32 = 5;
/// Bits per 4 KiB page.
pub const BITS_PER_PAGE: u64 = METADATA_BLOCK_BYTES as u64 * 8;

/// Byte offsets of `bitmap_super_t`.
pub mod off {
    pub const MAGIC: usize = 0;
    pub const VERSION: usize = 4;
    pub const UUID: usize = 8;
    pub const EVENTS: usize = 24;
    pub const EVENTS_CLEARED: usize = 32;
    pub const SYNC_SIZE: usize = 40;
    pub const STATE: usize = 48;
    pub const CHUNKSIZE: usize = 52;
    pub const DAEMON_SLEEP: usize = 56;
    pub const WRITE_BEHIND: usize = 60;
    pub const SECTORS_RESERVED: usize = 64;
    pub const NODES: usize = 68;
    pub const CLUSTER_NAME: usize = 72;
    pub const PAD: usize = 136;
}
const _: () = assert!(off::PAD + 120 == BITMAP_SUPER_BYTES);
const _: () = assert!(off::CLUSTER_NAME + 64 == off::PAD);

/// `state` bits (kernel enum bitmap_state, as bit values).
pub mod state {
    /// The bitmap is out of date: a full resync is needed.
    pub const STALE: u32 = 1 << 1;
    /// A bitmap write failed.
    pub const WRITE_ERROR: u32 = 1 << 2;
    /// Bits are host-endian (version 3).
    pub const HOSTENDIAN: u32 = 1 << 15;
}

/// Why a bitmap superblock is refused, or why a bitmap cannot be sized.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BitmapError {
    #[error("bitmap buffer is {len_bytes} bytes, need {BITMAP_SUPER_BYTES}")]
    TooShort { len_bytes: usize },
    #[error("bad bitmap magic {found:#010x} (expected {BITMAP_MAGIC:#010x} \"bitm\")")]
    BadMagic { found: u32 },
    #[error("bitmap version {version} is not supported: {why}")]
    UnsupportedVersion { version: u32, why: &'static str },
    #[error("bitmap chunksize {chunk_bytes} bytes is below the minimum of {MIN_CHUNK_BYTES}")]
    ChunkTooSmall { chunk_bytes: u32 },
    #[error(
        "bitmap sync_size {sync_size_sectors} sectors is larger than any block device the kernel can address \
         ({MAX_SYNC_SIZE_SECTORS} sectors)"
    )]
    SyncSizeTooLarge { sync_size_sectors: u64 },
    #[error("bitmap chunksize {chunk_bytes} bytes is not a power of 2")]
    ChunkNotPowerOfTwo { chunk_bytes: u32 },
    #[error("bitmap daemon_sleep is 0 seconds (out of range)")]
    DaemonSleepZero,
    #[error("bitmap write_behind {write_behind} is out of range (0 - {COUNTER_MAX})")]
    WriteBehindTooLarge { write_behind: u32 },
    #[error("bitmap uuid {found} does not match the array uuid {expected}")]
    UuidMismatch { found: String, expected: String },
    #[error("no room for an internal bitmap ({room_sectors} sectors available)")]
    NoRoom { room_sectors: u64 },
    #[error(
        "bitmap chunk {requested_bytes} bytes is too small: {sync_size_sectors} sectors need at least {min_bytes} bytes per bit to fit in {room_sectors} sectors"
    )]
    ChunkTooSmallForRoom { requested_bytes: u64, min_bytes: u64, sync_size_sectors: u64, room_sectors: u64 },
    /// A field that does not fit the member's md superblock ([`BitmapSuper::check_for_member`]).
    #[error("bitmap field {field} = {value}: {reason}")]
    Field { field: &'static str, value: String, reason: String },
}

/// A decoded bitmap superblock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BitmapSuper {
    pub version: u32,
    /// Must equal the array's `set_uuid`.
    pub uuid: [u8; 16],
    /// Copied from the md event count on every update (written before the md superblock).
    pub events: u64,
    /// Event count when bits were last cleared; not advanced while degraded.
    pub events_cleared: u64,
    /// Sectors covered: per-device size for raid1/4/5/6, array size for raid10.
    pub sync_size_sectors: u64,
    pub state: u32,
    /// Bytes of data per bit.
    pub chunk_bytes: u32,
    /// Seconds between flush/clear sweeps.
    pub daemon_sleep_secs: u32,
    /// Max outstanding write-behind writes (raid1 write-mostly).
    pub write_behind: u32,
    pub sectors_reserved: u32,
    pub nodes: u32,
    pub cluster_name: [u8; 64],
}

/// How a bitmap relates to the array it belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BitmapFreshness {
    /// `events >= md events`: the bits can be trusted.
    Current,
    /// Older than the md superblock (or flagged STALE): the kernel forces a full resync.
    Stale,
}

impl BitmapSuper {
    /// A version-4 bitmap with mdadm's defaults for the given geometry.
    pub fn new(uuid: [u8; 16], chunk_bytes: u32, sync_size_sectors: u64) -> BitmapSuper {
        BitmapSuper {
            version: VERSION_LITTLE_ENDIAN,
            uuid,
            events: 0,
            events_cleared: 0,
            sync_size_sectors,
            state: 0,
            chunk_bytes,
            daemon_sleep_secs: MDADM_DEFAULT_DAEMON_SLEEP_SECS,
            write_behind: 0,
            sectors_reserved: 0,
            nodes: 0,
            cluster_name: [0; 64],
        }
    }

    /// Decodes and validates with the kernel's load rules (md_bitmap_read_sb): magic, version
    /// 3 or 4 (5 clustered and 6 lockless are refused with a reason), chunk a power of two
    /// >= 512, daemon_sleep != 0, write_behind <= 16383. `bytes` holds at least 256 bytes.
    pub fn decode(bytes: &[u8]) -> Result<BitmapSuper, BitmapError> {
        let sb = BitmapSuper::decode_lenient(bytes)?;
        sb.validate()?;
        Ok(sb)
    }

    /// Parses the fields after checking only the length, for tools that display damaged
    /// bitmaps. Use [`BitmapSuper::decode`] for anything that trusts the result.
    pub fn decode_lenient(bytes: &[u8]) -> Result<BitmapSuper, BitmapError> {
        if bytes.len() < BITMAP_SUPER_BYTES {
            return Err(BitmapError::TooShort { len_bytes: bytes.len() });
        }
        let magic = le_u32(bytes, off::MAGIC);
        if magic != BITMAP_MAGIC {
            return Err(BitmapError::BadMagic { found: magic });
        }
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(&bytes[off::UUID..off::UUID + 16]);
        let mut cluster_name = [0u8; 64];
        cluster_name.copy_from_slice(&bytes[off::CLUSTER_NAME..off::CLUSTER_NAME + 64]);
        Ok(BitmapSuper {
            version: le_u32(bytes, off::VERSION),
            uuid,
            events: le_u64(bytes, off::EVENTS),
            events_cleared: le_u64(bytes, off::EVENTS_CLEARED),
            sync_size_sectors: le_u64(bytes, off::SYNC_SIZE),
            state: le_u32(bytes, off::STATE),
            chunk_bytes: le_u32(bytes, off::CHUNKSIZE),
            daemon_sleep_secs: le_u32(bytes, off::DAEMON_SLEEP),
            write_behind: le_u32(bytes, off::WRITE_BEHIND),
            sectors_reserved: le_u32(bytes, off::SECTORS_RESERVED),
            nodes: le_u32(bytes, off::NODES),
            cluster_name,
        })
    }

    /// The kernel's field checks, in its order.
    pub fn validate(&self) -> Result<(), BitmapError> {
        match self.version {
            VERSION_HOSTENDIAN | VERSION_LITTLE_ENDIAN => {}
            VERSION_CLUSTERED => {
                return Err(BitmapError::UnsupportedVersion {
                    version: self.version,
                    why: "clustered bitmap (md-cluster) is not supported",
                });
            }
            VERSION_LOCKLESS => {
                return Err(BitmapError::UnsupportedVersion {
                    version: self.version,
                    why: "lockless bitmap (llbitmap, one byte per chunk) is not supported",
                });
            }
            _ => {
                return Err(BitmapError::UnsupportedVersion {
                    version: self.version,
                    why: "unrecognized superblock version",
                });
            }
        }
        if self.chunk_bytes < MIN_CHUNK_BYTES {
            return Err(BitmapError::ChunkTooSmall { chunk_bytes: self.chunk_bytes });
        }
        if !self.chunk_bytes.is_power_of_two() {
            return Err(BitmapError::ChunkNotPowerOfTwo { chunk_bytes: self.chunk_bytes });
        }
        if self.daemon_sleep_secs == 0 {
            return Err(BitmapError::DaemonSleepZero);
        }
        if self.write_behind > COUNTER_MAX {
            return Err(BitmapError::WriteBehindTooLarge { write_behind: self.write_behind });
        }
        Ok(())
    }

    /// Encodes the 256-byte superblock (pad zero), validating first.
    /// Checks a member's bitmap superblock against its md superblock before anything is sized
    /// from it: the kernel's field checks ([`BitmapSuper::validate`]), the array uuid,
    /// `sync_size` within what the member's data area covers, and the bits for that domain fitting the
    /// `space_bytes` before the next structure (and `sectors_reserved`, when recorded).
    pub fn check_for_member(&self, sb: &super::superblock::Superblock, space_bytes: u64) -> Result<(), BitmapError> {
        self.validate()?;
        if self.uuid != sb.set_uuid {
            return Err(BitmapError::UuidMismatch {
                found: super::format_uuid(&self.uuid),
                expected: super::format_uuid(&sb.set_uuid),
            });
        }
        let field = |field: &'static str, value: u64, reason: String| BitmapError::Field {
            field,
            value: value.to_string(),
            reason,
        };
        let domain = super::validate::bitmap_sync_domain_sectors(sb).unwrap_or(0);
        // The kernel sizes the bitmap from the array, not from sync_size, and a grow writes
        // the bitmap (with the new sync_size) before the superblocks: a cut between them
        // leaves a sync_size up to what the member's data area can hold.
        let room = sb.data_size_sectors.max(sb.size_sectors);
        let most = super::validate::bitmap_sync_domain_for_size(sb, room).unwrap_or(0).max(domain);
        if self.sync_size_sectors > most {
            return Err(field(
                "sync_size",
                self.sync_size_sectors,
                format!("sectors: more than the {most} sectors the member's data area covers"),
            ));
        }
        let storage_bytes = BitmapGeometry::new(self.chunk_bytes, domain)?.storage_bytes();
        if storage_bytes > space_bytes {
            return Err(field(
                "chunksize",
                u64::from(self.chunk_bytes),
                format!("bytes: {storage_bytes} bytes of bits needed, only {space_bytes} before the next structure"),
            ));
        }
        let reserved_bytes = u64::from(self.sectors_reserved) * SECTOR_BYTES;
        if self.sectors_reserved != 0 && storage_bytes > reserved_bytes {
            return Err(field(
                "sectors_reserved",
                u64::from(self.sectors_reserved),
                format!("sectors: {storage_bytes} bytes of bits needed"),
            ));
        }
        Ok(())
    }

    pub fn encode(&self) -> Result<[u8; BITMAP_SUPER_BYTES], BitmapError> {
        self.validate()?;
        let b = self.encode_unchecked();
        // Pair assertion: what we would write decodes to what we meant.
        debug_assert_eq!(BitmapSuper::decode(&b).as_ref(), Ok(self));
        Ok(b)
    }

    /// Encodes exactly these fields without validation (tests, deliberate corruption).
    pub fn encode_unchecked(&self) -> [u8; BITMAP_SUPER_BYTES] {
        let mut b = [0u8; BITMAP_SUPER_BYTES];
        put_u32(&mut b, off::MAGIC, BITMAP_MAGIC);
        put_u32(&mut b, off::VERSION, self.version);
        b[off::UUID..off::UUID + 16].copy_from_slice(&self.uuid);
        put_u64(&mut b, off::EVENTS, self.events);
        put_u64(&mut b, off::EVENTS_CLEARED, self.events_cleared);
        put_u64(&mut b, off::SYNC_SIZE, self.sync_size_sectors);
        put_u32(&mut b, off::STATE, self.state);
        put_u32(&mut b, off::CHUNKSIZE, self.chunk_bytes);
        put_u32(&mut b, off::DAEMON_SLEEP, self.daemon_sleep_secs);
        put_u32(&mut b, off::WRITE_BEHIND, self.write_behind);
        put_u32(&mut b, off::SECTORS_RESERVED, self.sectors_reserved);
        put_u32(&mut b, off::NODES, self.nodes);
        b[off::CLUSTER_NAME..off::CLUSTER_NAME + 64].copy_from_slice(&self.cluster_name);
        b
    }

    /// Writes the superblock into the first 256 bytes of page 0 of the bitmap area, leaving the
    /// bits that follow untouched. `page0` must be at least 256 bytes.
    pub fn write_header(&self, page0: &mut [u8]) -> Result<(), BitmapError> {
        if page0.len() < BITMAP_SUPER_BYTES {
            return Err(BitmapError::TooShort { len_bytes: page0.len() });
        }
        page0[..BITMAP_SUPER_BYTES].copy_from_slice(&self.encode()?);
        Ok(())
    }

    /// The bit geometry this superblock describes. Requires a validated chunk size.
    pub fn geometry(&self) -> Result<BitmapGeometry, BitmapError> {
        BitmapGeometry::new(self.chunk_bytes, self.sync_size_sectors)
    }

    /// Checks the bitmap against its array: the uuid must match (else refused, as the kernel
    /// does); a bitmap older than the md events, or flagged STALE, is stale.
    pub fn check_against_array(&self, set_uuid: &[u8; 16], md_events: u64) -> Result<BitmapFreshness, BitmapError> {
        if &self.uuid != set_uuid {
            return Err(BitmapError::UuidMismatch {
                found: super::format_uuid(&self.uuid),
                expected: super::format_uuid(set_uuid),
            });
        }
        if self.events < md_events || self.state & state::STALE != 0 {
            return Ok(BitmapFreshness::Stale);
        }
        Ok(BitmapFreshness::Current)
    }

    /// The whole bitmap area as mdadm writes it when creating an array: the superblock
    /// followed by all-ones (every chunk dirty; the kernel only resyncs the chunks at or above
    /// `resync_offset`, so an --assume-clean array does no work). Length = `area_bytes()`.
    pub fn initial_area(&self) -> Result<Vec<u8>, BitmapError> {
        let geo = self.geometry()?;
        let mut area = vec![0xffu8; geo.area_bytes() as usize];
        self.write_header(&mut area)?;
        Ok(area)
    }
}

/// Where one chunk's bit lives in the bitmap area.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BitLocation {
    /// 4 KiB page of the area (page 0 starts with the superblock).
    pub page_index: u64,
    /// Bit number within that page (little-endian bit order).
    pub bit_in_page: u32,
    /// Byte offset from the start of the area.
    pub byte_in_area: u64,
    /// Mask within that byte.
    pub mask: u8,
}

/// The largest array a bitmap can describe: the kernel's largest block device,
/// MAX_LFS_FILESIZE (i64::MAX bytes), in sectors. Bounds the bit count so that bit arithmetic
/// cannot overflow (found by the md_bitmap fuzz target: sync_size 2^64-1 at 512-byte chunks).
pub const MAX_SYNC_SIZE_SECTORS: u64 = (i64::MAX as u64) >> 9;

/// The on-disk bit geometry of a bitmap: `chunk_bytes` of data per bit over `sync_size_sectors`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BitmapGeometry {
    pub chunk_bytes: u32,
    pub sync_size_sectors: u64,
}

impl BitmapGeometry {
    pub fn new(chunk_bytes: u32, sync_size_sectors: u64) -> Result<BitmapGeometry, BitmapError> {
        if chunk_bytes < MIN_CHUNK_BYTES {
            return Err(BitmapError::ChunkTooSmall { chunk_bytes });
        }
        if !chunk_bytes.is_power_of_two() {
            return Err(BitmapError::ChunkNotPowerOfTwo { chunk_bytes });
        }
        if sync_size_sectors > MAX_SYNC_SIZE_SECTORS {
            return Err(BitmapError::SyncSizeTooLarge { sync_size_sectors });
        }
        Ok(BitmapGeometry { chunk_bytes, sync_size_sectors })
    }

    /// Sectors of data per bit.
    pub fn chunk_sectors(&self) -> u64 {
        u64::from(self.chunk_bytes) / SECTOR_BYTES
    }

    /// Number of bits: `ceil(sync_size * 512 / chunk)` (mdadm bitmap_bits).
    pub fn chunks(&self) -> u64 {
        self.sync_size_sectors.div_ceil(self.chunk_sectors())
    }

    /// Bytes holding the bits.
    pub fn bits_bytes(&self) -> u64 {
        self.chunks().div_ceil(8)
    }

    /// Superblock plus bits.
    pub fn storage_bytes(&self) -> u64 {
        self.bits_bytes() + BITMAP_SUPER_BYTES as u64
    }

    /// 4 KiB pages the kernel reads and writes.
    pub fn pages(&self) -> u64 {
        self.storage_bytes().div_ceil(METADATA_BLOCK_BYTES as u64)
    }

    /// The space the bitmap occupies on each member, rounded to 4 KiB (mdadm calc_bitmap_size).
    pub fn area_bytes(&self) -> u64 {
        self.pages() * METADATA_BLOCK_BYTES as u64
    }

    /// [`BitmapGeometry::area_bytes`] in sectors.
    pub fn area_sectors(&self) -> u64 {
        self.area_bytes() / SECTOR_BYTES
    }

    /// The chunk (bit) covering `sector` (in the bitmap's address space: device-relative for
    /// raid1/4/5/6, array-relative for raid10).
    pub fn chunk_of_sector(&self, sector: u64) -> u64 {
        sector / self.chunk_sectors()
    }

    /// Chunks touched by `[start_sector, start_sector + len_sectors)`, as a half-open range.
    pub fn chunks_for_range(&self, start_sector: u64, len_sectors: u64) -> std::ops::Range<u64> {
        if len_sectors == 0 {
            let c = self.chunk_of_sector(start_sector);
            return c..c;
        }
        let last = start_sector.saturating_add(len_sectors - 1);
        self.chunk_of_sector(start_sector)..self.chunk_of_sector(last).saturating_add(1)
    }

    /// First sector and length of `chunk`, clipped to `sync_size`.
    pub fn chunk_range(&self, chunk: u64) -> (u64, u64) {
        let start = chunk.saturating_mul(self.chunk_sectors());
        let end = start.saturating_add(self.chunk_sectors()).min(self.sync_size_sectors);
        (start, end.saturating_sub(start))
    }

    /// Where `chunk`'s bit lives (kernel file_page_index / file_page_offset: the bit number is
    /// offset by the 256-byte superblock, i.e. 2048 bits).
    pub fn bit_location(&self, chunk: u64) -> BitLocation {
        let bit = chunk + BITMAP_SUPER_BYTES as u64 * 8;
        BitLocation {
            page_index: bit / BITS_PER_PAGE,
            bit_in_page: (bit % BITS_PER_PAGE) as u32,
            byte_in_area: bit / 8,
            mask: 1u8 << (bit % 8),
        }
    }
}

/// Reads chunk `chunk`'s bit from a bitmap area buffer (starting at the bitmap superblock).
/// Returns `None` when the buffer does not reach that bit.
pub fn test_bit(area: &[u8], geo: &BitmapGeometry, chunk: u64) -> Option<bool> {
    if chunk >= geo.chunks() {
        return None;
    }
    let loc = geo.bit_location(chunk);
    let byte = area.get(usize::try_from(loc.byte_in_area).ok()?)?;
    Some(byte & loc.mask != 0)
}

/// Sets or clears chunk `chunk`'s bit in a bitmap area buffer. Returns `false` (changing
/// nothing) when the buffer does not reach that bit or the chunk is beyond the bitmap.
pub fn set_bit(area: &mut [u8], geo: &BitmapGeometry, chunk: u64, value: bool) -> bool {
    if chunk >= geo.chunks() {
        return false;
    }
    let loc = geo.bit_location(chunk);
    let Some(byte) = usize::try_from(loc.byte_in_area).ok().and_then(|i| area.get_mut(i)) else {
        return false;
    };
    if value {
        *byte |= loc.mask;
    } else {
        *byte &= !loc.mask;
    }
    true
}

/// Counts set bits among the first `geo.chunks()` bits of an area buffer (bits the buffer does
/// not reach are counted as dirty, like mdadm does for a truncated bitmap file).
pub fn count_dirty(area: &[u8], geo: &BitmapGeometry) -> u64 {
    (0..geo.chunks()).filter(|c| test_bit(area, geo, *c).unwrap_or(true)).count() as u64
}

/// mdadm's choose_bm_space: sectors reserved for a bitmap on a device of `device_sectors`
/// (also the kernel's super_1_choose_bm_space): < 64 KiB: 0; >= 200 GiB: 128 KiB;
/// > 8 GiB: 64 KiB; otherwise 4 KiB.
pub fn choose_bm_space(device_sectors: u64) -> u64 {
    if device_sectors < 64 * 2 {
        0
    } else if device_sectors - 64 * 2 >= 200 * 1024 * 1024 * 2 {
        128 * 2
    } else if device_sectors - 4 * 2 > 8 * 1024 * 1024 * 2 {
        64 * 2
    } else {
        4 * 2
    }
}

/// mdadm's bitmap chunk choice (add_internal_bitmap1): with `room_sectors` of space for the
/// bitmap (superblock included) covering `sync_size_sectors`, the smallest chunk >= 4 KiB
/// whose bits fit, then the default `max(that, 64 MiB)` unless a chunk is requested (which must
/// not be smaller). When no chunk is requested the room is capped to 128 KiB.
pub fn mdadm_chunk_bytes(
    room_sectors: u64,
    sync_size_sectors: u64,
    requested_chunk_bytes: Option<u32>,
) -> Result<u32, BitmapError> {
    let mut room = room_sectors;
    if requested_chunk_bytes.is_none() && room > 128 * 2 {
        room = 128 * 2;
    }
    if room <= 1 {
        return Err(BitmapError::NoRoom { room_sectors });
    }
    let max_bits = (u128::from(room) * u128::from(SECTOR_BYTES) - BITMAP_SUPER_BYTES as u128) * 8;
    let mut min_chunk: u128 = 4096;
    let mut bits = u128::from(sync_size_sectors) * 512 / min_chunk + 1;
    while bits > max_bits {
        min_chunk *= 2;
        bits = bits.div_ceil(2);
    }
    // At most 2^64 * 512 / 4096 + 1 bits need at most ~50 doublings: min_chunk stays < 2^64.
    let min_chunk = u64::try_from(min_chunk).unwrap_or(u64::MAX);
    let chunk = match requested_chunk_bytes {
        None => min_chunk.max(u64::from(MDADM_DEFAULT_CHUNK_BYTES)),
        Some(c) if u64::from(c) < min_chunk => {
            return Err(BitmapError::ChunkTooSmallForRoom {
                requested_bytes: u64::from(c),
                min_bytes: min_chunk,
                sync_size_sectors,
                room_sectors,
            });
        }
        Some(c) => u64::from(c),
    };
    let chunk = u32::try_from(chunk).map_err(|_| BitmapError::ChunkTooSmallForRoom {
        requested_bytes: chunk,
        min_bytes: min_chunk,
        sync_size_sectors,
        room_sectors,
    })?;
    if chunk < MIN_CHUNK_BYTES {
        return Err(BitmapError::ChunkTooSmall { chunk_bytes: chunk });
    }
    if !chunk.is_power_of_two() {
        return Err(BitmapError::ChunkNotPowerOfTwo { chunk_bytes: chunk });
    }
    Ok(chunk)
}

/// What the kernel keeps in `sync_size` (resync_max_sectors): the per-member size for
/// raid1/4/5/6, the array size for raid10. `member_size_sectors` is the superblock's `size`.
pub fn kernel_sync_size_sectors(level: i32, member_size_sectors: u64, array_size_sectors: u64) -> u64 {
    if level == 10 { array_size_sectors } else { member_size_sectors }
}

/// What `mdadm --create` writes into `sync_size`: `size` for most levels; for raid10
/// `size_kib * raid_disks / copies * 2` (integer arithmetic in KiB, as Create.c does).
pub fn mdadm_create_sync_size_sectors(level: i32, member_size_sectors: u64, raid_disks: u32, layout: u32) -> u64 {
    if level != 10 {
        return member_size_sectors;
    }
    let copies = u64::from(layout & 0xff) * u64::from((layout >> 8) & 0xff);
    if copies == 0 {
        return 0;
    }
    let sectors = u128::from(member_size_sectors / 2) * u128::from(raid_disks) / u128::from(copies) * 2;
    u64::try_from(sectors).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sync_size_beyond_any_device_is_refused() {
        let e = BitmapGeometry::new(512, u64::MAX).unwrap_err();
        assert!(matches!(e, BitmapError::SyncSizeTooLarge { .. }), "{e}");
        let g = BitmapGeometry::new(512, MAX_SYNC_SIZE_SECTORS).unwrap();
        let last = g.chunks() - 1;
        assert_eq!(g.bit_location(last).byte_in_area, (last + 2048) / 8, "no overflow at the largest size");
    }

    #[test]
    fn geometry_of_the_lab_raid1() {
        // 255 MiB member, 64 MiB chunks: 4 bits, one page (kernel "1/1 pages").
        let geo = BitmapGeometry::new(64 << 20, 522_240).unwrap();
        assert_eq!(geo.chunks(), 4);
        assert_eq!(geo.storage_bytes(), 257);
        assert_eq!(geo.pages(), 1);
        assert_eq!(geo.area_sectors(), 8);
        let loc = geo.bit_location(0);
        assert_eq!((loc.page_index, loc.bit_in_page, loc.byte_in_area, loc.mask), (0, 2048, 256, 1));
        let loc = geo.bit_location(30_000);
        assert_eq!(loc.page_index, (30_000 + 2048) / 32_768);
        assert_eq!(geo.chunks_for_range(0, 0), 0..0);
        assert_eq!(geo.chunks_for_range(131_071, 2), 0..2);
        assert_eq!(geo.chunk_range(3), (3 * 131_072, 522_240 - 3 * 131_072));
    }

    #[test]
    fn mdadm_chunk_rules() {
        // 4 KiB room (8 sectors), 522240 sectors: min chunk 16 KiB, default 64 MiB.
        assert_eq!(mdadm_chunk_bytes(8, 522_240, None), Ok(64 << 20));
        assert_eq!(mdadm_chunk_bytes(8, 522_240, Some(16 << 10)), Ok(16 << 10));
        assert!(matches!(mdadm_chunk_bytes(8, 522_240, Some(8 << 10)), Err(BitmapError::ChunkTooSmallForRoom { .. })));
        assert!(matches!(mdadm_chunk_bytes(0, 522_240, None), Err(BitmapError::NoRoom { .. })));
        // Huge arrays push the minimum above 64 MiB: 100 TiB in 128 KiB of room.
        let c = mdadm_chunk_bytes(256, 100u64 << 31, None).unwrap();
        assert!(c > 64 << 20 && c.is_power_of_two());
    }

    #[test]
    fn bm_space_thresholds() {
        assert_eq!(choose_bm_space(127), 0);
        assert_eq!(choose_bm_space(524_288), 8);
        assert_eq!(choose_bm_space(8 * 1024 * 1024 * 2 + 9), 128);
        assert_eq!(choose_bm_space(200 * 1024 * 1024 * 2 + 128), 256);
    }

    #[test]
    fn decode_rules() {
        let sb = BitmapSuper::new([1; 16], 64 << 20, 522_240);
        let bytes = sb.encode().unwrap();
        assert_eq!(BitmapSuper::decode(&bytes).unwrap(), sb);
        let mut v5 = sb.clone();
        v5.version = 5;
        let err = BitmapSuper::decode(&v5.encode_unchecked()).unwrap_err();
        assert!(err.to_string().contains("clustered"), "{err}");
        let mut v6 = sb.clone();
        v6.version = 6;
        assert!(BitmapSuper::decode(&v6.encode_unchecked()).unwrap_err().to_string().contains("lockless"));
        let mut v3 = sb.clone();
        v3.version = 3;
        assert!(BitmapSuper::decode(&v3.encode_unchecked()).is_ok());
        let mut c = sb.clone();
        c.chunk_bytes = 3 << 20;
        assert_eq!(
            BitmapSuper::decode(&c.encode_unchecked()),
            Err(BitmapError::ChunkNotPowerOfTwo { chunk_bytes: 3 << 20 })
        );
        c.chunk_bytes = 256;
        assert_eq!(BitmapSuper::decode(&c.encode_unchecked()), Err(BitmapError::ChunkTooSmall { chunk_bytes: 256 }));
        let mut d = sb.clone();
        d.daemon_sleep_secs = 0;
        assert_eq!(BitmapSuper::decode(&d.encode_unchecked()), Err(BitmapError::DaemonSleepZero));
        let mut w = sb.clone();
        w.write_behind = 16384;
        assert!(matches!(BitmapSuper::decode(&w.encode_unchecked()), Err(BitmapError::WriteBehindTooLarge { .. })));
        assert!(matches!(BitmapSuper::decode(&[0u8; 256]), Err(BitmapError::BadMagic { found: 0 })));
        assert!(matches!(BitmapSuper::decode(&[0u8; 100]), Err(BitmapError::TooShort { .. })));
        assert_eq!(sb.check_against_array(&[1; 16], 0), Ok(BitmapFreshness::Current));
        assert_eq!(sb.check_against_array(&[1; 16], 1), Ok(BitmapFreshness::Stale));
        assert!(sb.check_against_array(&[2; 16], 0).is_err());
    }

    #[test]
    fn bits_are_little_endian_after_the_header() {
        let sb = BitmapSuper::new([1; 16], 4096, 8 * 40_000);
        let geo = sb.geometry().unwrap();
        let mut area = vec![0u8; geo.area_bytes() as usize];
        sb.write_header(&mut area).unwrap();
        assert!(set_bit(&mut area, &geo, 9, true));
        assert_eq!(area[256 + 1], 0b10);
        assert_eq!(test_bit(&area, &geo, 9), Some(true));
        assert_eq!(count_dirty(&area, &geo), 1);
        assert!(!set_bit(&mut area, &geo, geo.chunks(), true));
        let init = sb.initial_area().unwrap();
        assert_eq!(count_dirty(&init, &geo), geo.chunks());
        assert_eq!(BitmapSuper::decode(&init).unwrap(), sb);
    }

    #[test]
    fn sync_size_semantics() {
        assert_eq!(mdadm_create_sync_size_sectors(5, 1000, 4, 2), 1000);
        // raid10 n2 on 4 devices: half the raw capacity.
        assert_eq!(mdadm_create_sync_size_sectors(10, 1000, 4, 0x102), 2000);
        assert_eq!(mdadm_create_sync_size_sectors(10, 1000, 3, 0x102), 1500);
        assert_eq!(kernel_sync_size_sectors(10, 1000, 1500), 1500);
        assert_eq!(kernel_sync_size_sectors(1, 1000, 1000), 1000);
    }
}
