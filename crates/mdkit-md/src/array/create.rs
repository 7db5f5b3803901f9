//! Creating an array at run time: plan it exactly as `mdadm --create` does
//! (`format::create::plan`), write each member's superblock (and bitmap area) as whole 4 KiB FUA
//! blocks, clear leftover md superblocks at the other v1 locations, then assemble it. A new
//! redundant array resyncs in the background unless created `assume_clean` (raid4/5 build the
//! last member by recovery, as mdadm does).

use std::io;
use std::time::{SystemTime, UNIX_EPOCH};

use mdkit_io::{BlockDeviceExt, WriteFlags};

use super::assemble::{AssembleOptions, Assembled, MemberDev, assemble, build_personality};
use crate::format::create::{BitmapRequest, CreatePlan, CreateRequest, InitialSync, plan};
use crate::format::superblock::{MD_SB_MAGIC, MetadataVersion, superblock_locations};
use crate::layout::Level;

/// What `mdkit create` is told.
#[derive(Clone, Debug)]
pub struct CreateOptions {
    /// mdkit's name for the array; also the superblock name (with `homehost`).
    pub name: String,
    pub level: Level,
    pub raid_devices: u32,
    /// `--chunk` (KiB); `None` = mdadm's default (512 KiB; none for raid1).
    pub chunk_kib: Option<u32>,
    /// `--layout` as the superblock value; `None` = default.
    pub layout: Option<u32>,
    pub bitmap: BitmapRequest,
    /// `--assume-clean`: no initial resync.
    pub assume_clean: bool,
    /// `--force` at create for raid4/5 (mdadm's meaning there): a full resync of every member
    /// instead of building the last member as a spare. Ignored with `assume_clean`.
    pub full_resync: bool,
    pub metadata: MetadataVersion,
    /// `--size` (KiB per member).
    pub size_kib: Option<u64>,
    pub homehost: Option<String>,
    /// Array UUID; random when `None`.
    pub uuid: Option<[u8; 16]>,
    /// `--write-behind` (raid1 with a bitmap): the bitmap's `write_behind`, 0 = off.
    pub write_behind: u32,
}

impl CreateOptions {
    pub fn new(name: impl Into<String>, level: Level, raid_devices: u32) -> CreateOptions {
        CreateOptions {
            name: name.into(),
            level,
            raid_devices,
            chunk_kib: None,
            layout: None,
            bitmap: BitmapRequest::None,
            assume_clean: false,
            full_resync: false,
            metadata: MetadataVersion::V1_2,
            size_kib: None,
            homehost: None,
            uuid: None,
            write_behind: 0,
        }
    }
}

/// 16 random bytes from the kernel.
pub fn random_uuid() -> io::Result<[u8; 16]> {
    let mut u = [0u8; 16];
    let f = std::fs::File::open("/dev/urandom")?;
    std::io::Read::read_exact(&mut &f, &mut u)?;
    Ok(u)
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

/// Plans the array for these members and writes its metadata; nothing is started. Fails before
/// writing anything when the plan is refused or the level cannot run in mdkit.
pub async fn write_superblocks(members: &[MemberDev], opts: &CreateOptions) -> io::Result<CreatePlan> {
    let uuid = match opts.uuid {
        Some(u) => u,
        None => random_uuid()?,
    };
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
    let mut req =
        CreateRequest::new(opts.level, members.iter().map(|m| m.dev.topology().size_bytes / 512).collect(), uuid, now);
    req.metadata = opts.metadata;
    req.raid_devices = opts.raid_devices;
    req.chunk_kib = opts.chunk_kib;
    req.layout = opts.layout;
    req.bitmap = opts.bitmap;
    req.bitmap_write_behind = opts.write_behind;
    req.size_kib = opts.size_kib;
    req.name = opts.name.clone();
    req.homehost = opts.homehost.clone();
    req.device_uuids = (0..members.len()).map(|_| random_uuid()).collect::<io::Result<_>>()?;
    req.sync = match (opts.assume_clean, opts.full_resync) {
        (true, _) => InitialSync::AssumeClean,
        (false, true) => InitialSync::Resync,
        (false, false) => InitialSync::MdadmDefault,
    };
    let p = plan(&req).map_err(|e| invalid(format!("{}: cannot create: {e}", opts.name)))?;
    // Refuse levels the runtime cannot run before touching any member.
    let sizes: Vec<u64> =
        p.members.iter().take(p.raid_disks as usize).map(|m| m.superblock.data_size_sectors).collect();
    build_personality(&opts.name, &p.members[0].superblock, &sizes)?;
    for (i, m) in members.iter().enumerate() {
        let sectors = m.dev.topology().size_bytes / 512;
        let mine = p.members[i].superblock_offset_bytes;
        // Leftover superblocks of an earlier array at the other locations would confuse probing.
        for (_, off) in superblock_locations(sectors) {
            let off_bytes = off * 512;
            if off_bytes == mine {
                continue;
            }
            let old = m
                .dev
                .read_metadata(off_bytes, 4096)
                .await
                .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", m.name)))?;
            if old[..4] == MD_SB_MAGIC.to_le_bytes() {
                m.dev
                    .write_slice(off_bytes, &[0u8; 4096], WriteFlags::FUA)
                    .await
                    .map_err(|e| io::Error::new(e.kind(), format!("{}: clearing an old superblock: {e}", m.name)))?;
            }
        }
        for (off, bytes) in p.member_writes(i) {
            m.dev
                .write_slice(off, bytes, WriteFlags::FUA)
                .await
                .map_err(|e| io::Error::new(e.kind(), format!("{}: writing metadata at byte {off}: {e}", m.name)))?;
        }
        m.dev.flush().await.map_err(|e| io::Error::new(e.kind(), format!("{}: flush: {e}", m.name)))?;
    }
    Ok(p)
}

/// Creates and starts an array on `members` (the first `raid_devices` in role order, the rest
/// spares).
pub async fn create(members: Vec<MemberDev>, opts: CreateOptions) -> io::Result<Assembled> {
    let p = write_superblocks(&members, &opts).await?;
    let uuid = p.members[0].superblock.set_uuid;
    assemble(members, AssembleOptions { name: opts.name.clone(), uuid: Some(uuid), ..AssembleOptions::default() }).await
}
