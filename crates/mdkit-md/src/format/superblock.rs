//! The md version-1 superblock (`struct mdp_superblock_1`, metadata 1.0 / 1.1 / 1.2).
//!
//! ```text
//!  off  size  field                 off  size  field
//!    0     4  magic a92b4efc          128     8  data_offset (sectors)
//!    4     4  major_version = 1       136     8  data_size (sectors)
//!    8     4  feature_map             144     8  super_offset (sectors)
//!   12     4  pad0 = 0                152     8  recovery_offset / journal_tail
//!   16    16  set_uuid                160     4  dev_number
//!   32    32  set_name "host:name"    164     4  cnt_corrected_read
//!   64     8  ctime (40b s, 24b us)   168    16  device_uuid
//!   72     4  level (signed)          184     1  devflags
//!   76     4  layout                  185     1  bblog_shift
//!   80     8  size (sectors/member)   186     2  bblog_size (sectors)
//!   88     4  chunksize (sectors)     188     4  bblog_offset (s32, from sb)
//!   92     4  raid_disks              192     8  utime
//!   96     4  bitmap_offset (s32)     200     8  events
//!            | ppl {s16 off, u16 sz}  208     8  resync_offset
//!  100     4  new_level               216     4  sb_csum
//!  104     8  reshape_position        220     4  max_dev
//!  112     4  delta_disks (s32)       224    32  pad3 = 0
//!  116     4  new_layout              256  2*max_dev  dev_roles[] (u16)
//!  120     4  new_chunk
//!  124     4  new_offset (s32)
//! ```
//! All little-endian. The kernel reads 4096 bytes at `super_offset`; the checksum covers
//! `256 + 2*max_dev` bytes. mdkit always writes the whole 4 KiB block (upstream md lesson 1).
//!
//! Sources: include/uapi/linux/raid/md_p.h, drivers/md/md.c (super_1_load, super_1_validate,
//! super_1_sync), mdadm super1.c; summarised in formats.md section 1.

use super::{METADATA_BLOCK_BYTES, le_u16, le_u32, le_u64, put_u16, put_u32, put_u64};

/// `MD_SB_MAGIC`.
pub const MD_SB_MAGIC: u32 = 0xa92b_4efc;
/// Size of the fixed part of the superblock, before `dev_roles[]`.
pub const SB_FIXED_BYTES: usize = 256;
/// Bytes read and written for a superblock.
pub const SB_BLOCK_BYTES: usize = METADATA_BLOCK_BYTES;
/// Largest `max_dev` the kernel accepts: the roles must fit in one 4 KiB block.
pub const MAX_DEV_ROLES: u32 = ((SB_BLOCK_BYTES - SB_FIXED_BYTES) / 2) as u32;
/// `MaxSector`: "in sync everywhere" for `resync_offset`, "no recovery" for `recovery_offset`.
pub const MAX_SECTOR: u64 = u64::MAX;
/// The kernel refuses members whose `data_size` is below this (sectors).
pub const MIN_DATA_SIZE_SECTORS: u64 = 10;

/// Byte offsets of every field (see the module diagram).
pub mod off {
    pub const MAGIC: usize = 0;
    pub const MAJOR_VERSION: usize = 4;
    pub const FEATURE_MAP: usize = 8;
    pub const PAD0: usize = 12;
    pub const SET_UUID: usize = 16;
    pub const SET_NAME: usize = 32;
    pub const CTIME: usize = 64;
    pub const LEVEL: usize = 72;
    pub const LAYOUT: usize = 76;
    pub const SIZE: usize = 80;
    pub const CHUNKSIZE: usize = 88;
    pub const RAID_DISKS: usize = 92;
    pub const BITMAP_OFFSET: usize = 96;
    /// `ppl.offset` (s16) shares bytes 96..98 with `bitmap_offset`.
    pub const PPL_OFFSET: usize = 96;
    /// `ppl.size` (u16) shares bytes 98..100 with `bitmap_offset`.
    pub const PPL_SIZE: usize = 98;
    pub const NEW_LEVEL: usize = 100;
    pub const RESHAPE_POSITION: usize = 104;
    pub const DELTA_DISKS: usize = 112;
    pub const NEW_LAYOUT: usize = 116;
    pub const NEW_CHUNK: usize = 120;
    pub const NEW_OFFSET: usize = 124;
    pub const DATA_OFFSET: usize = 128;
    pub const DATA_SIZE: usize = 136;
    pub const SUPER_OFFSET: usize = 144;
    pub const RECOVERY_OFFSET: usize = 152;
    pub const DEV_NUMBER: usize = 160;
    pub const CNT_CORRECTED_READ: usize = 164;
    pub const DEVICE_UUID: usize = 168;
    pub const DEVFLAGS: usize = 184;
    pub const BBLOG_SHIFT: usize = 185;
    pub const BBLOG_SIZE: usize = 186;
    pub const BBLOG_OFFSET: usize = 188;
    pub const UTIME: usize = 192;
    pub const EVENTS: usize = 200;
    pub const RESYNC_OFFSET: usize = 208;
    pub const SB_CSUM: usize = 216;
    pub const MAX_DEV: usize = 220;
    pub const PAD3: usize = 224;
    pub const PAD3_BYTES: usize = 32;
    pub const DEV_ROLES: usize = 256;
}

// The layout must match the C struct exactly (mdadm checks the same three facts).
const _: () = assert!(off::DATA_OFFSET == 128);
const _: () = assert!(off::UTIME == 192);
const _: () = assert!(off::PAD3 + off::PAD3_BYTES == SB_FIXED_BYTES);
const _: () = assert!(off::DEV_ROLES == SB_FIXED_BYTES);
const _: () = assert!(SB_FIXED_BYTES + 2 * MAX_DEV_ROLES as usize == SB_BLOCK_BYTES);

/// `feature_map` bits (md_p.h).
pub mod feature {
    /// `bitmap_offset` is valid: an internal write-intent bitmap exists.
    pub const BITMAP_OFFSET: u32 = 1;
    /// `recovery_offset` is valid for this device (partially rebuilt).
    pub const RECOVERY_OFFSET: u32 = 2;
    /// Reshape fields are valid.
    pub const RESHAPE_ACTIVE: u32 = 4;
    /// The bad-block list is not empty.
    pub const BAD_BLOCKS: u32 = 8;
    /// This device is replacing the active device with the same role.
    pub const REPLACEMENT: u32 = 16;
    /// Reshape runs from the end towards the start.
    pub const RESHAPE_BACKWARDS: u32 = 32;
    /// `new_offset` is valid.
    pub const NEW_OFFSET: u32 = 64;
    /// The recovery in progress is bitmap-guided (re-add).
    pub const RECOVERY_BITMAP: u32 = 128;
    /// md-cluster (mdadm calls this bit BITMAP_VERSIONED).
    pub const CLUSTERED: u32 = 256;
    /// The array has a raid5 write journal.
    pub const JOURNAL: u32 = 512;
    /// Partial parity log; `ppl` is valid instead of `bitmap_offset`.
    pub const PPL: u32 = 1024;
    /// Multiple-PPL area.
    pub const MULTIPLE_PPLS: u32 = 2048;
    /// `layout` is meaningful for raid0 (multi-zone arrays).
    pub const RAID0_LAYOUT: u32 = 4096;
    /// Every bit the kernel knows (`MD_FEATURE_ALL`); anything else is refused.
    pub const ALL: u32 = 0x1fff;

    /// Names of the set bits, lowest first (for messages and JSON).
    pub fn names(map: u32) -> Vec<&'static str> {
        const NAMES: [&str; 13] = [
            "bitmap_offset",
            "recovery_offset",
            "reshape_active",
            "bad_blocks",
            "replacement",
            "reshape_backwards",
            "new_offset",
            "recovery_bitmap",
            "clustered",
            "journal",
            "ppl",
            "multiple_ppls",
            "raid0_layout",
        ];
        NAMES.iter().enumerate().filter(|(i, _)| map & (1 << i) != 0).map(|(_, n)| *n).collect()
    }
}

/// Device-role values in `dev_roles[]` (anything below [`ROLE_MAX`] is a slot number).
pub const ROLE_SPARE: u16 = 0xffff;
pub const ROLE_FAULTY: u16 = 0xfffe;
pub const ROLE_JOURNAL: u16 = 0xfffd;
/// Largest regular role is `ROLE_MAX - 1`.
pub const ROLE_MAX: u16 = 0xff00;

/// `devflags` bits.
pub const DEVFLAG_WRITE_MOSTLY: u8 = 1;
pub const DEVFLAG_FAILFAST: u8 = 2;

/// Why a superblock is refused. Each message names the reason and the values involved; the
/// caller adds the member name and the byte offset it read from.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SuperblockError {
    #[error("superblock buffer is {len_bytes} bytes, need {SB_BLOCK_BYTES}")]
    TooShort { len_bytes: usize },
    #[error("bad magic {found:#010x} (expected {MD_SB_MAGIC:#010x}): no md v1 superblock here")]
    BadMagic { found: u32 },
    #[error("major_version {found} is not 1")]
    BadMajorVersion { found: u32 },
    #[error("max_dev {max_dev} is larger than {MAX_DEV_ROLES} (roles would not fit in 4 KiB)")]
    TooManyDevRoles { max_dev: u32 },
    #[error(
        "super_offset {recorded_sectors} does not match where the superblock was read ({expected_sectors} sectors)"
    )]
    SuperOffsetMismatch { recorded_sectors: u64, expected_sectors: u64 },
    #[error("unknown feature bits {unknown_bits:#x} in feature_map {feature_map:#x}")]
    UnknownFeatures { feature_map: u32, unknown_bits: u32 },
    #[error("bad checksum: stored {stored:#010x}, computed {computed:#010x}")]
    BadChecksum { stored: u32, computed: u32 },
    #[error("data_size {data_size_sectors} sectors is below the minimum of {MIN_DATA_SIZE_SECTORS}")]
    DataSizeTooSmall { data_size_sectors: u64 },
    #[error("padding field {field} is not zero (possibly a feature this version does not know)")]
    NonZeroPadding { field: &'static str },
    #[error(
        "data_offset {data_offset_sectors} overlaps the superblock ({super_offset_sectors} + {sb_sectors} sectors)"
    )]
    DataOverlapsSuperblock { data_offset_sectors: u64, super_offset_sectors: u64, sb_sectors: u64 },
    #[error(
        "reshape new data offset {new_data_offset_sectors} overlaps the superblock ({super_offset_sectors} + {sb_sectors} sectors)"
    )]
    NewDataOverlapsSuperblock { new_data_offset_sectors: u64, super_offset_sectors: u64, sb_sectors: u64 },
    #[error(
        "data_size {data_size_sectors} sectors is larger than the {available_sectors} sectors available on the device"
    )]
    DataBeyondDevice { data_size_sectors: u64, available_sectors: u64 },
    #[error("bad-block log invalid: {reason}")]
    BadBlockLog { reason: String },
    #[error("RAID0_LAYOUT feature set on level {level} (only raid0 may carry it)")]
    Raid0LayoutOnOtherLevel { level: i32 },
    #[error("PPL feature combined with {other} (the kernel refuses this)")]
    PplConflict { other: &'static str },
    #[error("device role is journal but the JOURNAL feature is not set")]
    JournalRoleWithoutFeature,
    /// A field outside the kernel's limits (see [`super::validate`]).
    #[error("field {field} = {value}: {reason}")]
    Field { field: &'static str, value: String, reason: String },
}

/// Which of the three v1 placements a superblock uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MetadataVersion {
    /// 1.0: near the end of the device (8..12 KiB from the end, 4 KiB aligned).
    V1_0,
    /// 1.1: at the start of the device.
    V1_1,
    /// 1.2: 4 KiB from the start (mdadm's default).
    V1_2,
}

impl MetadataVersion {
    pub const ALL: [MetadataVersion; 3] = [MetadataVersion::V1_0, MetadataVersion::V1_1, MetadataVersion::V1_2];

    pub fn minor(self) -> u32 {
        match self {
            MetadataVersion::V1_0 => 0,
            MetadataVersion::V1_1 => 1,
            MetadataVersion::V1_2 => 2,
        }
    }

    pub fn from_minor(minor: u32) -> Option<MetadataVersion> {
        match minor {
            0 => Some(MetadataVersion::V1_0),
            1 => Some(MetadataVersion::V1_1),
            2 => Some(MetadataVersion::V1_2),
            _ => None,
        }
    }

    /// "1.0", "1.1", "1.2".
    pub fn as_str(self) -> &'static str {
        match self {
            MetadataVersion::V1_0 => "1.0",
            MetadataVersion::V1_1 => "1.1",
            MetadataVersion::V1_2 => "1.2",
        }
    }

    /// Parses mdadm's `--metadata` spellings: "1.0", "1.00", "1.1", "1.01", "1.2", "1.02",
    /// "default" (= 1.2).
    pub fn parse(text: &str) -> Option<MetadataVersion> {
        match text.trim_start_matches('0') {
            "1.0" | "1.00" => Some(MetadataVersion::V1_0),
            "1.1" | "1.01" => Some(MetadataVersion::V1_1),
            "1.2" | "1.02" | "default" => Some(MetadataVersion::V1_2),
            _ => None,
        }
    }

    /// Where this version's superblock lives on a device of `device_sectors`, or `None` when the
    /// device is smaller than md's minimum of 24 sectors (mdadm and the kernel agree on this).
    pub fn sb_offset_sectors(self, device_sectors: u64) -> Option<u64> {
        if device_sectors < 24 {
            return None;
        }
        Some(match self {
            MetadataVersion::V1_0 => (device_sectors - 16) & !7,
            MetadataVersion::V1_1 => 0,
            MetadataVersion::V1_2 => 8,
        })
    }

    /// The version mdadm reports for a recorded `super_offset` (Examine: <= 4 is 1.1, <= 8 is
    /// 1.2, anything further out is 1.0).
    pub fn from_super_offset(super_offset_sectors: u64) -> MetadataVersion {
        if super_offset_sectors <= 4 {
            MetadataVersion::V1_1
        } else if super_offset_sectors <= 8 {
            MetadataVersion::V1_2
        } else {
            MetadataVersion::V1_0
        }
    }
}

/// Every place a v1 superblock may be found on a device of `device_sectors`, in the order
/// mdadm probes them (1.0, 1.1, 1.2). Empty when the device is too small for md.
pub fn superblock_locations(device_sectors: u64) -> Vec<(MetadataVersion, u64)> {
    MetadataVersion::ALL.iter().filter_map(|v| v.sb_offset_sectors(device_sectors).map(|o| (*v, o))).collect()
}

/// Packs a time as md stores it: low 40 bits seconds, high 24 bits microseconds.
pub fn md_time(seconds: u64, micros: u32) -> u64 {
    (seconds & 0xff_ffff_ffff) | ((u64::from(micros) & 0xff_ffff) << 40)
}

/// Seconds part of an md time.
pub fn md_time_seconds(raw: u64) -> u64 {
    raw & 0xff_ffff_ffff
}

/// Microseconds part of an md time.
pub fn md_time_micros(raw: u64) -> u32 {
    // 24 bits always fit in u32.
    (raw >> 40) as u32
}

/// Builds `set_name` the way mdadm does: "homehost:name" when a home host is given, the name
/// has no ':' and the result fits in 31 bytes; otherwise the name itself, truncated to 31 bytes.
/// The field is NUL padded.
pub fn compose_set_name(homehost: Option<&str>, name: &str) -> [u8; 32] {
    let mut out = [0u8; 32];
    let composed;
    let text = match homehost {
        Some(h) if !name.contains(':') && h.len() + 1 + name.len() < 32 => {
            composed = format!("{h}:{name}");
            composed.as_str()
        }
        _ => name,
    };
    let n = text.len().min(31);
    out[..n].copy_from_slice(&text.as_bytes()[..n]);
    out
}

/// The calc_sb_1_csum checksum of a superblock image: the sum of little-endian u32 words over
/// `256 + 2*max_dev` bytes (the checksum field counted as zero), a trailing u16 if `max_dev` is
/// odd, then the high 32 bits of the sum folded into the low 32 bits. Not a CRC.
///
/// `image` must hold at least `256 + 2*max_dev` bytes and `max_dev <= MAX_DEV_ROLES`.
pub fn sb_checksum(image: &[u8], max_dev: u32) -> u32 {
    assert!(max_dev <= MAX_DEV_ROLES, "caller checks max_dev before checksumming");
    let len = SB_FIXED_BYTES + 2 * max_dev as usize;
    assert!(image.len() >= len, "caller checks the image length before checksumming");
    let mut sum: u64 = 0;
    let mut pos = 0;
    while pos + 4 <= len {
        if pos != off::SB_CSUM {
            sum += u64::from(le_u32(image, pos));
        }
        pos += 4;
    }
    if len - pos == 2 {
        sum += u64::from(le_u16(image, pos));
    }
    ((sum & 0xffff_ffff) as u32).wrapping_add((sum >> 32) as u32)
}

/// The role a device has, decoded from its `dev_roles[]` entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceRole {
    /// In the array at this slot.
    Active(u16),
    /// Replacing the device in this slot (REPLACEMENT feature).
    Replacement(u16),
    Spare,
    Faulty,
    Journal,
}

/// A decoded v1 superblock. Field names carry units; raw on-disk encodings are kept where the
/// meaning depends on other fields (the bitmap/PPL union, the time fields).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Superblock {
    pub feature_map: u32,
    /// Array UUID (user space generated).
    pub set_uuid: [u8; 16],
    /// "homehost:name", NUL padded; see [`compose_set_name`].
    pub set_name: [u8; 32],
    /// Creation time, md encoding ([`md_time`]).
    pub ctime: u64,
    /// -1 linear, 0, 1, 4, 5, 6, 10; -4 multipath.
    pub level: i32,
    pub layout: u32,
    /// Per-member sectors used for data (array space per device). 0 for raid0/linear.
    pub size_sectors: u64,
    pub chunk_sectors: u32,
    pub raid_disks: u32,
    /// Raw bytes 96..100: `bitmap_offset` (s32) or `ppl {offset s16, size u16}`.
    pub bitmap_offset_raw: u32,
    pub new_level: i32,
    pub reshape_position_sectors: u64,
    pub delta_disks: i32,
    pub new_layout: u32,
    pub new_chunk_sectors: u32,
    pub new_offset_sectors: i32,
    pub data_offset_sectors: u64,
    pub data_size_sectors: u64,
    pub super_offset_sectors: u64,
    /// `recovery_offset` for members, `journal_tail` for journal devices.
    pub recovery_offset_sectors: u64,
    /// Permanent index of this device into `dev_roles` (not its role).
    pub dev_number: u32,
    pub cnt_corrected_read: u32,
    pub device_uuid: [u8; 16],
    pub devflags: u8,
    pub bblog_shift: u8,
    pub bblog_size_sectors: u16,
    /// From `super_offset` to the bad-block log; signed.
    pub bblog_offset_sectors: i32,
    /// Update time, md encoding.
    pub utime: u64,
    pub events: u64,
    /// Array is in sync below this (from data_offset); [`MAX_SECTOR`] = clean.
    pub resync_offset_sectors: u64,
    /// The checksum as stored on disk (recomputed by [`Superblock::encode`]).
    pub sb_csum: u32,
    /// `dev_roles[0..max_dev]`; `max_dev` is this vector's length.
    pub dev_roles: Vec<u16>,
}

/// Result of [`Superblock::decode_lenient`]: the fields plus everything the kernel would object
/// to, for tools that show a damaged superblock (like `mdadm --examine` does).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LenientSuperblock {
    pub superblock: Superblock,
    /// The checksum the stored bytes should have.
    pub computed_checksum: u32,
    /// Every refusal reason found, in the kernel's order of checks; empty when valid.
    pub problems: Vec<SuperblockError>,
}

impl Superblock {
    /// A blank superblock with the constant fields set and no roles; used as a builder base.
    pub fn empty() -> Superblock {
        Superblock {
            feature_map: 0,
            set_uuid: [0; 16],
            set_name: [0; 32],
            ctime: 0,
            level: 0,
            layout: 0,
            size_sectors: 0,
            chunk_sectors: 0,
            raid_disks: 0,
            bitmap_offset_raw: 0,
            new_level: 0,
            reshape_position_sectors: 0,
            delta_disks: 0,
            new_layout: 0,
            new_chunk_sectors: 0,
            new_offset_sectors: 0,
            data_offset_sectors: 0,
            data_size_sectors: 0,
            super_offset_sectors: 0,
            recovery_offset_sectors: 0,
            dev_number: 0,
            cnt_corrected_read: 0,
            device_uuid: [0; 16],
            devflags: 0,
            bblog_shift: 0,
            bblog_size_sectors: 0,
            bblog_offset_sectors: 0,
            utime: 0,
            events: 0,
            resync_offset_sectors: 0,
            sb_csum: 0,
            dev_roles: Vec::new(),
        }
    }

    /// Decodes and validates a superblock read from `expected_sb_offset_sectors`, applying the
    /// kernel's load rules (super_1_load / super_1_validate). `bytes` is the 4 KiB block read at
    /// that offset. Device-size dependent checks are in [`Superblock::check_fits_device`].
    pub fn decode(bytes: &[u8], expected_sb_offset_sectors: u64) -> Result<Superblock, SuperblockError> {
        let lenient = Superblock::decode_lenient(bytes)?;
        let mut problems = lenient.problems;
        let sb = lenient.superblock;
        if sb.super_offset_sectors != expected_sb_offset_sectors {
            // The kernel checks this right after magic/version/max_dev, before the checksum.
            problems.insert(
                0,
                SuperblockError::SuperOffsetMismatch {
                    recorded_sectors: sb.super_offset_sectors,
                    expected_sectors: expected_sb_offset_sectors,
                },
            );
        }
        match problems.into_iter().next() {
            Some(p) => Err(p),
            None => Ok(sb),
        }
    }

    /// Parses every field, refusing only what makes parsing impossible (short buffer, bad magic,
    /// wrong major version, `max_dev` too large); every other kernel objection is listed in
    /// `problems`. Use [`Superblock::decode`] for anything that trusts the result.
    pub fn decode_lenient(bytes: &[u8]) -> Result<LenientSuperblock, SuperblockError> {
        if bytes.len() < SB_BLOCK_BYTES {
            return Err(SuperblockError::TooShort { len_bytes: bytes.len() });
        }
        let magic = le_u32(bytes, off::MAGIC);
        if magic != MD_SB_MAGIC {
            return Err(SuperblockError::BadMagic { found: magic });
        }
        let major = le_u32(bytes, off::MAJOR_VERSION);
        if major != 1 {
            return Err(SuperblockError::BadMajorVersion { found: major });
        }
        let max_dev = le_u32(bytes, off::MAX_DEV);
        if max_dev > MAX_DEV_ROLES {
            return Err(SuperblockError::TooManyDevRoles { max_dev });
        }
        let sb = Superblock::parse_fields(bytes, max_dev);
        let computed_checksum = sb_checksum(bytes, max_dev);
        let pad0 = le_u32(bytes, off::PAD0);
        let pad3_nonzero = bytes[off::PAD3..off::PAD3 + off::PAD3_BYTES].iter().any(|b| *b != 0);
        let problems = sb.kernel_problems(computed_checksum, pad0 != 0, pad3_nonzero);
        Ok(LenientSuperblock { superblock: sb, computed_checksum, problems })
    }

    fn parse_fields(b: &[u8], max_dev: u32) -> Superblock {
        let mut set_uuid = [0u8; 16];
        set_uuid.copy_from_slice(&b[off::SET_UUID..off::SET_UUID + 16]);
        let mut set_name = [0u8; 32];
        set_name.copy_from_slice(&b[off::SET_NAME..off::SET_NAME + 32]);
        let mut device_uuid = [0u8; 16];
        device_uuid.copy_from_slice(&b[off::DEVICE_UUID..off::DEVICE_UUID + 16]);
        let dev_roles = (0..max_dev as usize).map(|i| le_u16(b, off::DEV_ROLES + 2 * i)).collect();
        Superblock {
            feature_map: le_u32(b, off::FEATURE_MAP),
            set_uuid,
            set_name,
            ctime: le_u64(b, off::CTIME),
            level: le_u32(b, off::LEVEL) as i32,
            layout: le_u32(b, off::LAYOUT),
            size_sectors: le_u64(b, off::SIZE),
            chunk_sectors: le_u32(b, off::CHUNKSIZE),
            raid_disks: le_u32(b, off::RAID_DISKS),
            bitmap_offset_raw: le_u32(b, off::BITMAP_OFFSET),
            new_level: le_u32(b, off::NEW_LEVEL) as i32,
            reshape_position_sectors: le_u64(b, off::RESHAPE_POSITION),
            delta_disks: le_u32(b, off::DELTA_DISKS) as i32,
            new_layout: le_u32(b, off::NEW_LAYOUT),
            new_chunk_sectors: le_u32(b, off::NEW_CHUNK),
            new_offset_sectors: le_u32(b, off::NEW_OFFSET) as i32,
            data_offset_sectors: le_u64(b, off::DATA_OFFSET),
            data_size_sectors: le_u64(b, off::DATA_SIZE),
            super_offset_sectors: le_u64(b, off::SUPER_OFFSET),
            recovery_offset_sectors: le_u64(b, off::RECOVERY_OFFSET),
            dev_number: le_u32(b, off::DEV_NUMBER),
            cnt_corrected_read: le_u32(b, off::CNT_CORRECTED_READ),
            device_uuid,
            devflags: b[off::DEVFLAGS],
            bblog_shift: b[off::BBLOG_SHIFT],
            bblog_size_sectors: le_u16(b, off::BBLOG_SIZE),
            bblog_offset_sectors: le_u32(b, off::BBLOG_OFFSET) as i32,
            utime: le_u64(b, off::UTIME),
            events: le_u64(b, off::EVENTS),
            resync_offset_sectors: le_u64(b, off::RESYNC_OFFSET),
            sb_csum: le_u32(b, off::SB_CSUM),
            dev_roles,
        }
    }

    /// The kernel's objections, in super_1_load / super_1_validate order.
    fn kernel_problems(&self, computed_checksum: u32, pad0_nonzero: bool, pad3_nonzero: bool) -> Vec<SuperblockError> {
        let mut p = Vec::new();
        let unknown = self.feature_map & !feature::ALL;
        if unknown != 0 {
            p.push(SuperblockError::UnknownFeatures { feature_map: self.feature_map, unknown_bits: unknown });
        }
        if computed_checksum != self.sb_csum {
            p.push(SuperblockError::BadChecksum { stored: self.sb_csum, computed: computed_checksum });
        }
        if self.data_size_sectors < MIN_DATA_SIZE_SECTORS {
            p.push(SuperblockError::DataSizeTooSmall { data_size_sectors: self.data_size_sectors });
        }
        if pad0_nonzero {
            p.push(SuperblockError::NonZeroPadding { field: "pad0" });
        }
        if pad3_nonzero {
            p.push(SuperblockError::NonZeroPadding { field: "pad3" });
        }
        p.extend(self.placement_problems());
        if self.feature_map & feature::BAD_BLOCKS != 0 {
            if self.bblog_size_sectors > 8 {
                p.push(SuperblockError::BadBlockLog {
                    reason: format!("bblog_size {} sectors exceeds one 4 KiB page", self.bblog_size_sectors),
                });
            }
            if self.bblog_offset_sectors == 0 {
                p.push(SuperblockError::BadBlockLog { reason: "BAD_BLOCKS set but bblog_offset is 0".into() });
            }
        }
        if self.feature_map & feature::RAID0_LAYOUT != 0 && self.level != 0 {
            p.push(SuperblockError::Raid0LayoutOnOtherLevel { level: self.level });
        }
        if self.feature_map & (feature::PPL | feature::MULTIPLE_PPLS) != 0 {
            if self.feature_map & feature::BITMAP_OFFSET != 0 {
                p.push(SuperblockError::PplConflict { other: "an internal bitmap" });
            }
            if self.feature_map & feature::JOURNAL != 0 {
                p.push(SuperblockError::PplConflict { other: "a write journal" });
            }
            if self.feature_map & feature::PPL != 0 && self.feature_map & feature::MULTIPLE_PPLS != 0 {
                p.push(SuperblockError::PplConflict { other: "MULTIPLE_PPLS" });
            }
        }
        if self.raw_role() == ROLE_JOURNAL && self.feature_map & feature::JOURNAL == 0 {
            p.push(SuperblockError::JournalRoleWithoutFeature);
        }
        p.extend(super::validate::field_problems(self));
        p
    }

    /// The superblock size the kernel uses for overlap checks: `256 + 2*max_dev` rounded up to
    /// the 512-byte logical block.
    pub fn sb_size_bytes(&self) -> u64 {
        let raw = SB_FIXED_BYTES as u64 + 2 * self.dev_roles.len() as u64;
        raw.div_ceil(512) * 512
    }

    fn placement_problems(&self) -> Vec<SuperblockError> {
        let mut p = Vec::new();
        if self.metadata_version() == MetadataVersion::V1_0 {
            return p;
        }
        let sb_sectors = self.sb_size_bytes() / 512;
        let sb_end = self.super_offset_sectors.saturating_add(sb_sectors);
        if self.data_offset_sectors < sb_end {
            p.push(SuperblockError::DataOverlapsSuperblock {
                data_offset_sectors: self.data_offset_sectors,
                super_offset_sectors: self.super_offset_sectors,
                sb_sectors,
            });
        }
        if let Some(new_off) = self.new_data_offset_sectors()
            && new_off < sb_end
        {
            p.push(SuperblockError::NewDataOverlapsSuperblock {
                new_data_offset_sectors: new_off,
                super_offset_sectors: self.super_offset_sectors,
                sb_sectors,
            });
        }
        p
    }

    /// The data offset a reshape is moving to (RESHAPE_ACTIVE + NEW_OFFSET), if any.
    pub fn new_data_offset_sectors(&self) -> Option<u64> {
        let both = feature::RESHAPE_ACTIVE | feature::NEW_OFFSET;
        if self.feature_map & both != both {
            return None;
        }
        Some(self.data_offset_sectors.wrapping_add_signed(i64::from(self.new_offset_sectors)))
    }

    /// Checks the fields that depend on the device size (`device_sectors`), as super_1_load
    /// does: the data area must fit on the device (1.1/1.2: `device - data_offset`; 1.0: below
    /// the superblock), and the bitmap and bad-block log must lie on it.
    pub fn check_fits_device(&self, device_sectors: u64) -> Result<(), SuperblockError> {
        match super::validate::device_problems(self, device_sectors).into_iter().next() {
            Some(p) => Err(p),
            None => Ok(()),
        }
    }

    /// Encodes the superblock into the 4 KiB block written at `super_offset`, computing the
    /// checksum, then decodes the result again and refuses to return bytes the kernel would
    /// refuse (pair assertion: verified before it can be written).
    pub fn encode(&self) -> Result<[u8; SB_BLOCK_BYTES], SuperblockError> {
        let max_dev = u32::try_from(self.dev_roles.len()).unwrap_or(u32::MAX);
        if max_dev > MAX_DEV_ROLES {
            return Err(SuperblockError::TooManyDevRoles { max_dev });
        }
        let mut b = [0u8; SB_BLOCK_BYTES];
        self.write_fields(&mut b, max_dev);
        let csum = sb_checksum(&b, max_dev);
        put_u32(&mut b, off::SB_CSUM, csum);
        Superblock::decode(&b, self.super_offset_sectors)?;
        Ok(b)
    }

    /// Like [`Superblock::encode`] but without validation: writes exactly these fields with a
    /// correct checksum. For tests and tools that must produce invalid superblocks on purpose.
    pub fn encode_unchecked(&self) -> [u8; SB_BLOCK_BYTES] {
        let max_dev = (self.dev_roles.len() as u32).min(MAX_DEV_ROLES);
        let mut b = [0u8; SB_BLOCK_BYTES];
        self.write_fields(&mut b, max_dev);
        let csum = sb_checksum(&b, max_dev);
        put_u32(&mut b, off::SB_CSUM, csum);
        b
    }

    fn write_fields(&self, b: &mut [u8; SB_BLOCK_BYTES], max_dev: u32) {
        put_u32(b, off::MAGIC, MD_SB_MAGIC);
        put_u32(b, off::MAJOR_VERSION, 1);
        put_u32(b, off::FEATURE_MAP, self.feature_map);
        b[off::SET_UUID..off::SET_UUID + 16].copy_from_slice(&self.set_uuid);
        b[off::SET_NAME..off::SET_NAME + 32].copy_from_slice(&self.set_name);
        put_u64(b, off::CTIME, self.ctime);
        put_u32(b, off::LEVEL, self.level as u32);
        put_u32(b, off::LAYOUT, self.layout);
        put_u64(b, off::SIZE, self.size_sectors);
        put_u32(b, off::CHUNKSIZE, self.chunk_sectors);
        put_u32(b, off::RAID_DISKS, self.raid_disks);
        put_u32(b, off::BITMAP_OFFSET, self.bitmap_offset_raw);
        put_u32(b, off::NEW_LEVEL, self.new_level as u32);
        put_u64(b, off::RESHAPE_POSITION, self.reshape_position_sectors);
        put_u32(b, off::DELTA_DISKS, self.delta_disks as u32);
        put_u32(b, off::NEW_LAYOUT, self.new_layout);
        put_u32(b, off::NEW_CHUNK, self.new_chunk_sectors);
        put_u32(b, off::NEW_OFFSET, self.new_offset_sectors as u32);
        put_u64(b, off::DATA_OFFSET, self.data_offset_sectors);
        put_u64(b, off::DATA_SIZE, self.data_size_sectors);
        put_u64(b, off::SUPER_OFFSET, self.super_offset_sectors);
        put_u64(b, off::RECOVERY_OFFSET, self.recovery_offset_sectors);
        put_u32(b, off::DEV_NUMBER, self.dev_number);
        put_u32(b, off::CNT_CORRECTED_READ, self.cnt_corrected_read);
        b[off::DEVICE_UUID..off::DEVICE_UUID + 16].copy_from_slice(&self.device_uuid);
        b[off::DEVFLAGS] = self.devflags;
        b[off::BBLOG_SHIFT] = self.bblog_shift;
        put_u16(b, off::BBLOG_SIZE, self.bblog_size_sectors);
        put_u32(b, off::BBLOG_OFFSET, self.bblog_offset_sectors as u32);
        put_u64(b, off::UTIME, self.utime);
        put_u64(b, off::EVENTS, self.events);
        put_u64(b, off::RESYNC_OFFSET, self.resync_offset_sectors);
        put_u32(b, off::MAX_DEV, max_dev);
        for (i, role) in self.dev_roles.iter().take(max_dev as usize).enumerate() {
            put_u16(b, off::DEV_ROLES + 2 * i, *role);
        }
    }

    /// Where the superblock sits, judged from `super_offset` like mdadm --examine does.
    pub fn metadata_version(&self) -> MetadataVersion {
        MetadataVersion::from_super_offset(self.super_offset_sectors)
    }

    /// `max_dev` as stored on disk.
    pub fn max_dev(&self) -> u32 {
        self.dev_roles.len() as u32
    }

    /// The raw `dev_roles[dev_number]`, or [`ROLE_SPARE`] when `dev_number` is outside the table
    /// (kernel and mdadm both treat that as a spare).
    pub fn raw_role(&self) -> u16 {
        self.dev_roles.get(self.dev_number as usize).copied().unwrap_or(ROLE_SPARE)
    }

    /// This device's role.
    pub fn role(&self) -> DeviceRole {
        match self.raw_role() {
            ROLE_SPARE => DeviceRole::Spare,
            ROLE_FAULTY => DeviceRole::Faulty,
            ROLE_JOURNAL => DeviceRole::Journal,
            r if r >= ROLE_MAX => DeviceRole::Spare,
            r if self.feature_map & feature::REPLACEMENT != 0 => DeviceRole::Replacement(r),
            r => DeviceRole::Active(r),
        }
    }

    /// Whether this member counts for the event-count check at assembly (kernel: a role below
    /// ROLE_MAX or the journal; spares and faulty devices are not checked).
    pub fn is_array_member(&self) -> bool {
        is_array_member_role(self.raw_role())
    }

    /// `set_name` up to its first NUL (lossy UTF-8).
    pub fn name(&self) -> String {
        let end = self.set_name.iter().position(|b| *b == 0).unwrap_or(self.set_name.len());
        String::from_utf8_lossy(&self.set_name[..end]).into_owned()
    }

    /// The internal bitmap's offset from the superblock (sectors, signed), when BITMAP_OFFSET
    /// is set.
    pub fn bitmap_offset_sectors(&self) -> Option<i32> {
        (self.feature_map & feature::BITMAP_OFFSET != 0).then_some(self.bitmap_offset_raw as i32)
    }

    /// Absolute sector of the bitmap superblock on this member.
    pub fn bitmap_sector(&self) -> Option<u64> {
        self.bitmap_offset_sectors().map(|o| self.super_offset_sectors.wrapping_add_signed(i64::from(o)))
    }

    /// The PPL area `(offset from sb in sectors, size in sectors)` when PPL is enabled.
    pub fn ppl(&self) -> Option<(i16, u16)> {
        if self.feature_map & (feature::PPL | feature::MULTIPLE_PPLS) == 0 {
            return None;
        }
        let offset = (self.bitmap_offset_raw & 0xffff) as u16 as i16;
        let size = (self.bitmap_offset_raw >> 16) as u16;
        Some((offset, size))
    }

    /// Absolute sector of the bad-block log, if one is reserved.
    pub fn bblog_sector(&self) -> Option<u64> {
        (self.bblog_size_sectors != 0 && self.bblog_offset_sectors != 0)
            .then(|| self.super_offset_sectors.wrapping_add_signed(i64::from(self.bblog_offset_sectors)))
    }

    /// Whether the array was shut down clean (`resync_offset == MaxSector`).
    pub fn is_clean(&self) -> bool {
        self.resync_offset_sectors == MAX_SECTOR
    }

    /// Count of array slots each role occupies: `slot_counts()[r]` = devices with role `r`,
    /// for `r < raid_disks + extra` (mdadm's "Array State" line counts the same way).
    pub fn slot_counts(&self, slots: u32) -> Vec<u32> {
        let mut counts = vec![0u32; slots as usize];
        for role in &self.dev_roles {
            if let Some(c) = counts.get_mut(*role as usize) {
                *c += 1;
            }
        }
        counts
    }
}

/// Whether a raw role takes part in the assembly event check (slot or journal).
pub fn is_array_member_role(role: u16) -> bool {
    role < ROLE_MAX || role == ROLE_JOURNAL
}

/// How a member's event count compares with the array's when assembling.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Freshness {
    /// Same events as the array.
    Current,
    /// Exactly one behind: accepted (a clean->dirty transition may have been skipped for it).
    OneBehind,
    /// Two or more behind: refused without `--force` (kernel `events + 1 < array events`).
    Stale,
    /// Newer than the array events given (the caller picked the wrong reference).
    Newer,
    /// A spare or faulty device: its event count is not checked.
    NotChecked,
}

/// The kernel's rule for one member: non-spares with `events + 1 < array_events` are stale.
pub fn member_freshness(member_events: u64, array_events: u64, raw_role: u16) -> Freshness {
    if !is_array_member_role(raw_role) {
        return Freshness::NotChecked;
    }
    if member_events > array_events {
        Freshness::Newer
    } else if member_events == array_events {
        Freshness::Current
    } else if member_events.saturating_add(1) == array_events {
        Freshness::OneBehind
    } else {
        Freshness::Stale
    }
}

/// Picks the reference superblock like the kernel's assembly: the non-spare member with the
/// highest event count (the first such on ties); if all are spares, the first one. Returns its
/// index, or `None` for an empty slice.
pub fn reference_member(sbs: &[Superblock]) -> Option<usize> {
    let mut best: Option<usize> = None;
    for (i, sb) in sbs.iter().enumerate() {
        if !sb.is_array_member() {
            continue;
        }
        match best {
            Some(b) if sbs[b].events >= sb.events => {}
            _ => best = Some(i),
        }
    }
    best.or(if sbs.is_empty() { None } else { Some(0) })
}

/// The array's event count at assembly (the reference member's), if any member is given.
pub fn array_events(sbs: &[Superblock]) -> Option<u64> {
    reference_member(sbs).map(|i| sbs[i].events)
}

/// Indices of the members the kernel would refuse as stale (non-spare, `events + 1 < max`).
pub fn stale_members(sbs: &[Superblock]) -> Vec<usize> {
    let Some(events) = array_events(sbs) else {
        return Vec::new();
    };
    sbs.iter()
        .enumerate()
        .filter(|(_, sb)| member_freshness(sb.events, events, sb.raw_role()) == Freshness::Stale)
        .map(|(i, _)| i)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Superblock {
        let mut sb = Superblock::empty();
        sb.feature_map = feature::BITMAP_OFFSET;
        sb.set_uuid = [7; 16];
        sb.set_name = compose_set_name(Some("host"), "md0");
        sb.ctime = md_time(1_700_000_000, 0);
        sb.level = 5;
        sb.layout = 2;
        sb.size_sectors = 520_192;
        sb.chunk_sectors = 1024;
        sb.raid_disks = 4;
        sb.bitmap_offset_raw = 8;
        sb.data_offset_sectors = 4096;
        sb.data_size_sectors = 520_192;
        sb.super_offset_sectors = 8;
        sb.dev_number = 2;
        sb.device_uuid = [9; 16];
        sb.bblog_size_sectors = 8;
        sb.bblog_offset_sectors = 16;
        sb.utime = sb.ctime;
        sb.events = 3;
        sb.resync_offset_sectors = MAX_SECTOR;
        let mut roles = vec![ROLE_SPARE; 128];
        for (i, r) in roles.iter_mut().take(4).enumerate() {
            *r = i as u16;
        }
        sb.dev_roles = roles;
        sb
    }

    #[test]
    fn round_trip() {
        let sb = sample();
        let bytes = sb.encode().unwrap();
        assert_eq!(le_u32(&bytes, 0), MD_SB_MAGIC);
        let back = Superblock::decode(&bytes, 8).unwrap();
        let mut expect = sb.clone();
        expect.sb_csum = back.sb_csum;
        assert_eq!(back, expect);
        assert_eq!(back.role(), DeviceRole::Active(2));
        assert_eq!(back.name(), "host:md0");
        assert_eq!(back.bitmap_sector(), Some(16));
        assert_eq!(back.bblog_sector(), Some(24));
    }

    #[test]
    fn checksum_matches_word_sum() {
        // Independent recomputation: plain sum over u32 words with the csum word zeroed.
        let bytes = sample().encode().unwrap();
        let mut copy = bytes;
        copy[off::SB_CSUM..off::SB_CSUM + 4].fill(0);
        let sum: u64 =
            copy[..256 + 256].chunks(4).map(|w| u64::from(u32::from_le_bytes([w[0], w[1], w[2], w[3]]))).sum();
        let folded = ((sum & 0xffff_ffff) + (sum >> 32)) as u32;
        assert_eq!(le_u32(&bytes, off::SB_CSUM), folded);
    }

    #[test]
    fn odd_max_dev_adds_trailing_u16() {
        let mut sb = sample();
        sb.dev_roles.truncate(5);
        let bytes = sb.encode().unwrap();
        assert!(Superblock::decode(&bytes, 8).is_ok());
        // Changing the trailing u16 (role 4) changes the checksum.
        let mut bad = bytes;
        bad[off::DEV_ROLES + 8] ^= 1;
        assert!(matches!(Superblock::decode(&bad, 8), Err(SuperblockError::BadChecksum { .. })));
        // Bytes beyond the roles are outside the checksum.
        let mut outside = bytes;
        outside[off::DEV_ROLES + 10] ^= 1;
        assert!(Superblock::decode(&outside, 8).is_ok());
    }

    #[test]
    fn refusals_name_reasons() {
        let good = sample().encode().unwrap();
        let mut b = good;
        b[0] ^= 1;
        assert!(matches!(Superblock::decode(&b, 8), Err(SuperblockError::BadMagic { .. })));
        assert!(matches!(Superblock::decode(&good, 0), Err(SuperblockError::SuperOffsetMismatch { .. })));
        let mut s = sample();
        s.data_offset_sectors = 8;
        let bytes = s.encode_unchecked();
        let err = Superblock::decode(&bytes, 8).unwrap_err();
        assert!(matches!(err, SuperblockError::DataOverlapsSuperblock { .. }), "{err}");
        assert!(err.to_string().contains("overlaps the superblock"));
    }

    #[test]
    fn time_and_name_helpers() {
        let t = md_time(1_234_567_890, 654_321);
        assert_eq!(md_time_seconds(t), 1_234_567_890);
        assert_eq!(md_time_micros(t), 654_321);
        assert_eq!(&compose_set_name(None, "data")[..5], b"data\0");
        assert_eq!(&compose_set_name(Some("h"), "a:b")[..4], b"a:b\0");
        let long = "x".repeat(40);
        let n = compose_set_name(Some("host"), &long);
        assert_eq!(n[30], b'x');
        assert_eq!(n[31], 0);
    }

    #[test]
    fn locations() {
        let dev = 524_288;
        assert_eq!(MetadataVersion::V1_0.sb_offset_sectors(dev), Some(524_272));
        assert_eq!(MetadataVersion::V1_1.sb_offset_sectors(dev), Some(0));
        assert_eq!(MetadataVersion::V1_2.sb_offset_sectors(dev), Some(8));
        // 1.0 is at least 8 KiB and less than 12 KiB from the end, 4 KiB aligned.
        for dev in 24..2000u64 {
            let o = MetadataVersion::V1_0.sb_offset_sectors(dev).unwrap();
            assert_eq!(o % 8, 0);
            assert!(dev - o >= 16 && dev - o < 24);
        }
        assert_eq!(MetadataVersion::V1_2.sb_offset_sectors(23), None);
        assert_eq!(superblock_locations(10), vec![]);
    }

    #[test]
    fn freshness_rules() {
        assert_eq!(member_freshness(10, 10, 0), Freshness::Current);
        assert_eq!(member_freshness(9, 10, 0), Freshness::OneBehind);
        assert_eq!(member_freshness(8, 10, 3), Freshness::Stale);
        assert_eq!(member_freshness(1, 10, ROLE_SPARE), Freshness::NotChecked);
        assert_eq!(member_freshness(1, 10, ROLE_FAULTY), Freshness::NotChecked);
        assert_eq!(member_freshness(1, 10, ROLE_JOURNAL), Freshness::Stale);
        let mut a = sample();
        a.events = 10;
        let mut b = sample();
        b.events = 8;
        let mut c = sample();
        c.events = 20;
        c.dev_number = 100; // outside the active roles: a spare, never the reference
        let all = [a, b, c];
        assert_eq!(reference_member(&all), Some(0));
        assert_eq!(array_events(&all), Some(10));
        assert_eq!(stale_members(&all), vec![1]);
    }
}
