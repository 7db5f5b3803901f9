//! What a pool start does with the metadata device: open what is there, or format it — and the
//! rules that keep a pool from ever being formatted by accident.
//!
//! * Opening ([`OpenMode::Open`]) never writes before the metadata proved sound: a zeroed or
//!   damaged superblock, or damage `check_on_open` finds, is an error naming the device and
//!   the block, with the way back (thin_restore from a thin_dump XML, thin_repair).
//! * Formatting needs a *blank* device: the superblock and every block up to
//!   [`BLANK_SCAN_BLOCKS`] are zeroes. Formatting writes the superblock and the space maps
//!   into those first blocks, and nothing ever zeroes them again, so a pool whose superblock
//!   was lost is not blank and is never formatted over ([`OpenMode::Create`],
//!   [`OpenMode::OpenOrCreate`]). Only [`OpenMode::Overwrite`] (`pool-create --force`)
//!   formats a device that holds something.

use std::fmt;

use super::state::ModeCause;
use super::{OpenMode, PoolError, PoolErrorKind, PoolOptions};
use crate::meta::block::{BlockKind, identify, zeroed_block};
use crate::meta::{CheckOptions, FormatOptions, MetaError, MetaIo, OpenOptions, Superblock, ThinMetadata, check};

/// Blocks that must be zeroes for a metadata device to count as blank (1 MiB).
pub const BLANK_SCAN_BLOCKS: u64 = 256;

macro_rules! recover_text {
    () => {
        "restore the metadata from a thin_dump XML with thin_restore, or repair it offline with thin_repair \
         (check it with `mdkit thin check`)"
    };
}

/// How to get a pool back when its metadata cannot be opened.
pub const RECOVER: &str = recover_text!();

/// The tail of every refused open: nothing changed, and the way back.
pub const RECOVERY_HINT: &str = concat!("nothing was written; to recover, ", recover_text!());

/// What to do about a device with no superblock: format it if it is new, else recover.
pub fn no_superblock_hint(contents: &DeviceContents) -> String {
    let new = "a new pool is formatted only by `mdkit thin pool-create` or a config pool with `create = true`";
    match contents {
        DeviceContents::Blank => {
            format!("nothing was written; if the device is new, {new}; if it held a pool, {RECOVER}")
        }
        _ => format!("{RECOVERY_HINT} ({new}, and only on a blank device)"),
    }
}

/// What the first blocks of a metadata device hold.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceContents {
    /// Every block scanned is zeroes.
    Blank,
    /// A valid thin superblock.
    Pool { trans_id: u64, data_block_bytes: u64 },
    /// Block 0 is zeroes but a later block is not (a pool whose superblock was lost?).
    ZeroSuperblock { first_nonzero_block: u64, kind: Option<BlockKind> },
    /// Block 0 holds something that is not a valid thin superblock.
    Other { reason: String },
}

impl fmt::Display for DeviceContents {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceContents::Blank => write!(f, "blank (the first {BLANK_SCAN_BLOCKS} blocks are zeroes)"),
            DeviceContents::Pool { trans_id, data_block_bytes } => write!(
                f,
                "it already holds a thin pool (transaction id {trans_id}, {} KiB data blocks)",
                data_block_bytes >> 10
            ),
            DeviceContents::ZeroSuperblock { first_nonzero_block, kind } => {
                write!(f, "block 0 (the superblock) is all zeroes but block {first_nonzero_block} is not")?;
                match kind {
                    Some(k) => write!(f, " (a valid thin {k}: the superblock of a pool was lost)"),
                    None => Ok(()),
                }
            }
            DeviceContents::Other { reason } => write!(f, "it is neither blank nor a thin pool ({reason})"),
        }
    }
}

/// Reads the superblock and, when block 0 is zeroes, scans the next blocks.
pub fn inspect(io: &dyn MetaIo) -> Result<DeviceContents, MetaError> {
    match ThinMetadata::read_superblock(io) {
        Ok(sb) => Ok(pool_contents(&sb)),
        Err(MetaError::Corrupt { block: 0, .. }) if io.nr_blocks() > 0 && block_is_zero(io, 0)? => {
            scan_after_superblock(io)
        }
        Err(e @ MetaError::Io { .. }) => Err(e),
        Err(e) => Ok(DeviceContents::Other { reason: e.to_string() }),
    }
}

fn pool_contents(sb: &Superblock) -> DeviceContents {
    DeviceContents::Pool { trans_id: sb.trans_id, data_block_bytes: u64::from(sb.data_block_size_sectors) * 512 }
}

fn scan_after_superblock(io: &dyn MetaIo) -> Result<DeviceContents, MetaError> {
    let mut buf = zeroed_block();
    for b in 1..io.nr_blocks().min(BLANK_SCAN_BLOCKS) {
        read(io, b, &mut buf)?;
        if buf.iter().any(|&x| x != 0) {
            return Ok(DeviceContents::ZeroSuperblock { first_nonzero_block: b, kind: identify(&buf) });
        }
    }
    Ok(DeviceContents::Blank)
}

fn block_is_zero(io: &dyn MetaIo, block: u64) -> Result<bool, MetaError> {
    let mut buf = zeroed_block();
    read(io, block, &mut buf)?;
    Ok(buf.iter().all(|&x| x == 0))
}

fn read(io: &dyn MetaIo, block: u64, buf: &mut crate::meta::block::BlockBuf) -> Result<(), MetaError> {
    io.read_block(block, buf).map_err(|source| MetaError::Io {
        device: io.name().to_string(),
        op: "read",
        block,
        source,
    })
}

/// The opened (or formatted) engine, whether it was formatted, and why it is read-only.
pub(crate) struct Opened {
    pub md: ThinMetadata,
    pub created: bool,
    pub read_only: Option<(ModeCause, String)>,
}

/// Opens or formats the metadata on `io` as `mode` says (see the module docs).
pub(crate) fn open_or_format(
    name: &str,
    io: &std::sync::Arc<dyn MetaIo>,
    data_bytes: u64,
    opts: &PoolOptions,
    mode: OpenMode,
) -> Result<Opened, PoolError> {
    let engine_opts =
        OpenOptions { read_only: false, cache_blocks: opts.metadata_cache_blocks, ..OpenOptions::default() };
    let contents = inspect(&**io).map_err(|e| PoolError::new(name, PoolErrorKind::Meta(e)))?;
    let format_with = match (mode, &contents) {
        (OpenMode::Overwrite { data_block_bytes }, _) => Some(data_block_bytes),
        (
            OpenMode::Create { data_block_bytes } | OpenMode::OpenOrCreate { data_block_bytes },
            DeviceContents::Blank,
        ) => Some(data_block_bytes),
        (OpenMode::Create { .. }, _) => {
            return Err(PoolError::new(name, PoolErrorKind::NotBlank { device: io.name().to_string(), contents }));
        }
        (OpenMode::Open, DeviceContents::Blank) | (_, DeviceContents::ZeroSuperblock { .. }) => {
            return Err(PoolError::new(name, PoolErrorKind::NoSuperblock { device: io.name().to_string(), contents }));
        }
        _ => None,
    };
    match format_with {
        Some(bytes) => format(name, io, data_bytes, opts, engine_opts, bytes),
        None => open_existing(name, io, opts, engine_opts),
    }
}

fn format(
    name: &str,
    io: &std::sync::Arc<dyn MetaIo>,
    data_bytes: u64,
    opts: &PoolOptions,
    engine_opts: OpenOptions,
    data_block_bytes: u64,
) -> Result<Opened, PoolError> {
    let invalid = |m: String| PoolError::new(name, PoolErrorKind::InvalidArgument(m));
    if opts.read_only {
        return Err(invalid("cannot create a pool read-only".into()));
    }
    let sectors = data_block_sectors(name, data_block_bytes)?;
    let nr_data_blocks = data_bytes / data_block_bytes;
    if nr_data_blocks == 0 {
        return Err(invalid(format!(
            "the data device ({data_bytes} bytes) is smaller than one {data_block_bytes}-byte data block"
        )));
    }
    let fo = FormatOptions { data_block_size_sectors: sectors, nr_data_blocks, metadata_nr_blocks: None };
    let md = ThinMetadata::format_with(io.clone(), fo, engine_opts)
        .map_err(|e| PoolError::new(name, PoolErrorKind::Meta(e)))?;
    tracing::info!(pool = name, metadata = io.name(), data_block_bytes, nr_data_blocks, "formatted a new thin pool");
    Ok(Opened { md, created: true, read_only: None })
}

fn open_existing(
    name: &str,
    io: &std::sync::Arc<dyn MetaIo>,
    opts: &PoolOptions,
    engine_opts: OpenOptions,
) -> Result<Opened, PoolError> {
    let damaged = |e: MetaError| {
        let kind = if e.is_corruption() { PoolErrorKind::Damaged(e) } else { PoolErrorKind::Meta(e) };
        PoolError::new(name, kind)
    };
    let sb = ThinMetadata::read_superblock(&**io).map_err(damaged)?;
    let needs_check = sb.needs_check();
    let read_only = opts.read_only || needs_check;
    if !read_only && opts.check_on_open {
        refuse_if_damaged(name, &**io)?;
    }
    let md = ThinMetadata::open_with(io.clone(), OpenOptions { read_only, ..engine_opts }).map_err(damaged)?;
    let reason = if needs_check {
        Some((
            ModeCause::NeedsCheck,
            "NEEDS_CHECK is set in the metadata superblock: run `mdkit thin check` (or thin_check/thin_repair) offline before using it read-write".to_string(),
        ))
    } else if opts.read_only {
        Some((ModeCause::ReadOnlyOption, "opened read-only".to_string()))
    } else {
        None
    };
    Ok(Opened { md, created: false, read_only: reason })
}

fn refuse_if_damaged(name: &str, io: &dyn MetaIo) -> Result<(), PoolError> {
    let report = check(io, &CheckOptions::default());
    if report.is_clean() {
        return Ok(());
    }
    let first = report.errors.first();
    Err(PoolError::new(
        name,
        PoolErrorKind::CheckFailed {
            device: io.name().to_string(),
            nr_errors: report.errors.len() as u64 + report.errors_not_recorded,
            first_block: first.and_then(|i| i.block),
            first: first.map(|i| i.to_string()).unwrap_or_default(),
        },
    ))
}

pub(crate) fn data_block_sectors(pool: &str, bytes: u64) -> Result<u32, PoolError> {
    let sectors = bytes / 512;
    let ok = bytes.is_multiple_of(512)
        && u32::try_from(sectors).is_ok_and(|s| crate::meta::superblock::check_data_block_size(s).is_ok());
    if !ok {
        return Err(PoolError::new(
            pool,
            PoolErrorKind::InvalidArgument(format!(
                "data block size {bytes} bytes: must be a multiple of 64 KiB between 64 KiB and 1 GiB"
            )),
        ));
    }
    Ok(sectors as u32)
}
